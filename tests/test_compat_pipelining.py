"""compat stages under torch.distributed.pipelining's schedules equal one process.

Each pipeline stage is a compat-sharded module over the data-parallel sub-mesh of a ("pp", "dp") mesh;
the schedule runs its microbatches' forwards and backwards in its own order (zero-bubble schedules split
each backward into an input-gradient and a weight-gradient pass). torch's ``fully_shard`` is 0.003-0.03
off one process under the zero-bubble schedules here (probe, torch 2.13); compat must be exact under all.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd

SCHEDULES = {  # name: stages per pp rank
    "ScheduleGPipe": 1,
    "Schedule1F1B": 1,
    "ScheduleInterleaved1F1B": 2,
    "ScheduleInterleavedZeroBubble": 2,
    "ScheduleZBVZeroBubble": 2,
}


def _stage_modules(widths, seed):
    """Stage i maps widths[i] to widths[i + 1] through a block (a unit of its own) and a Linear."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Sequential(nn.Linear(a, b), nn.Tanh()), nn.Linear(b, b))
        for a, b in zip(widths[:-1], widths[1:])
    ]


def _batch(rank, step, width):
    return torch.randn(8, width, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out, target):
    return (out - target).pow(2).mean()


def _stages_of(pp_rank, n_stages, schedule):
    per_rank = SCHEDULES[schedule]
    if per_rank == 1:
        return [pp_rank]
    if "ZBV" in schedule:  # V shape: rank 0 holds the first and the last stage
        return [pp_rank, n_stages - 1 - pp_rank]
    return [pp_rank, pp_rank + n_stages // 2]


def _pipeline(schedule, widths, microbatches, reshard, seed, steps=2):
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpfn.compat import fully_shard

    dp_size = dist.get_world_size() // 2
    mesh = init_device_mesh("cpu", (2, dp_size), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    n_stages = 2 * SCHEDULES[schedule]
    mine = _stages_of(pp.get_local_rank(), n_stages, schedule)
    modules = _stage_modules(widths, seed)
    stages = []
    for i in mine:
        fully_shard(modules[i][0], mesh=dp, reshard_after_forward=reshard)
        fully_shard(modules[i], mesh=dp, reshard_after_forward=reshard)
        stages.append(pipelining.PipelineStage(modules[i], i, n_stages, torch.device("cpu"), group=pp.get_group()))
    run = getattr(pipelining, schedule)
    sched = run(stages if len(stages) > 1 else stages[0], n_microbatches=microbatches, loss_fn=_loss)
    opt = torch.optim.SGD([p for i in mine for p in modules[i].parameters()], lr=0.1)
    target = torch.full((8, widths[-1]), 0.3)
    for step in range(steps):
        args = (_batch(dp.get_local_rank(), step, widths[0]),) if 0 in mine else ()
        kwargs = dict(target=target, losses=[]) if n_stages - 1 in mine else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
    return {f"{i}.{k}": v.full_tensor() for i in mine for k, v in modules[i].state_dict().items()}


def _one_process(widths, microbatches, world, seed, steps=2):
    """The stages chained, every dp rank's microbatches, the mean over all of them (as the schedules'
    default gradient scaling and dp averaging give)."""
    modules = _stage_modules(widths, seed)
    model = nn.Sequential(*modules)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_size = world // 2
    for step in range(steps):
        for r in range(dp_size):
            for mb in _batch(r, step, widths[0]).chunk(microbatches):
                loss = _loss(model(mb), torch.full((mb.shape[0], widths[-1]), 0.3))
                (loss / (dp_size * microbatches)).backward()
        opt.step()
        opt.zero_grad()
    return {f"{i}.{k}": v for i, m in enumerate(modules) for k, v in m.state_dict().items()}


@settings(max_examples=6, deadline=None)
@given(
    schedule=st.sampled_from(sorted(SCHEDULES)),
    width=st.lists(st.integers(1, 7), min_size=5, max_size=5),
    microbatches=st.sampled_from([2, 4]),
    reshard=st.booleans(),
    world=st.sampled_from([2, 4]),
    seed=st.integers(0, 3),
)
# a stage's weight-gradient pass after the next microbatch's forward took the copy kept from its input-gradient pass
# and parked it (zero bytes): "storage of size 0" (tests/test_parked.py's split backward is the same, smaller)
@example(schedule="ScheduleInterleavedZeroBubble", width=[1, 1, 1, 1, 1], microbatches=4, reshard=True, world=4, seed=0)
def test_compat_stages_under_pipelining_schedules_equal_one_process(
    schedule, width, microbatches, reshard, world, seed
):
    widths = width[: 2 * SCHEDULES[schedule] + 1]
    want = _one_process(widths, microbatches, world, seed)
    for rank, got in enumerate(spmd(world, _pipeline, schedule, widths, microbatches, reshard, seed)):
        assert got.keys() <= want.keys() and got
        for k, v in got.items():
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


def _two_steps(fully_shard, schedule, microbatches, reshard=None):
    """This rank's stage modules after two steps of ``schedule`` on stages sharded by ``fully_shard`` over
    the dp sub-mesh (``reshard``: the units' ``reshard_after_forward``; ``None``: the default)."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
    n_stages = 2 * SCHEDULES[schedule]
    mine = _stages_of(mesh["pp"].get_local_rank(), n_stages, schedule)
    widths = [3, 5, 4, 6, 2][: n_stages + 1]
    modules = _stage_modules(widths, 0)
    kw = {} if reshard is None else dict(reshard_after_forward=reshard)
    stages = []
    for i in mine:
        fully_shard(modules[i][0], mesh=mesh["dp"], **kw)
        fully_shard(modules[i], mesh=mesh["dp"], **kw)
        group = mesh["pp"].get_group()
        stages.append(pipelining.PipelineStage(modules[i], i, n_stages, torch.device("cpu"), group=group))
    run = getattr(pipelining, schedule)
    sched = run(stages if len(stages) > 1 else stages[0], n_microbatches=microbatches, loss_fn=_loss)
    for step in range(2):
        args = (_batch(mesh["dp"].get_local_rank(), step, widths[0]),) if 0 in mine else ()
        kwargs = dict(target=torch.full((8, widths[-1]), 0.3), losses=[]) if n_stages - 1 in mine else {}
        sched.step(*args, **kwargs)
        for m in (modules[i] for i in mine):
            assert all(p.grad is not None for p in m.parameters())
            m.zero_grad()
    return [modules[i] for i in mine]


def _reductions(schedule, microbatches, keep=True):
    """Reduce-scatters issued over two steps by this rank's stage roots, what torch sees of the stage, and
    the all-gathers (``keep=False``: the schedule's ``set_reshard_after_backward(False)`` ignored)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fsdpfn.compat import FSDPModule, fully_shard
    from fsdpfn.compat.state import state_of

    if not keep:
        real = FSDPModule.set_reshard_after_backward
        FSDPModule.set_reshard_after_backward = lambda self, value, **kw: real(self, True, **kw)
        try:
            return _reductions(schedule, microbatches)
        finally:
            FSDPModule.set_reshard_after_backward = real

    modules = _two_steps(fully_shard, schedule, microbatches)
    seen_as_fsdp = all(isinstance(m, TorchFSDPModule) for m in modules)
    stats = [state_of(m).root.comm.stats for m in modules]
    return sum(s.reduce_scatters for s in stats), seen_as_fsdp, sum(s.all_gathers for s in stats)


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "ScheduleZBVZeroBubble"])
def test_a_stage_reduces_once_per_step_and_gathers_once_per_backward_phase(schedule):
    """The schedule sees a compat stage as FSDP-sharded (fsdpfn's ``FSDPModule`` derives from torch's) and
    defers its reduction to the end of the step as with FSDP2: the same reduce-scatters with 4 microbatches
    as with 1 (before, each microbatch's backward reduced: 4x as many). Its units keep what a backward
    gathered for the next microbatches' backwards (``set_reshard_after_backward(False)``): fewer all-gathers
    than with the knob ignored."""
    one, four = spmd(4, _reductions, schedule, 1), spmd(4, _reductions, schedule, 4)  # dp of 2 per stage
    unkept = spmd(4, _reductions, schedule, 4, False)
    for (n1, fsdp1, _), (n4, fsdp4, g4), (_, _, g4_unkept) in zip(one, four, unkept):
        assert fsdp1 and fsdp4
        assert n1 == n4 > 0, (n1, n4)
        assert g4 < g4_unkept, (g4, g4_unkept)


def _gathers(impl, schedule, microbatches, reshard):
    """All-gathers over two steps of this rank's stages under ``impl``'s ``fully_shard`` (``reshard``: the
    units' ``reshard_after_forward``; ``None``: the default), counted per collective group."""
    if impl != "torch":
        from fsdpfn.compat import fully_shard
        from fsdpfn.compat.state import state_of

        return sum(state_of(m).root.comm.stats.all_gathers for m in _two_steps(fully_shard, schedule, microbatches, reshard))
    from torch.distributed.fsdp import fully_shard

    from fsdpfn.testing import fsdp2_all_gathers

    with fsdp2_all_gathers() as gathers:
        _two_steps(fully_shard, schedule, microbatches, reshard)
    return gathers.count


@pytest.mark.parametrize("reshard", [None, True, False])
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_a_stage_gathers_no_more_often_than_fsdp2(schedule, reshard):
    """FSDP2 keeps a unit's unsharded parameters from a backward to the next forward of a microbatch (1F1B
    interleaves them) and, for units that do not reshard after forward, from forward to forward until a
    backward that reshards (GPipe's forwards, then every microbatch's backward: one gather per step). compat
    keeps the same copies (``fsdpfn/compat/kept.py``): never more all-gathers than torch's ``fully_shard``,
    and without resharding after forward as many with 4 microbatches as with 2. Before, each forward
    gathered anew: 18 vs 4 a stage over two steps (1F1B or GPipe, 4 microbatches, no resharding; torch: 6)."""
    four = spmd(4, _gathers, "compat", schedule, 4, reshard)
    for rank, (got, want) in enumerate(zip(four, spmd(4, _gathers, "torch", schedule, 4, reshard))):
        assert 0 < got <= want, (rank, got, want)
    if reshard is False:
        assert spmd(4, _gathers, "compat", schedule, 2, reshard) == four
