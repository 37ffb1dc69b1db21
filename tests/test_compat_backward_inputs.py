"""``loss.backward(inputs=[...])`` through compat units: only the listed parameters get gradients, each
reduced as in a full backward, the others none (``None``, so the optimizer skips them), as one process
on the whole batch.

torch's ``fully_shard`` loses gradients here (2026-11-27, world 2, three blocks and a head: with the middle
block's parameters listed no parameter got a gradient; with all but the first block listed, only the
head's arrived), so there is nothing to compare with but the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.models import TanhStack

BLOCKS, STEPS, LR = 3, 2, 0.1
PARTS = [f"blocks.{i}" for i in range(BLOCKS)] + ["head"]



def _part(name: str) -> str:
    """``blocks.1`` for ``blocks.1.0.weight``, ``head`` for ``head.bias``."""
    return ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]


def _listed(model: nn.Module, parts: frozenset[str]) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if _part(n) in parts]


def _reference(parts: frozenset[str], world: int, seed: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = TanhStack(blocks=BLOCKS, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        for r in range(world):
            model(TanhStack.batch(r, seed)).backward(inputs=_listed(model, parts))
        without = sorted(n for n, p in model.named_parameters() if p.grad is None)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= world
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, without


def _compat(parts: frozenset[str], reshard: bool, seed: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    from fsdpfn.compat import fully_shard

    model = TanhStack(blocks=BLOCKS, seed=seed)
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = TanhStack.batch(dist.get_rank(), seed)
    for _ in range(STEPS):
        model(x).backward(inputs=_listed(model, parts))
        without = sorted(n for n, p in model.named_parameters() if p.grad is None)
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}, without


@settings(max_examples=6, deadline=None)
@given(
    world=fst.world_sizes(1, 3), reshard=st.booleans(), seed=st.integers(0, 2**16),
    parts=st.sets(st.sampled_from(PARTS), min_size=1).map(frozenset),
)  # fmt: skip
def test_backward_with_inputs_trains_only_the_listed_parameters_as_one_process(world, reshard, seed, parts):
    want, want_without = _reference(parts, world, seed)
    for rank, (got, without) in enumerate(spmd(world, _compat, parts, reshard, seed)):
        assert without == want_without, (rank, without, want_without)
        for k, w in want.items():
            torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"rank {rank} {k}: {m}")
