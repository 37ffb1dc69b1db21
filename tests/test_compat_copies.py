"""Second copies of a compat model (an EMA, a teacher): ``copy.deepcopy`` of a sharded model is refused as
FSDP2 refuses it, with the way that works; that way (``AveragedModel(model)`` before ``fully_shard``, both
sharded alike) averages exactly as one process does on the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.models import TanhStack

STEPS, DECAY = 3, 0.9



def _shard(model: nn.Module, reshard: bool) -> None:
    from fsdpfn.compat import fully_shard

    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)


def _ema(world: int, seed: int, reshard: bool | None) -> dict[str, torch.Tensor]:
    """The EMA's parameters after ``STEPS`` SGD steps: one process on the whole batch (``reshard=None``)
    or this rank of compat models."""
    model = TanhStack(seed=seed)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))  # before fully_shard: it deep-copies
    if reshard is not None:
        _shard(model, reshard)
        _shard(ema.module, reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ranks = range(world) if reshard is None else [dist.get_rank()]
    for _ in range(STEPS):
        for r in ranks:
            (model(TanhStack.batch(r, seed)) / len(ranks)).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in ema.module.named_parameters()}


@settings(max_examples=4, deadline=None)
@given(world=fst.world_sizes(1, 3), seed=st.integers(0, 2**16), reshard=st.booleans())
def test_an_averaged_model_made_before_fully_shard_averages_as_one_process(world, seed, reshard):
    want = _ema(world, seed, None)
    for rank, got in enumerate(spmd(world, _ema, world, seed, reshard)):
        for n, w in want.items():
            torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"rank {rank} {n}: {m}")


def _refusal() -> str:
    model = TanhStack(seed=0)
    _shard(model, True)
    with pytest.raises(AssertionError) as deep:
        copy.deepcopy(model)
    with pytest.raises(AssertionError) as averaged:
        AveragedModel(model)
    assert str(averaged.value) == str(deep.value)
    return str(deep.value)


def test_a_deepcopy_is_refused_as_fsdp2_refuses_it_saying_what_works():
    (message,) = spmd(1, _refusal)
    assert message.startswith("FSDP does not support deepcopy. Please use state dict for serialization.")
    assert "make it before fully_shard and shard both the same way" in message and "state_dict()" in message
