"""shard(): unit plans, ownership, ties, buffers, policies, and errors that name the culprit."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.ops import resolve_units
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.models import TinyBlock, TinyTransformer


def _model():
    torch.manual_seed(0)
    return TinyTransformer(3, 4, [5, 6], 2)


def test_units_as_names_types_tuples_and_predicates():
    m = _model()
    assert resolve_units(m, None) == []
    assert resolve_units(m, ["blocks.1", "blocks.0"]) == ["blocks.0", "blocks.1"]  # module order
    assert resolve_units(m, "head") == ["head"]
    assert resolve_units(m, TinyBlock) == ["blocks.0", "blocks.1"]
    assert resolve_units(m, (TinyBlock, nn.LayerNorm)) == [
        "blocks.0", "blocks.0.norm1", "blocks.0.norm2", "blocks.1", "blocks.1.norm1", "blocks.1.norm2", "norm"
    ]
    assert resolve_units(m, lambda fqn, mod: fqn.endswith("qkv")) == ["blocks.0.qkv", "blocks.1.qkv"]


def test_missing_unit_lists_close_names():
    with pytest.raises(ValueError, match=r"no submodule 'blocks\.2'.*did you mean 'blocks\.[01]'"):
        resolve_units(_model(), ["blocks.2"])
    with pytest.raises(TypeError, match="not a submodule name"):
        resolve_units(_model(), [3])
    with pytest.raises(TypeError, match="units must be"):
        resolve_units(_model(), 3)


def _plan_worker(units):
    params = fsdpfn.shard(_model(), fsdpfn.init_mesh(), units=units)
    return {u.name: list(u.fqns) for u in params.plan.units}, list(params.keys())


def test_inner_unit_owns_its_parameters():
    (owners, keys), = spmd(1, _plan_worker, ["blocks.0", "blocks.0.up", "head"])
    assert owners["blocks.0.up"] == ["blocks.0.up.weight", "blocks.0.up.bias"]
    assert "blocks.0.up.weight" not in owners["blocks.0"]
    assert "blocks.0.qkv.weight" in owners["blocks.0"]
    assert owners["head"] == ["head.weight", "head.bias"]
    assert "blocks.1.qkv.weight" in owners[""] and "inp.weight" in owners[""]
    assert list(owners) == ["", "blocks.0", "blocks.0.up", "head"]
    assert keys == [n for n, _ in _model().named_parameters()]


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d: FSDP2 rejects it
        self.w = nn.Parameter(torch.randn(3, 2))
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.lowp = nn.Parameter(torch.randn(5).bfloat16())
        self.register_buffer("steps", torch.tensor(3))
        self.register_buffer("running", torch.ones(2))


def _odd_worker():
    import torch.distributed as dist

    torch.manual_seed(0)
    m = _Odd()
    params = fsdpfn.shard(m, fsdpfn.init_mesh())
    x = {k: v.clone().requires_grad_(params.plan.requires_grad[k]) for k, v in params.params().items()}
    full = fsdpfn.unshard(fsdpfn.Sharded({**x, **params.buffers()}, params.plan))
    loss = full["scale"] * 2 + full["w"].sum() + full["lowp"].float().sum() + full["frozen"].sum()
    loss.backward()
    (unit,) = params.plan.units
    return dict(
        rank=dist.get_rank(),
        scale_shape=tuple(params["scale"].shape),
        scale_full=full["scale"].item(),
        scale_grad=None if x["scale"].grad is None else x["scale"].grad.tolist(),
        frozen_grad=x["frozen"].grad,
        half_grad=x["lowp"].grad.dtype,
        gather_dtypes=sorted(str(b.dtype) for b in unit.gather),
        reduce_members=sorted(f for b in unit.reduce for f in b.fqns),
        buffers=(params["steps"].item(), params["running"].tolist()),
        buffers_are_copies=params["running"].data_ptr() != m.running.data_ptr(),
    )


def test_zero_dim_frozen_mixed_dtypes_and_buffers():
    for out in spmd(2, _odd_worker):
        assert out["scale_shape"] == ((1,) if out["rank"] == 0 else (0,))
        assert out["scale_full"] == 1.5
        assert out["scale_grad"] == ([4.0] if out["rank"] == 0 else [])  # 2 per rank, summed (op="sum")
        assert out["frozen_grad"] is None
        assert out["half_grad"] == torch.bfloat16
        assert out["gather_dtypes"] == ["torch.bfloat16", "torch.float32"]  # one bucket per dtype
        assert out["reduce_members"] == ["lowp", "scale", "w"]  # frozen costs no reduction
        assert out["buffers"] == (3, [1.0, 1.0]) and out["buffers_are_copies"]


def _error_worker(case):
    mesh = fsdpfn.init_mesh()
    if case == "meta":
        with torch.device("meta"):
            m = nn.Module()
            m.w = nn.Parameter(torch.empty(2, 2))
        fsdpfn.shard(m, mesh)
    elif case == "mesh":
        fsdpfn.shard(nn.Linear(2, 2), "cpu")
    elif case == "module":
        fsdpfn.shard(torch.zeros(2), mesh)
    elif case == "offload":
        fsdpfn.shard(nn.Linear(2, 2), mesh, offload_policy=fsdpfn.CPUOffloadPolicy())
    elif case == "offload_torch":  # torch's class is taken as fsdpfn's, so refused the same way
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload

        fsdpfn.shard(_model(), mesh, offload_policy=TorchOffload())
    elif case == "mp":
        fsdpfn.shard(nn.Linear(2, 2), mesh, mp_policy="bf16")
    elif case == "units":
        fsdpfn.shard(_model(), mesh, units=["block.1"])
    elif case == "mesh_shape":
        fsdpfn.init_mesh((3,))
    elif case == "twice":
        fsdpfn.shard(_model(), mesh, units=["blocks.0", "blocks.1", "blocks.0"])
    elif case == "donated":
        m = _model()
        fsdpfn.shard(m, mesh)
        fsdpfn.shard(m, mesh)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("meta", ValueError, "module '<root>' .Module. was built on the meta device but has no reset_parameters"),
        ("mesh", TypeError, "expected a torch.distributed.device_mesh.DeviceMesh"),
        ("module", TypeError, "expected an nn.Module"),
        ("offload", NotImplementedError, "CPUOffloadPolicy"),
        ("offload_torch", NotImplementedError, "CPUOffloadPolicy is not supported by the functional layer"),
        ("mp", TypeError, "mp_policy must be"),
        ("units", ValueError, r"TinyTransformer has no submodule 'block\.1'; did you mean 'blocks\.1'"),
        ("mesh_shape", ValueError, r"shape \(3,\) covers 3 ranks but the world has 2"),
        ("twice", ValueError, r"units: 'blocks\.0' is named twice"),
        ("donated", ValueError, r"TinyTransformer's parameters were donated to an earlier shard\(\) call"),
    ],
)
def test_bad_input_names_the_culprit(case, exc, match):
    with pytest.raises(exc, match=match):
        spmd(2, _error_worker, case)


def _hsdp_worker():
    mesh = fsdpfn.init_mesh((2, 2))
    torch.manual_seed(0)
    params = fsdpfn.shard(nn.Linear(3, 5), mesh)
    return params.plan.world, params.plan.replicas, tuple(params["weight"].shape), tuple(mesh.mesh_dim_names)


def test_init_mesh_2d_is_hsdp():
    for world, replicas, shape, names in spmd(4, _hsdp_worker):
        assert (world, replicas, names) == (2, 2, ("replicate", "shard"))
        assert shape in {(3, 3), (2, 3)}


def _resident_worker(recipe, units, donate):
    """Bytes of parameter storage each rank holds after ``shard``: the module's and the tree's."""
    model = recipe.build(torch.float32)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, donate=donate)
    module_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta)
    shards = dict(params.params())
    tree_bytes = sum(v.untyped_storage().nbytes() for v in shards.values())
    local = sum(math.prod(params.specs[k].local_shape(params.plan.rank)) * v.element_size() for k, v in shards.items())
    full = sum(p.numel() * p.element_size() for p in recipe.build(torch.float32).parameters())
    return module_bytes, tree_bytes, local, full, all(p.is_meta for p in model.parameters()) if donate else None


@settings(max_examples=8, deadline=None)
@given(recipe=fst.model_recipes(), world=fst.world_sizes(1, 4), data=st.data())
def test_shard_leaves_only_this_ranks_shards_resident(recipe, world, data):
    units = data.draw(fst.unit_plans(recipe))
    for module_bytes, tree_bytes, local, full, all_meta in spmd(world, _resident_worker, recipe, units, True):
        assert module_bytes == 0 and all_meta  # the module's weights were donated
        assert tree_bytes == local  # the tree holds its own shards, no view into a full tensor
    kept = spmd(world, _resident_worker, recipe, units, False)
    assert all(module_bytes == full for module_bytes, *_ in kept)  # donate=False: the weights stay


def _shared_submodule(donate_first: bool) -> dict:
    """Two models sharing an encoder, sharded one at a time."""
    from fsdpfn.compat import fully_shard

    torch.manual_seed(0)
    encoder = nn.Linear(4, 4)
    want = encoder.weight.detach().clone()
    first = nn.Sequential(encoder, nn.Tanh(), nn.Linear(4, 2))
    fsdpfn.shard(first, fsdpfn.init_mesh(), donate=donate_first)
    out = {}
    for kind in ("shard", "fully_shard"):
        second = nn.Sequential(encoder, nn.ReLU(), nn.Linear(4, 3))
        try:
            if kind == "shard":
                got = fsdpfn.full_state_dict(fsdpfn.shard(second, fsdpfn.init_mesh(), donate=False), rank0_only=False)
            else:
                got = {k: v.full_tensor() for k, v in fully_shard(second).state_dict().items()}
            out[kind] = torch.equal(got["0.weight"], want)
        except ValueError as e:
            out[kind] = str(e)
    return out


def test_a_submodule_donated_by_an_earlier_shard_is_refused_not_initialised_anew():
    """Before, the second model's ``shard`` took the donated ``meta`` placeholders for a module built on
    ``meta`` and initialised the shared encoder anew, silently (``fully_shard`` kept them ``meta``)."""
    for out in spmd(2, _shared_submodule, True):
        for kind in ("shard", "fully_shard"):
            assert f"{kind}: parameter(s) '0.weight', '0.bias' of Sequential were donated" in out[kind], out
    for out in spmd(2, _shared_submodule, False):  # the first kept its weights: the second shards them
        assert out == {"shard": True, "fully_shard": True}, out
