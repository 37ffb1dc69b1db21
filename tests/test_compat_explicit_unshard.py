"""``FSDPModule.unshard()`` gathered before the shards changed (fsdpfn/compat/explicit_unshard.py).

A prefetch launched before the optimizer step (``model.layers[0].unshard(async_op=True); opt.step()``)
gathered the weights from before the update: the next forward silently ran on them (0.004-0.005 off one
process after three SGD steps at worlds 1-2). ``state_dict()`` after an ``unshard()`` returned the
registered full tensors (old values, plain tensors) where FSDP2 returns the sharded ``DTensor``s. Now
the forward gathers a stale unit again (with a warning), and the state-dict hooks drop the unshard first.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn.testing import spmd

def _model(seed: int, width: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def _batch(rank: int, step: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 100 * step + rank))


def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.5) if kind == "sgd" else torch.optim.AdamW(params, lr=0.02)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _compat(case: dict) -> tuple[dict[str, torch.Tensor], int, bool]:
    from fsdpfn.compat import fully_shard

    model = _model(case["seed"], case["width"])
    for i in (0, 2):
        fully_shard(model[i], reshard_after_forward=case["reshard"])
    fully_shard(model, reshard_after_forward=case["reshard"])
    opt = _optimizer(model.parameters(), case["opt"])
    prefetched = model[case["unit"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(case["steps"]):
            model(_batch(dist.get_rank(), step, case["seed"])).pow(2).mean().backward()
            handle = prefetched.unshard(async_op=True) if case["when"] == "before_step" else None
            opt.step()
            opt.zero_grad()
            if case["when"] == "after_step":
                handle = prefetched.unshard(async_op=True)
            handle.wait()
    stale = sum(1 for w in caught if "after unshard() gathered them" in str(w.message))
    state = model.state_dict()  # with the last unshard still registered: FSDP2 gives the DTensors
    return _full(model), stale, all(isinstance(v, DTensor) for v in state.values())


def _reference(world: int, case: dict) -> dict[str, torch.Tensor]:
    model = _model(case["seed"], case["width"])
    opt = _optimizer(model.parameters(), case["opt"])
    for step in range(case["steps"]):
        for r in range(world):
            (model(_batch(r, step, case["seed"])).pow(2).mean() / world).backward()
        opt.step()
        opt.zero_grad()
    return _full(model)


def _run(case: dict) -> tuple[dict[str, float], int, bool]:
    got, stale, dtensors = _compat(case)
    want = _reference(dist.get_world_size(), case)
    return {k: (got[k] - want[k]).abs().max().item() for k in want}, stale, dtensors


@settings(max_examples=6, deadline=None)
@given(
    world=st.integers(1, 3),
    when=st.sampled_from(["before_step", "after_step"]),
    unit=st.sampled_from([0, 2]),
    reshard=st.booleans(),
    opt=st.sampled_from(["sgd", "adamw"]),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_an_unshard_before_the_update_is_gathered_again_and_matches_one_process(
    world, when, unit, reshard, opt, width, seed
):
    """Prefetching a unit before the optimizer step: the forward meets the updated weights (gathered
    again, one warning per step after the first), as when it is prefetched after the step (no warning);
    ``state_dict()`` holds the sharded ``DTensor``s with the current values either way."""
    case = dict(when=when, unit=unit, reshard=reshard, opt=opt, width=width, seed=seed, steps=3)
    for rank, (off, stale, dtensors) in enumerate(spmd(world, _run, case)):
        worst = max(off, key=off.get)
        assert off[worst] < 1e-5, f"rank {rank} {case}: {worst} off by {off[worst]:.3g}"
        assert stale == (case["steps"] - 1 if when == "before_step" else 0), (rank, stale)
        assert dtensors


def _load_after_unshard() -> tuple[float, bool]:
    """``load_state_dict`` while an ``unshard()`` is registered loads into the sharded parameters, and
    the next forward computes with what was loaded."""
    from fsdpfn.compat import fully_shard

    model, other = _model(0, 5), _model(1, 5)
    for m in (model, other):
        fully_shard(m[0])
        fully_shard(m)
    want = other(torch.ones(2, 4)).detach().clone()
    model[0].unshard()
    model.load_state_dict(other.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(torch.ones(2, 4)).detach()
    return (got - want).abs().max().item(), any("unshard()" in str(w.message) for w in caught)


@pytest.mark.parametrize("world", [1, 2])
def test_load_state_dict_after_unshard_loads_into_the_shards(world):
    for off, warned in spmd(world, _load_after_unshard):
        assert off < 1e-6 and not warned


def _fused_unshards(unshard: bool) -> tuple[list[float], int, list[str]]:
    """Four blocks fused into one collective group (``set_min_bucket_bytes``), every block ``unshard()``ed
    before each forward as a pipeline schedule's UNSHARD action does; returns the losses, the all-gathers
    and the plan's groups."""
    from fsdpfn.compat import fully_shard
    from fsdpfn.compat.state import state_of

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])
    for block in model:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    model.set_min_bucket_bytes(1 << 20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        if unshard:
            handles = [block.unshard(async_op=True) for block in model]
            for h in handles:
                h.wait()
        loss = model(torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = state_of(model).root.comm.stats
    return losses, stats.all_gathers, [g.name for g in state_of(model).root.plan.groups]


def test_unshards_of_every_unit_of_a_fused_group_serve_its_forward():
    """The forward of a fused group whose units were all ``unshard()``ed takes their results (before, it
    gathered the group again, and the units' gathers were wasted: 5 all-gathers a step here, now 4)."""
    (plain, plain_gathers, groups), (got, gathers, _) = spmd(2, _fused_unshards, False)[0], spmd(2, _fused_unshards, True)[0]
    assert "0+1+2+3" in groups, groups
    torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-7)
    assert gathers == 4 * 3 and plain_gathers == 3, (gathers, plain_gathers)
