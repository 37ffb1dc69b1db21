"""``fsdpfn.compat``'s root plans uneven collective groups at its first forward, as ``fsdp``'s first call
does (``fsdpfn.memory.group_sizes_within``), when every unit below it shares its settings: the same losses
as torch's ``fully_shard``, at most torch's peak, and FSDP2's one group per unit wherever a unit's knobs
differ or ``set_min_bucket_bytes`` fixed the groups."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd


def _blocks(width, hidden, count):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                           for _ in range(count)])


def _batch(width, batch):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch * world, width, generator=g)[rank * batch : (rank + 1) * batch] for _ in range(3)]


def _train(impl, width, hidden, count, batch, knob):
    import importlib

    fully_shard = importlib.import_module(impl).fully_shard
    model = _blocks(width, hidden, count)
    for i, block in enumerate(model):
        fully_shard(block, reshard_after_forward=not (knob and i == count - 1))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in _batch(width, batch):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    groups = None
    if impl == "fsdpfn.compat":
        from fsdpfn.compat.state import state_of

        groups = [g.name for g in state_of(model).root.plan.groups if g.name]
    return losses, groups


def _planned(width, hidden, count, batch, world):
    with torch.device("meta"):
        model = _blocks(width, hidden, count)
    x = torch.zeros(batch, width)
    sizes = fsdpfn.memory.group_sizes_within(model, world, x, units=[str(i) for i in range(count)], optimizer="none").sizes
    names, start = [], 0
    for k in sizes:
        names.append("+".join(str(i) for i in range(start, start + k)))
        start += k
    return names


@settings(max_examples=min(settings().max_examples, 4), deadline=None)
@given(width=st.sampled_from([64, 128, 256]), hidden=st.sampled_from([256, 1024]), count=st.integers(4, 8),
       batch=st.sampled_from([2, 8]), world=st.integers(2, 3))
def test_the_first_forward_plans_the_groups_and_trains_as_torch_does(width, hidden, count, batch, world):
    ours = spmd(world, _train, "fsdpfn.compat", width, hidden, count, batch, False)
    theirs = spmd(world, _train, "torch.distributed.fsdp", width, hidden, count, batch, False)
    want = _planned(width, hidden, count, batch, world)
    for (losses, groups), (ref, _) in zip(ours, theirs):
        assert groups == want  # the planner's choice, on every rank
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def test_a_unit_with_its_own_knobs_keeps_one_group_per_unit():
    # the last block kept gathered after forward: its key differs, so nothing is planned (FSDP2's groups)
    for _, groups in spmd(2, _train, "fsdpfn.compat", 256, 1024, 6, 8, True):
        assert groups == [str(i) for i in range(6)]


def _peaks(width, hidden, count, batch):
    import fsdpfn.compat
    from fsdpfn.testing.memory import measured_fsdp2_step_peak

    x = _batch(width, batch)[0]
    units = [str(i) for i in range(count)]
    ours = measured_fsdp2_step_peak(_blocks(width, hidden, count), x, units=units, fully_shard=fsdpfn.compat.fully_shard)
    theirs = measured_fsdp2_step_peak(_blocks(width, hidden, count), x, units=units)
    return ours, theirs


@settings(max_examples=min(settings().max_examples, 4), deadline=None)
@given(width=st.sampled_from([64, 128, 256, 384]), hidden=st.sampled_from([256, 1024]), count=st.integers(4, 8),
       batch=st.sampled_from([2, 8, 32]), world=st.integers(2, 3))
def test_the_planned_groups_never_raise_the_peak_above_torchs(width, hidden, count, batch, world):
    for ours, theirs in spmd(world, _peaks, width, hidden, count, batch):
        assert ours <= theirs, (ours, theirs)
