"""Differentiable bucket collectives: ``UnshardFunction`` (all-gather) and ``ReduceFunction``
(reduce-scatter), each the other's adjoint.

Both are ``torch.autograd.Function``s in the ``setup_context`` style with ``jvp`` and ``vmap`` rules, so
``torch.func`` can transform through them: the collectives run inside ``forward`` on plain tensors, never
on ``torch.func``'s wrapped ones. One call moves a whole set of buckets: every collective is launched
before the first is waited for, so the buckets overlap each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdpfn.core import Handle
from fsdpfn.ops.buckets import Buckets
from fsdpfn.ops.deferred import DeferredReductions
from fsdpfn.ops.fold import fold_gradient
from fsdpfn.ops.grad_checks import UsedElsewhere, check_dense, second_order_error

__all__ = ["CallInfo", "ReduceFunction", "UnshardFunction", "add_by_name", "apply_buckets"]

@dataclass
class CallInfo:
    """Per-call extras of a bucket collective (not part of the cached ``Buckets``).

    ``pending``: handles of this very collective launched earlier (prefetch). ``ready``: its results,
    gathered earlier (compat: a kept copy); the forward returns aliases of them. ``sink``: when set, the
    backward does not reduce: it adds the incoming full gradients into ``sink[fqn]`` (in ``sink_dtypes``)
    and passes no gradient to the shards (deferred reduction): the first into a copy of its own (autograd's
    gradient may be shared or expanded), the next in place. ``carry``: full gradients accumulated earlier
    into a sink; the backward adds the incoming gradients into them (in place) and removes them, then
    reduces them. ``keep_none``: a member
    that received no gradient on this rank gets ``None`` instead of its (still reduced) shard gradient.
    ``deferred``: while it is ``active``, the backward's reduce-scatter is not waited for: its handles
    and results go to that ``DeferredReductions`` instead of autograd, and its owner adds them to the
    gradients once the handles are done. ``in_graph_backward``: this reduction was made by a backward that
    builds a graph (``create_graph=True``), so differentiating its result is a second-order derivative.
    """

    pending: Sequence[Handle] | None = None
    sink: dict[str, torch.Tensor] | None = None
    sink_dtypes: Mapping[str, torch.dtype] | None = None
    carry: dict[str, torch.Tensor] | None = None
    keep_none: bool = False
    deferred: DeferredReductions | None = None
    in_graph_backward: bool = False  # a reduction a backward with create_graph=True made (see second_order_error)
    # gradients to add (by FQN), taken when the backward runs: a reentrant checkpoint inside the unit left
    # them on its recompute's values, outside autograd's reach (see fsdpfn.transform.recompute)
    extra: Callable[[], dict[str, torch.Tensor]] | None = None
    # the owner's sink/carry/keep_none/deferred, asked when the backward runs (compat reads gradient sync
    # then, as FSDP2 does: a pipeline schedule turns it off between a microbatch's forward and backward)
    resolve: Callable[[], CallInfo] | None = None
    ready: Sequence[torch.Tensor] | None = None


def add_by_name(
    fqns: Sequence[str], grads: Sequence[torch.Tensor | None], extra: dict[str, torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """``grads`` (one per name of ``fqns``, ``None``: none) with ``extra[fqn]`` added where it has one: the
    gradients a backward gets from outside autograd (a reentrant checkpoint's, stranded accumulations).

    Example:
        >>> add_by_name(["a", "b"], [None, torch.ones(1)], {"a": torch.ones(1), "b": torch.ones(1)})
        (tensor([1.]), tensor([2.]))
    """
    if not extra:
        return tuple(grads)
    return tuple(g if f not in extra else extra[f] if g is None else g + extra[f] for f, g in zip(fqns, grads))


_NO_INFO = CallInfo()  # never mutated: a call without extras


class _BucketCollective(torch.autograd.Function):
    """Shared rules: the forward runs ``Buckets``; the backward applies its adjoint."""

    @staticmethod
    def forward(b: Buckets, info: CallInfo | None, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        if info is not None and info.ready is not None:
            ready, info.ready = info.ready, None  # ctx keeps info until backward: not the values
            return tuple(t.detach() for t in ready)
        if b.in_place:
            return tuple(b.run_in_place(tensors))
        pending = info.pending if info is not None else None
        if pending is not None:
            info.pending = None  # the handles hold the gathered buffer: ctx keeps info until backward
            return tuple(b.finish(pending))
        if info is not None and info.deferred is not None and b.kind == "reduce":
            return tuple(b.run_deferred(tensors, info.deferred.handles))
        return tuple(b.run(tensors))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.buckets = inputs[0]
        # read at backward time: a later gather of the same unit may switch deferral off
        ctx.info = inputs[1] if inputs[1] is not None else _NO_INFO
        ctx.set_materialize_grads(False)
        # A frozen member's result takes no gradient: without this, any trainable member in the bucket
        # made every result require one, and the modules using frozen weights saved activations and ran
        # a backward whose gradients were then dropped. (Not under torch.func, whose levels decide it.)
        if not torch._C._are_functorch_transforms_active():
            frozen = [o for o, t in zip(output, inputs[2:]) if (t is None or not t.requires_grad) and o is not t]
            if frozen and len(frozen) < len(output):
                ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        b: Buckets = ctx.buckets
        info: CallInfo = ctx.info
        if info.resolve is not None:
            info = dataclasses.replace(info.resolve(), extra=info.extra, in_graph_backward=info.in_graph_backward)
        # A reduction made by a create_graph backward, differentiated now. Its own scale is exact (it is
        # the derivative of the average), but when a scaled reduction already ran in this backward, that
        # one took the mean over ranks of this backward's loss, and the gather backward this path reaches
        # next would take it again (a MAML step's fast weights): refused. A Hessian-vector product or a
        # penalty on the gradients meets one scaled reduction per path and stays exact.
        if info.in_graph_backward and b.scale != 1.0 and b.comm.scaled_backward_task == torch._C._current_graph_task_id():
            raise second_order_error(b)
        if info.extra is not None:
            grads = add_by_name(b.fqns, grads, info.extra())
        check_dense(b.fqns, grads)
        if info.sink is not None:  # deferred reduction: keep the full gradients, reduce later
            graph = torch.is_grad_enabled()  # create_graph: the sums stay differentiable, out of place
            for f, g in zip(b.fqns, grads):  # (None: a fold node took it already, fsdpfn/ops/fold.py)
                if g is not None and f in info.sink_dtypes:
                    if not graph:  # added in place, as FSDP2 accumulates .grad: no second full gradient
                        fold_gradient(info.sink, f, g, info.sink_dtypes[f])
                    else:
                        have = info.sink.get(f)
                        info.sink[f] = g.to(info.sink_dtypes[f]) if have is None else have + g.to(info.sink_dtypes[f])
            return (None,) * (2 + len(b.fqns))
        adj = b.adjoint
        assert adj is not None, "collective without an adjoint"
        if adj.kind == "reduce" and adj.scale != 1.0:
            b.comm.scaled_backward_task = torch._C._current_graph_task_id()
        by_name = dict(zip(b.fqns, grads))
        if info.carry is not None:  # gradients accumulated without reduction in earlier backwards
            for f in adj.fqns:  # a member frozen since keeps its entry: reduced once it trains again
                acc = info.carry.pop(f, None)
                if acc is not None:  # (a sink's own tensor: added into in place outside create_graph)
                    g = by_name.get(f)
                    by_name[f] = acc if g is None else acc + g if torch.is_grad_enabled() else acc.add_(g)
        # Even when no gradient reached this rank the collective runs: the peers may have one.
        picked = [by_name.get(f) for f in adj.fqns]
        # Left in flight only in the owner's own backward, and never when it builds a graph (create_graph
        # may read the result inside this backward). Its results then go to the owner, not to autograd.
        deferred = info.deferred
        later = deferred is not None and deferred.active and not torch.is_grad_enabled()
        if later:
            made = CallInfo(deferred=deferred)
        elif torch.is_grad_enabled() and adj.kind == "reduce":
            made = CallInfo(in_graph_backward=True)  # create_graph: the reduced gradient may be differentiated
        else:
            made = None
        out = apply_buckets(adj, picked, made)
        res = dict(zip(adj.fqns, out))
        if info.keep_none:
            missing = {f: res[f] for f in b.fqns if by_name.get(f) is None and res.get(f) is not None}
            if missing:  # read only once the reduction is done: after its handles, if it is in flight
                adj.comm.guard.note_missing(list(missing))  # the pass check compares the ranks' sets
                check = UsedElsewhere(missing, adj.comm.guard)
                if later:
                    deferred.handles.append(check)  # type: ignore[union-attr]  # later: deferred is set
                else:
                    check.wait()
            grads_out = [res.get(f) if by_name.get(f) is not None else None for f in b.fqns]
        else:
            grads_out = [res.get(f) for f in b.fqns]
        if later:
            for f, g in zip(b.fqns, grads_out):
                if g is not None:
                    deferred.keep(f, g)  # type: ignore[union-attr]
            return (None,) * (2 + len(b.fqns))
        return (None, None, *grads_out)

    @staticmethod
    def jvp(ctx: Any, _b: Any, _info: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        # Both collectives are linear: the tangent of the output is the collective of the tangents.
        if ctx.buckets.extension is not None:  # not linear: a transform quantises, say
            raise NotImplementedError(f"jvp through the all-gather transforms of {list(ctx.buckets.extension.fqns)}")
        return tuple(ctx.buckets.run(tangents))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], b: Buckets, _info: Any, *tensors: torch.Tensor | None) -> Any:
        moved = []
        for t, d in zip(tensors, in_dims[2:]):
            if t is None:
                moved.append(None)
            elif d is None:
                moved.append(t.unsqueeze(0).expand(info.batch_size, *t.shape))
            else:
                moved.append(t.movedim(d, 0))
        out = apply_buckets(b.batched(), moved)
        return tuple(out), tuple(0 for _ in out)


class UnshardFunction(_BucketCollective):
    """All-gather of a set of buckets; its backward is ``ReduceFunction``."""


class ReduceFunction(_BucketCollective):
    """Reduce-scatter of a set of buckets; its backward is ``UnshardFunction``."""


def apply_buckets(
    b: Buckets, tensors: Sequence[torch.Tensor | None], info: CallInfo | None = None
) -> tuple[torch.Tensor, ...]:
    """Run ``b`` as a differentiable op (``UnshardFunction`` or ``ReduceFunction`` by its kind).

    ``info.pending`` are the handles of this very collective, launched earlier by ``b.launch`` on the
    same tensors (prefetch): the forward then only waits for them. ``info.sink`` defers the reduction."""
    fn = UnshardFunction if b.kind == "gather" else ReduceFunction
    if _direct_apply is not None and not torch._C._are_functorch_transforms_active():
        # Function.apply binds default arguments through inspect.signature on every call (~70 us, about
        # 100 calls a step on a 48-unit model); ours have none, so do what it does next, directly.
        return _direct_apply(fn, *_unwrap_dead((b, info, *tensors)))
    return fn.apply(b, info, *tensors)


def _find_direct_apply() -> tuple[Any, Any]:
    try:
        from torch._functorch.utils import unwrap_dead_wrappers

        def apply(cls: Any, *args: Any) -> Any:
            return super(torch.autograd.Function, cls).apply(*args)  # the C++ apply Function.apply ends in

        return apply, unwrap_dead_wrappers
    except (ImportError, AttributeError):  # pragma: no cover - another torch layout: the public path
        return None, None


_direct_apply, _unwrap_dead = _find_direct_apply()
