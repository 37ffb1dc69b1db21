"""Fusing units on ``fsdp``'s first call, when ``shard`` was left at ``min_bucket_bytes="auto"``.

``shard`` sees neither the batch nor the optimizer, so its ``"auto"`` fuses only up to 1/8 of the shard
bytes. The first call of ``apply`` sees the batch, and ``fsdpfn.optim``'s ``init`` noted the optimizer on
the plan: the planner (``fsdpfn.memory.group_sizes_within``) then prices larger groups against the peak
torch's ``fully_shard`` needs for the same step with that optimizer (FSDP2's backward holds a copy of
each group's gradients, and on CUDA torch's foreach AdamW a temporary, that fsdpfn does not) and the plan
is regrouped in place to that choice, more fused or less than ``shard``'s (whose cap, without the batch,
may not fit). The groups may differ in size: the last units, whose backward runs before most gradients
exist, can afford larger ones. Every collective costs a CPU step more than its bytes (a synchronisation
of the ranks, thread wake-ups on cores that compute), so on CPU fusing is worth what memory allows (bench
ln_mlp, world 2: 12 groups -> 8, 0.60 -> 0.55 of torch's step, under its peak; bench/RESULTS.md run24).
On GPUs, whose collectives overlap compute on streams of their own, no group or forward span grows past
the mesh's latency-bound size (``LinkCost.target_bytes``): a larger one only delays the compute that
waits for it (for gpt1b in a world of 8 the uncapped planner would gather up to four 1B-model blocks
per group and twelve in a forward span; docs/memory.md).
Every rank must choose alike (``fsdpfn.core.agree``); where they do not, or the planner cannot
run the forward on fake tensors, the plan stays as ``shard`` made it. Once per plan.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Hashable
from typing import Any, ContextManager

import torch
from torch import nn

from fsdpfn.core import agree, link_of
from fsdpfn.layout import ShardPlan
from fsdpfn.layout.autobucket import FUSED_DEVICES
from fsdpfn.layout.plan import FORWARD_SPANS_MEMO, FUSION_PLANNED_MEMO, OPTIMIZER_MEMO
from fsdpfn.memory.fuse import first_call_fuses, group_sizes_within

__all__ = ["plan_fusion"]


def plan_fusion(
    module: nn.Module,
    plan: ShardPlan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    prefetch: int,
    reshard_after_forward: bool | Callable[[str], bool],
    fuse_key: Callable[[str], Hashable] | None = None,
    eligible: bool = True,
    planning: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """On the first call on ``plan`` (an ``"auto"`` plan that ``first_call_fuses``), regroup its units as
    ``group_sizes_within`` chooses for this batch (``args``/``kwargs``, what ``module``'s forward takes). A
    collective on every rank; ``eligible=False`` (a call under ``torch.func`` or ``torch.compile``, where no
    fake forward can run) keeps the plan as it is. The planner runs ``module``'s forward on fake tensors
    inside ``planning()`` (compat: with its FSDP dispatch turned off); units whose ``fuse_key`` differ
    never share a group (compat: units with different ``FSDPModule`` settings)."""
    if not plan.auto_fusion or plan.memo.get(FUSION_PLANNED_MEMO):
        return
    plan.memo[FUSION_PLANNED_MEMO] = True
    units = [u.name for u in plan.units if u.name]
    if not eligible or plan.tp or plan.transforms or plan.comm is None or not first_call_fuses(plan.world, plan.replicas, len(units)):
        return  # the same on every rank: no agreement needed
    # Where collectives overlap compute (GPUs: their own streams), a group or forward span past the link's
    # latency-bound size only delays the compute waiting for it; on CPU, gloo shares the cores with compute
    # and each collective's synchronisation is the cost, so memory alone bounds the groups there.
    overlaps = plan.comm.groups.device_type not in FUSED_DEVICES
    max_group_bytes = link_of(plan.comm).target_bytes() if overlaps else None  # a collective, on every rank
    batch = args if not kwargs else kwargs if not args else None
    sizes: tuple[int, ...] | None = None  # nothing planned: shard's groups stay (on every rank, if any rank could not plan)
    spans: tuple[int, ...] = ()
    if batch is not None:
        try:
            # Priced for a training step even when the first call is an evaluation (no_grad, inference
            # mode): the groups serve every later call, and a training step saves activations it does not.
            with planning(), torch.inference_mode(False), torch.enable_grad():
                choice = group_sizes_within(
                    module, plan.world, batch, units=units, optimizer=plan.memo.get(OPTIMIZER_MEMO, "none"),
                    mp_policy=plan.mp_policy, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                    fuse_key=fuse_key, max_group_bytes=max_group_bytes, device=plan.comm.groups.device,
                )  # fmt: skip
            sizes, spans = choice.sizes, choice.forward_spans
            if sum(sizes) != len(units):  # the planner saw other units than the plan has: keep shard's groups
                sizes, spans = None, ()
        except Exception:  # a forward fake tensors cannot run: every rank learns it below
            pass
    if agree(plan.comm, _code(sizes, spans)) and sizes is not None:
        plan.regroup(sizes=sizes)  # a no-op where shard's groups are already the choice
        if spans and sum(spans) == sum(1 for g in plan.groups if g.name):
            plan.memo[FORWARD_SPANS_MEMO] = spans  # (after regroup, which forgets the groups' derived memo)


def _code(sizes: tuple[int, ...] | None, spans: tuple[int, ...] = ()) -> int:
    """One int64 that is equal on two ranks when their choices are (-1: nothing planned)."""
    if sizes is None:
        return -1
    digest = hashlib.sha256((",".join(map(str, sizes)) + "|" + ",".join(map(str, spans))).encode()).digest()
    return int.from_bytes(digest[:7], "little")  # 56 bits: the ranks' sum stays within int64
