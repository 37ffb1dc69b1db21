"""Gradient accumulation (``set_requires_gradient_sync(False)``) where a unit that ran in an accumulating
microbatch does not run in the last one, the backward that syncs: a task head used on some microbatches
only, chosen alike on every rank or per rank.

Its accumulated gradients must still be reduced into ``.grad`` at the end of that backward, as torch's
``fully_shard`` does (its final callback runs every group's post-backward); before, fsdpfn refused the
optimizer step ("accumulated ... and are not reduced yet"). When ranks accumulated different heads (every
head runs and stays gathered, the loss reads one chosen per rank), every rank reduces every head some rank
accumulated. The
result must equal one process accumulating every microbatch of every rank.
"""

import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd


class _MultiTask(nn.Module):
    def __init__(self, heads: int, width: int, seed: int, all_heads: bool):
        super().__init__()
        torch.manual_seed(seed)
        self.all_heads = all_heads
        self.trunk = nn.Sequential(nn.Linear(4, width), nn.Tanh())
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2)) for _ in range(heads)
        )

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        if not self.all_heads:
            return self.heads[task](self.trunk(x)).pow(2).mean()
        # every head runs (every rank gathers every unit); the loss reads the task's head only
        h = self.trunk(x)
        return [head(h) for head in self.heads][task].pow(2).mean()


def _batch(rank: int, step: int, micro: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 1000 * step + 31 * micro + 7 * rank))


def _task(case: dict, micro: int, rank: int) -> int:
    """Microbatch ``micro``'s head on ``rank``. Per rank only where nothing is communicated: while
    accumulating, and with every head run in every forward (a unit run on some ranks only would gather on
    those only; a unit whose backward runs on some ranks only in a backward that reduces is refused by the
    pass check; torch's mismatched collectives fail on both)."""
    task = case["tasks"][micro]
    last = micro == len(case["tasks"]) - 1
    return (task + rank) % case["heads"] if case["per_rank"] and not last else task


def _reference(world: int, case: dict, steps: int) -> dict[str, torch.Tensor]:
    model = _MultiTask(case["heads"], case["width"], case["seed"], case["per_rank"])
    # SGD, not AdamW: AdamW's update does not see a gradient's scale (a wrong divide factor would pass) and
    # turns a rounding difference in a near-zero gradient into a parameter difference of up to its lr (a
    # random draw: 9.8e-05 after two steps, with every gradient within 3e-08 of one process's)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        for micro in range(len(case["tasks"])):
            for r in range(world):
                (model(_batch(r, step, micro, case["seed"]), _task(case, micro, r)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compat(case: dict, steps: int) -> dict[str, float]:
    from fsdpfn.compat import fully_shard

    rank = dist.get_rank()
    model = _MultiTask(case["heads"], case["width"], case["seed"], case["per_rank"])
    for head in model.heads:
        fully_shard(head, reshard_after_forward=case["reshard"])
    fully_shard(model.trunk, reshard_after_forward=case["reshard"])
    fully_shard(model, reshard_after_forward=case["reshard"])
    model.set_min_bucket_bytes(case["fuse"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    last = len(case["tasks"]) - 1
    for step in range(steps):
        for micro in range(last + 1):
            model.set_requires_gradient_sync(micro == last)
            model(_batch(rank, step, micro, case["seed"]), _task(case, micro, rank)).backward()
        opt.step()
        opt.zero_grad()
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    want = _reference(dist.get_world_size(), case, steps)
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    heads=st.integers(2, 3),
    data=st.data(),
    per_rank=st.booleans(),
    reshard=st.booleans(),
    fuse=st.sampled_from([None, "auto", 1 << 20]),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@example(world=2, heads=2, data=None, per_rank=False, reshard=True, fuse=None, width=5, seed=0)
@example(world=2, heads=2, data=None, per_rank=True, reshard=False, fuse=None, width=5, seed=1)
@example(world=3, heads=3, data=None, per_rank=False, reshard=False, fuse="auto", width=4, seed=2)
def test_heads_left_out_of_the_syncing_microbatch_are_reduced_as_one_process(
    world, heads, data, per_rank, reshard, fuse, width, seed
):
    if data is None:  # the examples: head 0 accumulates, head 1 alone in the last microbatch
        tasks = [0, 1]
    else:
        tasks = data.draw(st.lists(st.integers(0, heads - 1), min_size=2, max_size=4), label="tasks")
    if per_rank:
        # Heads trained on some ranks only communicate nothing only when their backward re-gathers nothing
        # (resharded units are gathered again where their backward runs: on some ranks only, a mismatch in
        # torch's fully_shard as here). Fused with a head the last microbatch trains, a head accumulated on
        # some ranks only meets the used-on-some-ranks refusal (its reduced gradient is not zero where this
        # rank has none): clear, and set_reduce_scatter_unused_params(True) lifts it. Unfused and kept
        # gathered, the heads are reduced at the end.
        reshard, fuse = False, None
    case = dict(heads=heads, tasks=tasks, per_rank=per_rank, reshard=reshard, fuse=fuse, width=width, seed=seed)
    off = spmd(world, _compat, case, 2)
    for rank, diffs in enumerate(off):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, f"world {world} {case}: rank {rank} {worst} off by {diffs[worst]:.3g} ({diffs})"
