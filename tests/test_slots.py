"""Modules that keep their parameters in a cache of their own (torch's RNNs: ``_flat_weights``, beside their
parameter slots): ``shard`` and ``fully_shard`` leave no full copy in the cache, a unit's forward leaves no
gathered copy in it, both layers train such models as one process does, and a step's peak stays at or under
torch's ``fully_shard`` (it was 1.2x with the gathered buffers held by the caches).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.ops.slots import set_parameter
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.models import ModelRecipe
from fsdpfn.transform.parked import tensors_on

K = 3
LOCAL_BATCH = 2
# torch's own peak on one example moved by 56 bytes between runs (677256 / 677312: a small buffer gloo's
# thread lets go of at varying times), and compat's sat at the higher one; a cache holding a gathered
# buffer costs a whole unit's weights (1.2x on the explicit example)
PEAK_SLACK = 1 << 10
recurrent = fst.model_recipes(("recurrent",), min_width=2, min_seq=2)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@settings(max_examples=20, deadline=None)
@given(
    cls=st.sampled_from([nn.RNN, nn.LSTM, nn.GRU]),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    projection=st.booleans(),
    seed=st.integers(0, 100),
)
def test_set_parameter_keeps_an_rnns_cache_in_step(cls, layers, bidirectional, projection, seed):
    torch.manual_seed(seed)
    extra = dict(proj_size=2) if projection and cls is nn.LSTM else {}
    rnn = cls(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=True, **extra)
    x = torch.randn(2, 5, 3)
    new = {n: torch.randn_like(getattr(rnn, n)) for n in rnn._flat_weights_names}
    want = torch.func.functional_call(rnn, new, (x,))[0]
    for name, value in new.items():
        set_parameter(rnn, name, nn.Parameter(value))
    for i, name in enumerate(rnn._flat_weights_names):
        assert rnn._flat_weights[i] is getattr(rnn, name)
    torch.testing.assert_close(rnn(x)[0], want)
    linear = nn.Linear(2, 2)
    weight = nn.Parameter(torch.zeros(2, 2))
    set_parameter(linear, "weight", weight)  # a module without a cache: the slot only
    assert linear.weight is weight and "_flat_weights" not in vars(linear)


def _fully_shard(model, units):
    from fsdpfn.compat import fully_shard

    for unit in units:
        fully_shard(model.get_submodule(unit))
    fully_shard(model)


def _storages(tensors):
    """Bytes of the distinct storages behind ``tensors`` (``meta`` ones hold none)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if not t.is_meta and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return sum(out.values())


def _cache_is_current(model):
    """Whether every RNN's cache holds exactly its current parameters."""
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    return bool(rnns) and all(
        m._flat_weights[i] is getattr(m, n) for m in rnns for i, n in enumerate(m._flat_weights_names)
    )


def _resident_worker(recipe, units, layer):
    """Bytes this rank's module holds after sharding (its parameters, buffers and every tensor set on it:
    the RNNs' caches), and the bytes of its parameters alone."""
    model = recipe.build()
    if layer == "functional":
        fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    else:
        _fully_shard(model, units)
    return _storages([*model.parameters(), *tensors_on(model)]), _storages(model.parameters()), _cache_is_current(model)


@settings(max_examples=6, deadline=None)
@given(recipe=recurrent, world=fst.world_sizes(1, 4), layer=st.sampled_from(["functional", "compat"]), data=st.data())
def test_sharding_leaves_no_full_copy_in_an_rnns_cache(recipe, world, layer, data):
    units = data.draw(fst.unit_plans(recipe))
    for held, params, current in spmd(world, _resident_worker, recipe, units, layer):
        assert current  # the caches hold the donated meta parameters / the sharded DTensors
        assert held == params  # nothing beyond them: functional 0 (donated), compat the local shards
        assert layer == "compat" or held == 0


def _batch(recipe, world, step):
    x = recipe.inputs(LOCAL_BATCH * world, seed=100 + step)
    g = torch.Generator().manual_seed(200 + step)
    return x, torch.randn(LOCAL_BATCH * world, recipe.seq, recipe.output_width, generator=g)


def _train_worker(recipe, units, layer, reshard):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    model = recipe.build()
    between = []  # after each step: the caches hold the module's own parameters, no gathered copy
    if layer == "functional":
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
        apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
        opt = fsdpfn.optim.sgd(lr=0.5)
        state = opt.init(params)
        step_fn = fsdpfn.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))
        for step in range(K):
            x, y = _batch(recipe, world, step)
            _, grads = step_fn(params, x[sl], y[sl])
            params, state = opt.update(grads, state, params)
            between.append(_cache_is_current(model) and _storages(tensors_on(model)) == 0)
        return fsdpfn.full_state_dict(params, rank0_only=False), between
    from fsdpfn.compat import fully_shard

    for unit in units:
        fully_shard(model.get_submodule(unit), reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(K):
        x, y = _batch(recipe, world, step)
        F.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
        params = list(model.parameters())
        between.append(_cache_is_current(model) and _storages([*params, *tensors_on(model)]) == _storages(params))
    return {n: p.full_tensor() for n, p in model.named_parameters()}, between


def _reference(recipe, world):
    model = recipe.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(K):
        x, y = _batch(recipe, world, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@settings(max_examples=8, deadline=None)
@given(
    recipe=recurrent,
    world=fst.world_sizes(1, 3),
    layer=st.sampled_from(["functional", "compat"]),
    reshard=st.booleans(),
    data=st.data(),
)
@example(recipe=ModelRecipe("recurrent", (3, 2, 5, 4, 6), 1, 3), world=3, layer="compat", reshard=True, data=None)
@example(recipe=ModelRecipe("recurrent", (3, 2, 5, 4, 6), 1, 3), world=2, layer="functional", reshard=True, data=None)
def test_recurrent_stacks_train_as_one_process(recipe, world, layer, reshard, data):
    units = data.draw(fst.unit_plans(recipe)) if data is not None else recipe.unit_candidates()
    want = _reference(recipe, world)
    for got, between in spmd(world, _train_worker, recipe, units, layer, reshard):
        assert all(between), between
        for name, p in want.items():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _peak_worker(layer, widths, seq):
    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    recipe = ModelRecipe("recurrent", widths, seed=0, seq=seq)
    model, x = recipe.build(), recipe.inputs(4, seed=1)
    units = [u for u in recipe.unit_candidates() if u.startswith("layers.")]
    if layer == "functional":  # shard's default: groups planned from the fake forward's estimate
        return measured_step_peak(model, x, units=units, min_bucket_bytes="auto").peak
    if layer == "compat":
        from fsdpfn.compat import fully_shard

        return measured_fsdp2_step_peak(model, x, units=units, fully_shard=fully_shard)
    return measured_fsdp2_step_peak(model, x, units=units)


@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=2, deadline=None)
@given(hiddens=st.lists(st.integers(24, 64), min_size=3, max_size=4), seq=st.integers(4, 8))
@example(hiddens=[96, 96, 96, 96], seq=8)  # LSTM / GRU / LSTM / LSTM: 1.2x torch's peak with the caches held
def test_recurrent_stacks_peak_at_most_torchs(world, hiddens, seq):
    widths = (hiddens[0], 8, *hiddens)
    torch_peak = max(spmd(world, _peak_worker, "torch", widths, seq))
    for layer in ("functional", "compat"):
        peak = max(spmd(world, _peak_worker, layer, widths, seq))
        why = f"{layer}: {peak / torch_peak:.4f}x torch's peak ({peak} vs {torch_peak})"
        assert peak <= torch_peak + PEAK_SLACK, why
