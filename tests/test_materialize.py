"""Meta-device initialisation: one unit at a time, the same full parameters at every world size."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst


def _gathered(recipe, units, seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = recipe.build()
    torch.manual_seed(seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    full = fsdpfn.unshard(params)
    still_meta = all(p.is_meta for p in model.parameters())
    return {k: v.clone() for k, v in full.items()}, still_meta


@settings(max_examples=25)
@given(data=st.data(), seed=st.integers(0, 1000))
def test_meta_init_gives_the_same_parameters_at_every_world_size(data, seed):
    recipe = data.draw(fst.model_recipes())
    units = data.draw(fst.unit_plans(recipe))
    (reference, meta1), = spmd(1, _gathered, recipe, units, seed)
    assert meta1
    for world in (2, 3, 4):
        for full, still_meta in spmd(world, _gathered, recipe, units, seed):
            assert still_meta  # the module never holds real parameters afterwards
            assert full.keys() == reference.keys()
            for k in reference:
                assert torch.equal(full[k], reference[k]), (world, k)


class _Stack(nn.Module):
    def __init__(self, n=8, width=64):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _peak_worker():
    with torch.device("meta"):
        model = _Stack()
    peak = [0]

    def init(mod):
        mod.reset_parameters()
        live = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
        peak[0] = max(peak[0], live)

    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=nn.Linear, init=init)
    unit_bytes = (64 * 64 + 64) * 4
    apply = fsdpfn.fsdp(model)
    loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 64)).sum())(params)
    return peak[0], unit_bytes, loss.item(), len(params.plan.units)


def test_meta_init_holds_one_unit_at_a_time_and_trains():
    for peak, unit_bytes, loss, units in spmd(2, _peak_worker):
        assert units == 8
        # the model is 8 units; at any time at most one unit's full parameters exist
        assert peak == unit_bytes
        assert loss == loss  # finite forward/backward through the meta-initialised module


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3))
        self.register_buffer("count", torch.empty((), dtype=torch.long))


def _custom_worker(with_init):
    with torch.device("meta"):
        model = _Custom()

    def init(mod):
        with torch.no_grad():
            mod.scale.fill_(2.0)
            mod.count.fill_(7)

    params = fsdpfn.shard(model, fsdpfn.init_mesh(), init=init if with_init else None)
    return fsdpfn.unshard(params)["scale"], params["count"]


def test_custom_modules_need_an_init_function():
    for scale, count in spmd(2, _custom_worker, True):
        assert torch.equal(scale, torch.full((3,), 2.0)) and count.item() == 7
    with pytest.raises(ValueError, match="has no reset_parameters.*pass init="):
        spmd(2, _custom_worker, False)


WAYS = ("in_place", "data", "assigned", "forgotten")


class _Mixed(nn.Module):
    """A module whose initialiser writes each of its own tensors one way (``WAYS``): in place (the
    version counter moves), through ``.data`` (it does not), by assigning a new tensor, or not at all."""

    def __init__(self, ways):
        super().__init__()
        self.ways = ways
        self.weight = nn.Parameter(torch.empty(3, 2))
        self.register_buffer("scale", torch.empty(2))
        self.register_buffer("mask", torch.empty(2, 2, dtype=torch.bool))
        self.register_buffer("index", torch.empty(3, dtype=torch.long))

    def _values(self):
        # mask all True and index all 7: the value a first marker could take for bool, not for long
        return {"weight": torch.randn(3, 2), "scale": torch.rand(2) + 1, "mask": torch.ones(2, 2, dtype=torch.bool), "index": torch.full((3,), 7)}

    def reset_parameters(self):
        values = self._values()
        for name, way in zip(("weight", "scale", "mask", "index"), self.ways):
            t = getattr(self, name)
            if way == "in_place":
                with torch.no_grad():
                    t.copy_(values[name])
            elif way == "data":
                t.data.copy_(values[name])
            elif way == "assigned":
                if name == "weight":
                    self.weight = nn.Parameter(values[name])
                else:
                    setattr(self, name, values[name])

    def forward(self, x):
        return x @ self.weight.t() * self.scale.sum() * self.mask.sum() * self.index.sum()


def _mixed_worker(ways, seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = nn.Sequential(_Mixed(ways))
    torch.manual_seed(seed)
    try:
        params = fsdpfn.shard(model, fsdpfn.init_mesh())
    except ValueError as e:
        return str(e), None, None
    after = torch.rand(4)  # the random stream moved on as if the initialiser ran once
    full = {k: v.clone() for k, v in fsdpfn.unshard(params).items()}
    return None, full | {k: params[k].clone() for k in params.plan.buffers}, after


@settings(max_examples=20, deadline=None)
@given(ways=st.tuples(*[st.sampled_from(WAYS)] * 4), seed=st.integers(0, 100), world=st.integers(1, 3))
def test_meta_init_refuses_tensors_the_initialiser_left_unwritten(ways, seed, world):
    """Every allocated tensor the initialiser does not write is named (its memory is arbitrary); every
    one it writes, however, is accepted with the values a real module's initialiser gives, and the
    random stream afterwards is the same."""
    torch.manual_seed(seed)
    ref = _Mixed(ways)
    ref.reset_parameters()
    ref_after = torch.rand(4)
    names = ("weight", "scale", "mask", "index")
    forgotten = [n for n, w in zip(names, ways) if w == "forgotten"]
    for err, full, after in spmd(world, _mixed_worker, ways, seed):
        if forgotten:
            assert err is not None and "reset_parameters() left" in err
            for n in names:
                assert (repr(n) in err) == (n in forgotten), (n, err)
            continue
        assert err is None, err
        assert torch.equal(after, ref_after)
        for n in names:
            assert torch.equal(full[f"0.{n}"], getattr(ref, n)), n
