"""Gathered buffers held elsewhere at their release: parked, refilled by the re-gather (transform/parked.py).

A selective activation checkpoint whose policy saves every op caches the views it made of the gathered
weights until its recompute in backward: compat's peak over a training step was 1.14x torch's
``fully_shard`` (6 blocks of 128 -> 512 -> 128, 16 rows, world 2), as every unit's gathered buffer stayed
alive from its forward to its backward. Such a buffer is now resized to zero bytes at the release and the
backward's re-gather copies the values back into it, as FSDP2 does with its unsharded parameters.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd
from fsdpfn.testing.models import NormMLPBlock
from fsdpfn.transform.parked import park, refill, repark

# --- the pure functions -------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    held=st.lists(st.booleans(), min_size=5, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_park_frees_exactly_the_storages_held_elsewhere_and_refill_restores_them_in_place(sizes, held, dtype):
    # parameters in flat buffers of two each, as a group gathers into (views at offsets); some viewed elsewhere
    groups = [range(i, min(i + 2, len(sizes))) for i in range(0, len(sizes), 2)]
    full, holders, buffers = {}, {}, []
    for members in groups:
        flat = torch.arange(sum(sizes[j] for j in members), dtype=dtype) + 100 * members[0]
        buffers.append(flat.untyped_storage())
        offset = 0
        for j in members:
            full[f"p{j}"] = flat[offset : offset + sizes[j]]
            offset += sizes[j]
        del flat
    for j in range(len(sizes)):
        if held[j]:
            holders[f"p{j}"] = full[f"p{j}"].view(-1, 1).t()  # a view made of it (as ``w.t()`` in a cached op)
    sizes_before = [s.nbytes() for s in buffers]
    parked = park(full)
    del full
    for members, s, before in zip(groups, buffers, sizes_before):
        assert s.nbytes() == (0 if any(held[j] for j in members) else before)
    assert len(parked) == sum(any(held[j] for j in members) for members in groups)
    fresh = {f"p{j}": torch.full((n,), float(j + 1), dtype=dtype) for j, n in enumerate(sizes)}
    got = refill(parked, fresh)
    for name, t in got.items():
        assert torch.equal(t, fresh[name])
    for name, h in holders.items():  # the holders read the new values, through the same storage
        assert torch.equal(h.t().reshape(-1), fresh[name])
        assert h.untyped_storage().data_ptr() == got[name].untyped_storage().data_ptr()
    repark(parked)
    assert all(p.storage.nbytes() == 0 for p in parked)
    again = refill(parked, fresh)  # a second backward of the same graph
    for name, h in holders.items():
        assert torch.equal(h.t().reshape(-1), fresh[name]) and torch.equal(again[name], fresh[name])


def test_park_leaves_a_buffer_only_the_group_holds_to_the_references():
    flat = torch.arange(10.0)
    full = {"a": flat[:4].view(2, 2), "b": flat[4:]}
    storage = flat.untyped_storage()
    del flat
    assert park(full) == []
    assert storage.nbytes() == 40  # untouched: dropping ``full`` frees it


# --- training steps with a selective activation checkpoint that saves every op ----------------------


def _save_every_op(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE


def _model(width: int, hidden: int, count: int, frozen: bool) -> nn.Sequential:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    model = nn.Sequential(*[NormMLPBlock(width, hidden) for _ in range(count)])
    if frozen:  # a frozen weight read by a backward node that gives the reduction nothing
        model[0].down.weight.requires_grad_(False)
    context = functools.partial(create_selective_checkpoint_contexts, _save_every_op)
    for i in range(count):
        model[i] = checkpoint_wrapper(model[i], context_fn=context)
    return model


def _peak(layer: str, width: int, hidden: int, count: int, rows: int, frozen: bool) -> int:
    import torch.distributed as dist

    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    model = _model(width, hidden, count, frozen)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    units = [str(i) for i in range(count)]
    if layer == "functional":
        return measured_step_peak(model, x, units=units, min_bucket_bytes=None).peak
    if layer == "compat":
        import fsdpfn.compat as compat

        return measured_fsdp2_step_peak(model, x, units=units, fully_shard=compat.fully_shard)
    return measured_fsdp2_step_peak(model, x, units=units)


def _trained(layer: str, width: int, hidden: int, count: int, rows: int, frozen: bool) -> list[torch.Tensor]:
    """Three SGD steps on this rank's rows (the whole batch at world 1, one process, no sharding); every
    parameter after them, whole."""
    import torch.distributed as dist

    model = _model(width, hidden, count, frozen)
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(rows * world, width, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    if layer != "single":
        import fsdpfn
        import fsdpfn.compat as compat

        mesh = fsdpfn.init_mesh()
        for block in model:
            compat.fully_shard(block, mesh=mesh)
        compat.fully_shard(model, mesh=mesh)
        xs = [x[rank * rows : (rank + 1) * rows] for x in xs]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


@settings(max_examples=min(settings().max_examples, 2), deadline=None)
@given(width=st.sampled_from([32, 96]), hidden=st.sampled_from([64, 200]), count=st.integers(2, 5), rows=st.integers(2, 9),
       world=st.integers(2, 3), frozen=st.booleans())
@example(width=128, hidden=512, count=6, rows=16, world=2, frozen=False)  # compat 1.14x torch's peak before
@example(width=32, hidden=64, count=3, rows=4, world=3, frozen=True)  # a frozen weight: its group is not parked again after its backward
@example(width=32, hidden=64, count=2, rows=4, world=1, frozen=False)  # world 1: nothing resharded, nothing parked (the gathered values are the shards)
def test_a_checkpoint_that_saves_every_op_holds_no_gathered_buffer_from_forward_to_backward(width, hidden, count, rows, world, frozen):
    torch_peaks = spmd(world, _peak, "torch", width, hidden, count, rows, frozen)
    for layer in ("compat", "functional"):
        peaks = spmd(world, _peak, layer, width, hidden, count, rows, frozen)
        assert all(p <= t for p, t in zip(peaks, torch_peaks)), (layer, peaks, torch_peaks)
    got = spmd(world, _trained, "compat", width, hidden, count, rows, frozen)[0]
    want = spmd(1, _trained, "single", width, hidden, count, rows * world, frozen)[0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _escaping(layer: str, how: str) -> list[torch.Tensor]:
    """A unit that hands a view of its own weight to the next unit, as an output (``how="output"``) or as
    an attribute it sets (``"attribute"``): never parked, and the training is that of one process."""
    import torch.distributed as dist

    class Emits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if how == "attribute":
                self.wt = self.lin.weight.t()
                return self.lin(x)
            return self.lin(x), self.lin.weight.t()

    class Uses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = Emits()
            self.second = nn.Linear(8, 8)

        def forward(self, x):
            if how == "attribute":
                return self.second(self.first(x)) @ self.first.wt
            y, wt = self.first(x)
            return self.second(y) @ wt

    torch.manual_seed(0)
    model = Uses()
    rank = dist.get_rank()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))  # the batch: 4 rows on each of 2 ranks
    if layer == "compat":
        import fsdpfn
        import fsdpfn.compat as compat

        mesh = fsdpfn.init_mesh()
        compat.fully_shard(model.first, mesh=mesh)
        compat.fully_shard(model.second, mesh=mesh)
        compat.fully_shard(model, mesh=mesh)
        x = x[rank * 4 : (rank + 1) * 4]
    if layer == "functional":
        import fsdpfn
        import fsdpfn.optim as optim

        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["first", "second"])
        apply = fsdpfn.fsdp(model)
        step = fsdpfn.value_and_grad(lambda p, x: apply(p, x).square().mean())
        opt = optim.sgd(lr=0.1)
        state = opt.init(params)
        for _ in range(2):
            _, grads = step(params, x[rank * 4 : (rank + 1) * 4])
            params, state = opt.update(grads, state, params)
        return list(fsdpfn.full_state_dict(params, rank0_only=False).values())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["output", "attribute"])
def test_a_unit_that_hands_on_a_view_of_its_weight_is_never_parked(how):
    want = spmd(1, _escaping, "single", how)[0]
    for layer in ("compat", "functional"):
        got = spmd(2, _escaping, layer, how)[0]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _split_backward(layer: str, rows: int, microbatches: int, keep: bool) -> list[torch.Tensor]:
    """Microbatches whose backward runs in two passes, as a zero-bubble pipeline schedule runs them: each
    forward, then the previous microbatch's weight gradients, then this one's input gradients; with
    ``keep``, compat keeps each re-gathered copy after backward (``set_reshard_after_backward(False)``, as
    the schedules set), so the next forward takes it over. Every parameter's gradient after them, whole."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6)) for _ in range(3)])
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(rows * world, 6, generator=torch.Generator().manual_seed(s)) for s in range(microbatches)]
    if layer != "single":
        import fsdpfn
        import fsdpfn.compat as compat

        mesh = fsdpfn.init_mesh()
        for block in model:
            compat.fully_shard(block, mesh=mesh)
        compat.fully_shard(model, mesh=mesh)
        model.set_reshard_after_backward(not keep, recurse=True)
        xs = [x[rank * rows : (rank + 1) * rows] for x in xs]
    before = None
    for x in xs:
        x.requires_grad_()
        loss = model(x).square().mean() / microbatches
        if before is not None:
            before.backward()  # the previous microbatch's weight gradients (its input gradients again, too)
        torch.autograd.grad(loss, x, retain_graph=True)  # this one's input gradients only
        before = loss
    before.backward()
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]


@settings(max_examples=min(settings().max_examples, 4), deadline=None)
@given(world=st.integers(1, 3), rows=st.integers(1, 4), microbatches=st.integers(2, 4), keep=st.booleans())
# the second forward took the copy kept from the first's input-gradient pass and parked it at its release
# (held by the first call): the first's weight-gradient pass then read a storage of zero bytes
@example(world=2, rows=4, microbatches=3, keep=True)
def test_a_copy_kept_gathered_after_backward_is_not_parked_by_the_forward_it_is_handed_to(world, rows, microbatches, keep):
    got = spmd(world, _split_backward, "compat", rows, microbatches, keep)[0]
    want = spmd(1, _split_backward, "single", rows * world, microbatches, keep)[0]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
