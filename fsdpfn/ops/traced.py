"""Bucket collectives for compiled graphs: the traced twin of ``functions.py``.

``TracedCollective`` runs the same ``Buckets`` as ``UnshardFunction``/``ReduceFunction`` (the same layouts,
dtypes, scale and adjoint), but packs, moves and unpacks with traceable tensor operations and the core's
functional collectives, so ``torch.compile(fullgraph=True)`` captures every gather in the forward graph
and every reduce-scatter in the backward graph. ``traced_gather`` can mark a gather for recomputation:
the compiler then keeps only the shards for backward and gathers again there (reshard after forward).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdpfn.core.traced import Collectives, traced_all_gather, traced_reduce_scatter
from fsdpfn.ops.buckets import Buckets

__all__ = ["TracedCollective", "run_traced", "traced_gather", "warm"]


def run_traced(b: Buckets, tensors: Sequence[torch.Tensor | None], via: Collectives = "native") -> list[torch.Tensor]:
    """``b.run(tensors)`` written with traceable operations (no handles, no side streams, no stats), the
    collectives written as ``via`` says (see ``core.traced.Collectives``)."""
    if b.extension is not None:
        raise NotImplementedError(
            f"the traced executor (compile_step, a compiled root) cannot gather {list(b.extension.fqns)} through their "
            "all-gather transforms (fsdp_pre_all_gather or shard(all_gather_transforms=)); run these parameters eagerly"
        )
    if b.in_place:
        return b.run_in_place(tensors)
    groups = b.comm.groups
    by_name = dict(zip(b.fqns, tensors))
    results: dict[str, torch.Tensor] = {}
    for layout in b.layouts:
        members = [by_name[f] for f in layout.fqns]
        if b.kind == "gather":
            outs = layout.split_full(traced_all_gather(layout.concat_shards(members, b.rank), groups, via=via))
            if b.scale != 1.0:
                outs = [o * b.scale for o in outs]
        else:
            mine = traced_reduce_scatter(layout.concat_full(members, device=groups.device), groups, via=via)
            if b.scale != 1.0:
                mine = mine * b.scale
            outs = layout.unpack_shards(mine, b.rank)
        results.update(zip(layout.fqns, outs))
    return [r if r.dtype == d else r.to(d) for r, d in ((results[f], d) for f, d in zip(b.fqns, b.out_dtypes))]


class TracedCollective(torch.autograd.Function):
    """``TracedCollective.apply(b, via, *tensors)``: the bucket collective ``b``, whose backward is its
    adjoint (a gather's is the reduce-scatter of the gradients of its trainable members)."""

    @staticmethod
    def forward(ctx: Any, b: Buckets, via: Collectives, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.b, ctx.via = b, via
        return tuple(run_traced(b, tensors, via))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        b: Buckets = ctx.b
        adj = b.adjoint
        assert adj is not None, "collective without an adjoint"
        by_name = dict(zip(b.fqns, grads))
        reduced = dict(zip(adj.fqns, run_traced(adj, [by_name.get(f) for f in adj.fqns], ctx.via)))
        return (None, None, *(reduced.get(f) for f in b.fqns))


class _OwnRegions(logging.Filter):
    """Drops torch's once-per-process warning that a checkpoint with a ``context_fn`` must hold no in-place
    ops on its inputs: the regions here are fsdpfn's own gathers, which write only buffers they create."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_OwnRegions())


def _recompute_all(_ctx: Any, _op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


_RECOMPUTE = functools.partial(create_selective_checkpoint_contexts, _recompute_all)


def traced_gather(b: Buckets, shards: Sequence[torch.Tensor], *, recompute: bool, via: Collectives = "native") -> tuple[torch.Tensor, ...]:
    """The full tensors of gather ``b`` from ``shards``; with ``recompute`` the backward gathers them
    again instead of keeping them (every op of the gather is marked for recomputation)."""
    if not torch.is_grad_enabled() or not any(s.requires_grad for s in shards):
        # a unit run under no_grad inside the step (a teacher), or a frozen one: no backward to build, and
        # dynamo traces an autograd.Function that records nothing with a ctx it cannot set attributes on
        return tuple(run_traced(b, shards, via))
    if not recompute:
        return TracedCollective.apply(b, via, *shards)
    return checkpoint(TracedCollective.apply, b, via, *shards, use_reentrant=False, context_fn=_RECOMPUTE)


def warm(b: Buckets) -> None:
    """Fill ``b``'s per-rank caches (and its adjoint's) eagerly: code traced by dynamo must only read them."""
    for c in (b, b.adjoint):
        if c is not None:
            c._geometry()
            for layout in c.layouts:
                layout._members(c.rank)
                for spec in layout.specs:  # cached properties, computed on first read
                    (spec.numel, spec.rows, spec.chunk, spec.row_numel, spec.other_dims, spec.padded_numel)
