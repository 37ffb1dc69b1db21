"""Buffers a forward replaces (``self.count = self.count + 1``, an EMA computed out of place) persist in the
``Sharded`` tree, as in the module's own buffers (``fsdpfn.transform.unit_hooks``).

``apply`` swaps the tree's buffer leaves into the module for a call and restores the module after it; a
buffer updated in place (BatchNorm's statistics) was kept, one the forward *replaced* was lost when the call
restored the module: a step counter stayed 0 and an EMA at its initial value, silently (torch's
``fully_shard`` and the compat layer keep them: they leave buffers to the module). Every rank keeps its own
buffers, as with plain modules, so the reference runs each rank's buffers on that rank's batches.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd

STEPS = 3
LR = 0.1


class Tracked(nn.Module):
    """A Linear that counts its training calls and keeps an EMA of its outputs' mean, both used by its
    output, updated in place or replaced."""

    def __init__(self, width: int, inplace: bool):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.inplace = inplace
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.training:
            mean = y.detach().mean(0)
            if self.inplace:
                self.count.add_(1)
                self.ema.mul_(0.9).add_(0.1 * mean)
            else:
                self.count = self.count + 1
                self.ema = 0.9 * self.ema + 0.1 * mean
        return torch.tanh(y * (1 + self.ema) + 0.01 * self.count)


def _model(width: int, modes: tuple[bool, ...], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(Tracked(width, m) for m in modes), nn.Linear(width, 2))


def _batch(width: int, step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, width, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(width, modes, seed, world):
    """One process: the parameters see every rank's batch; each rank's buffers only its own."""
    model = _model(width, modes, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    buffers = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(world)]
    for step in range(STEPS):
        for r in range(world):
            for k, v in buffers[r].items():
                model.get_submodule(k.rpartition(".")[0]).register_buffer(k.rpartition(".")[2], v.clone())
            (model(_batch(width, step, r)).pow(2).mean() / world).backward()
            buffers[r] = {k: v.clone() for k, v in model.named_buffers()}
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation between steps changes nothing
            model.eval()
            model(_batch(width, step, 99))
            model.train()
    return {k: v for k, v in model.named_parameters()}, buffers


def _sharded(width, modes, seed, units, reshard):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model(width, modes, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    opt = fsdpfn.optim.sgd(lr=LR)
    state = opt.init(params)
    for step in range(STEPS):
        _, grads = fsdpfn.value_and_grad(lambda p: apply(p, _batch(width, step, rank)).pow(2).mean())(params)
        params, state = opt.update(grads, state, params)
        with torch.no_grad():
            model.eval()
            apply(params, _batch(width, step, 99))
            model.train()
    full = fsdpfn.full_state_dict(params, rank0_only=False)
    return full, {k: params[k].clone() for k in params.plan.buffers}


@settings(max_examples=6, deadline=None)
@given(
    width=st.integers(1, 6),
    modes=st.lists(st.booleans(), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 5),
    world=st.integers(1, 3),
    units=st.sets(st.integers(0, 3)),
    reshard=st.booleans(),
)
def test_buffers_replaced_in_forward_persist_as_in_the_module(width, modes, seed, world, units, reshard):
    names = [str(i) for i in sorted(units) if i < len(modes) + 1]
    want_params, want_buffers = _reference(width, modes, seed, world)
    for rank, (full, buffers) in enumerate(spmd(world, _sharded, width, modes, seed, names, reshard)):
        for k, v in want_params.items():
            torch.testing.assert_close(full[k], v.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")
        assert buffers.keys() == want_buffers[rank].keys()
        for k, v in want_buffers[rank].items():
            torch.testing.assert_close(buffers[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


class _Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x):
        self.seen = torch.cat([self.seen, x.detach().mean().reshape(1)])  # a history: its shape changes
        return self.lin(x)


def test_a_buffer_replaced_by_another_shape_is_refused_by_name():
    model = _Grows()
    params = fsdpfn.shard(model, fsdpfn.init_mesh())
    apply = fsdpfn.fsdp(model)
    with pytest.raises(RuntimeError, match=r"replaced buffer 'seen' \(shape \(1,\) on cpu\) by a tensor of shape \(2,\)"):
        apply(params, torch.ones(1, 2))
    model.forward = lambda x: model.lin(x)  # the call was closed: the module serves the next one
    assert apply(params, torch.ones(1, 2)).shape == (1, 2)


def test_compile_step_keeps_replaced_buffers_as_the_eager_step():
    steps = {}
    for how in ("eager", "compile_step"):
        model = _model(3, (False, True, False), 1)
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"])
        apply = fsdpfn.fsdp(model)
        loss = lambda p, x: apply(p, x).pow(2).mean()  # noqa: E731
        opt = fsdpfn.optim.sgd(lr=LR)
        state = opt.init(params)
        step = fsdpfn.compile_step(loss, opt, backend="eager") if how == "compile_step" else None
        for i in range(STEPS):
            if step is not None:
                _, params, state = step(params, state, _batch(3, i, 0))
            else:
                _, grads = fsdpfn.value_and_grad(loss)(params, _batch(3, i, 0))
                params, state = opt.update(grads, state, params)
        steps[how] = {k: params[k].clone() for k in params.plan.buffers}
    assert int(steps["eager"]["0.count"]) == STEPS
    for k, v in steps["eager"].items():
        torch.testing.assert_close(steps["compile_step"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _vmapped_training_forward():
    model = _model(3, (False,), 0)
    params = fsdpfn.shard(model, fsdpfn.init_mesh())
    apply = fsdpfn.fsdp(model)
    torch.func.vmap(lambda x: apply(params, x))(torch.randn(2, 4, 3))


def test_a_per_example_buffer_under_vmap_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"replaced buffer '0.ema' .* by a per-example value \(under torch.func.vmap\)"):
        _vmapped_training_forward()


class _Positions(nn.Module):
    """A cache of position features as a non-persistent buffer, rebuilt (longer) when a longer input comes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("table", torch.arange(2.0), persistent=False)

    def forward(self, x):
        if self.table.shape[0] < x.shape[1]:
            self.register_buffer("table", torch.arange(float(x.shape[1])), persistent=False)
        return self.lin(x) + self.table[: x.shape[1], None]


def test_a_non_persistent_cache_rebuilt_for_longer_inputs_is_left_to_the_next_call():
    torch.manual_seed(0)
    model = _Positions()
    plain = _Positions()
    plain.load_state_dict(model.state_dict())
    params = fsdpfn.shard(model, fsdpfn.init_mesh())
    apply = fsdpfn.fsdp(model)
    for length in (2, 5, 3, 6):
        x = torch.randn(1, length, 3)
        torch.testing.assert_close(apply(params, x), plain(x))
    assert params["table"].shape == (2,)  # the tree's leaf keeps its shape: the call rebuilt its own
