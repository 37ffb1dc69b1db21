"""Differentiable bucket collectives: ``UnshardFunction`` (all-gather) and ``ReduceFunction``
(reduce-scatter), each the other's adjoint.

Both are ``torch.autograd.Function``s in the ``setup_context`` style with ``jvp`` and ``vmap`` rules, so
``torch.func`` can transform through them: the collectives run inside ``forward`` on plain tensors, never
on ``torch.func``'s wrapped ones. One call moves a whole set of buckets: every collective is launched
before the first is waited for, so the buckets overlap each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fsdpfn.core import Comm, Handle
from fsdpfn.core.custom import CustomComms
from fsdpfn.layout import BucketLayout
from fsdpfn.ops.deferred import DeferredReductions
from fsdpfn.ops.extension import AllGatherTransform, ExtensionGather
from fsdpfn.ops.grad_checks import UsedElsewhere, check_dense, second_order_error

__all__ = ["Buckets", "CallInfo", "ReduceFunction", "UnshardFunction", "apply_buckets", "collective_pair", "reduce_collective"]


@dataclass(frozen=True, eq=False)
class Buckets:
    """One direction of a bucket collective over a fixed list of tensors.

    ``kind`` is ``"gather"`` (local shards in, full tensors out) or ``"reduce"`` (full tensors in,
    reduced local shards out). ``layouts`` partition ``fqns`` by collective dtype; results come out in
    ``out_dtypes`` multiplied by ``scale``. ``adjoint`` is the collective that computes this one's
    vector-Jacobian product (set once by ``collective_pair``).
    """

    kind: str
    comm: Comm
    rank: int
    fqns: tuple[str, ...]
    layouts: tuple[BucketLayout, ...]
    out_dtypes: tuple[torch.dtype, ...]
    scale: float = 1.0
    batch_ndim: int = 0
    label: str = ""
    custom: CustomComms | None = None  # the user's collectives / all-reduce hook (FSDP2's set_custom_*)
    # members gathered through their all-gather transforms (one extra uint8 collective; gather only)
    extension: ExtensionGather | None = None
    adjoint: Buckets | None = field(default=None, repr=False)
    _batched: dict[int, Buckets] = field(default_factory=dict, repr=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def batched(self) -> Buckets:
        """The same collective over tensors with one more leading batch dimension (for ``vmap``).

        The adjoint chain (gather -> reduce -> gather' -> reduce ...) is batched alike; the per-object
        cache ends the recursion at the cycle."""
        nb = self.batch_ndim + 1
        if self.extension is not None:
            raise NotImplementedError(
                f"vmap over the gather of {list(self.extension.fqns)}: parameters with an all-gather transform "
                "cannot be batched; gather them without vmap"
            )
        got = self._batched.get(nb)
        if got is None:
            got = self._batched[nb] = replace(self, batch_ndim=nb, adjoint=None, _batched={}, _memo={})
            if self.adjoint is not None:
                object.__setattr__(got, "adjoint", self.adjoint.batched())
        return got

    @property
    def in_place(self) -> bool:
        """Nothing to move: one shard rank and no batching (and, for a reduce, no replicas to all-reduce
        over), so the collective is the identity: results are the inputs, cast and scaled."""
        groups = self.comm.groups
        if self.kind == "reduce" and self.custom is not None and self.custom.reduces:
            return False  # the hook runs even where nothing moves, as in FSDP2
        if self.extension is not None:
            return False  # the transforms run at any world size, as in FSDP2
        return groups.world == 1 and not self.batch_ndim and (self.kind == "gather" or groups.replicas == 1)

    def run_in_place(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """``run`` for an ``in_place`` collective, with the same casts and scaling as the packed path:
        inputs to the bucket dtype, times ``scale``, to the output dtype (no copy when nothing changes)."""
        geometry = self._geometry()
        out = []
        for t, d, f in zip(tensors, self.out_dtypes, self.fqns):
            bucket_dtype, shape = geometry[f]
            if t is None:  # a reduce of no gradient: zeros (a gather never gets None)
                out.append(torch.zeros(shape, dtype=d, device=self.comm.groups.device))
                continue
            t = t.to(bucket_dtype)
            # a new tensor object either way (autograd must not rewrite the input's metadata); a 0-d
            # parameter's shard is (1,), its full tensor ()
            t = t * self.scale if self.scale != 1.0 else t.view_as(t)
            out.append(t.reshape(shape).to(d))
        return out

    def _geometry(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        got = self._memo.get("geometry")
        if got is None:
            got = self._memo["geometry"] = {
                f: (lay.dtype, spec.shape if self.kind == "gather" else spec.local_shape(self.rank))
                for lay in self.layouts
                for f, spec in zip(lay.fqns, lay.specs)
            }
        return got

    def launch(self, tensors: Sequence[torch.Tensor | None]) -> list[Handle]:
        """Pack and launch every bucket's collective; returns one handle per layout (no autograd)."""
        by_name = dict(zip(self.fqns, tensors))
        batch = _batch_shape(tensors, self.batch_ndim)
        device = self.comm.groups.device
        pending: list[Any] = []
        for layout in self._plain_layouts():
            members = [by_name[f] for f in layout.fqns]
            if not batch:  # the core packs, or moves the tensors themselves where that is cheaper
                if self.kind == "gather":
                    pending.append(self.comm.gather_bucket(layout, members, label=self.label, custom=self.custom))
                else:
                    pending.append(self.comm.reduce_bucket(layout, members, scale=self.scale, label=self.label, custom=self.custom))
            elif self.kind == "gather":
                flat = layout.pack_shards(members, self.rank, batch=batch, device=device)
                pending.append(self.comm.all_gather(flat, label=self.label, custom=self.custom))
            else:
                flat = layout.pack_full(members, batch=batch, device=device)
                pending.append(self.comm.reduce_scatter(flat, scale=self.scale, label=self.label, custom=self.custom))
        ext = self.extension
        if ext is not None:
            pending.append(ext.launch(self.comm, [by_name[f] for f in ext.fqns], self.rank, self.label))
        return pending

    def _plain_layouts(self) -> tuple[BucketLayout, ...]:
        """The layouts without the members an all-gather transform moves (in their own collective)."""
        if self.extension is None:
            return self.layouts
        got = self._memo.get("plain")
        if got is None:
            got = self._memo["plain"] = self.extension.other_layouts(self.layouts)
        return got

    def finish(self, pending: Sequence[Handle]) -> list[torch.Tensor]:
        """Wait for launched collectives and unpack them into results in ``fqns`` order."""
        results: dict[str, torch.Tensor] = {}
        layouts = self._plain_layouts()
        if self.extension is not None:
            results.update(self.extension.finish(pending[len(layouts)], self.comm.stats.track))
        for layout, handle in zip(layouts, pending):
            buf = handle.wait()
            if self.kind == "gather":
                if handle.direct:
                    outs = layout.unpack_direct(buf)  # views of the parameter-major buffer
                else:
                    outs = layout.unpack_full(buf, batch_ndim=self.batch_ndim)
                    if len(outs) > 1 or self.batch_ndim:  # copied out of the gathered buffer
                        copies = {id(b): b for b in (o if o._base is None else o._base for o in outs)}
                        for b in copies.values():
                            self.comm.stats.track(b)
                if self.scale != 1.0:
                    outs = [o * self.scale for o in outs]
            else:
                outs = layout.unpack_shards(buf, self.rank, batch_ndim=self.batch_ndim)
            results.update(zip(layout.fqns, outs))
        ext = () if self.extension is None else self.extension.fqns
        return [results[f] if f in ext else _cast(results[f], d) for f, d in zip(self.fqns, self.out_dtypes)]

    def run(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Launch every bucket's collective, then wait for each and unpack (no autograd)."""
        if self.in_place:
            return self.run_in_place(tensors)
        return self.finish(self.launch(tensors))

    def run_deferred(self, tensors: Sequence[torch.Tensor | None], into: list[Handle]) -> list[torch.Tensor]:
        """A reduce whose wait is left to the caller: launch, wait for the reductions already in ``into``,
        return the results' views of the output buffers at once and leave this one's handles in ``into``.
        The results may be read only after every handle in ``into`` was waited for. Falls back to ``run``
        when results need a cast or batching."""
        # One unit's reduction in flight at a time: it overlaps the backward computed since it launched,
        # and its full-size input buffer is freed before the next one is packed (no extra peak memory).
        if self.in_place:
            return self.run_in_place(tensors)
        for handle in into:
            handle.wait()
        into.clear()
        pending = self.launch(tensors)
        out_dtype = dict(zip(self.fqns, self.out_dtypes))
        exact = self.kind == "reduce" and not self.batch_ndim and all(out_dtype[f] == lay.dtype for lay in self.layouts for f in lay.fqns)
        if not exact:
            return self.finish(pending)
        results: dict[str, torch.Tensor] = {}
        for layout, handle in zip(self.layouts, pending):
            results.update(zip(layout.fqns, layout.unpack_shards(handle.peek(), self.rank)))
        into.extend(pending)
        return [results[f] for f in self.fqns]


def collective_pair(
    comm: Comm,
    rank: int,
    *,
    fqns: Sequence[str],
    gather: Sequence[BucketLayout],
    reduce_fqns: Sequence[str],
    reduce: Sequence[BucketLayout],
    dtypes: dict[str, torch.dtype],
    scale: float,
    label: str = "",
    custom: CustomComms | None = None,
    transforms: Mapping[str, AllGatherTransform] | None = None,
) -> Buckets:
    """The gather collective over ``fqns`` wired to its adjoint chain.

    Its backward reduce-scatters the ``reduce_fqns`` (trainable members, ``reduce`` layouts) with
    ``scale`` and returns them in their parameters' ``dtypes``; the reduce's own backward gathers again.
    Members with an entry in ``transforms`` are gathered through it (``fsdpfn.ops.extension``); their
    gradients are reduced like any other member's.
    """
    gather_dtype = {f: lay.dtype for lay in gather for f in lay.fqns}
    spec_of = {f: s for lay in gather for f, s in zip(lay.fqns, lay.specs)}
    moved = [f for f in fqns if transforms and f in transforms]
    ext = None
    if moved:
        assert transforms is not None
        ext = ExtensionGather(tuple(moved), tuple(spec_of[f] for f in moved), tuple(transforms[f] for f in moved), tuple(gather_dtype[f] for f in moved))
    g = Buckets("gather", comm, rank, tuple(fqns), tuple(gather), tuple(gather_dtype[f] for f in fqns), label=label, custom=custom, extension=ext)
    r = reduce_collective(comm, rank, reduce_fqns, reduce, dtypes, scale, label, grad_dtypes=gather_dtype, custom=custom)
    object.__setattr__(g, "adjoint", r)
    return g


def reduce_collective(
    comm: Comm,
    rank: int,
    fqns: Sequence[str],
    layouts: Sequence[BucketLayout],
    dtypes: dict[str, torch.dtype],
    scale: float,
    label: str = "",
    *,
    grad_dtypes: dict[str, torch.dtype],
    custom: CustomComms | None = None,
) -> Buckets:
    """The reduce collective over ``fqns`` (results in ``dtypes``), its adjoint gathering in ``grad_dtypes``."""
    fqns = tuple(fqns)
    r = Buckets("reduce", comm, rank, fqns, tuple(layouts), tuple(dtypes[f] for f in fqns), scale, label=label, custom=custom)
    g = Buckets("gather", comm, rank, fqns, tuple(layouts), tuple(grad_dtypes[f] for f in fqns), scale, label=label, custom=custom)
    object.__setattr__(r, "adjoint", g)
    object.__setattr__(g, "adjoint", r)
    return r


@dataclass
class CallInfo:
    """Per-call extras of a bucket collective (not part of the cached ``Buckets``).

    ``pending``: handles of this very collective launched earlier (prefetch). ``sink``: when set, the
    backward does not reduce: it adds the incoming full gradients into ``sink[fqn]`` (in ``sink_dtypes``)
    and passes no gradient to the shards (deferred reduction). ``carry``: full gradients accumulated
    earlier into a sink; the backward adds (and removes) them before it reduces. ``keep_none``: a member
    that received no gradient on this rank gets ``None`` instead of its (still reduced) shard gradient.
    ``deferred``: while it is ``active``, the backward's reduce-scatter is not waited for: its handles
    and results go to that ``DeferredReductions`` instead of autograd, and its owner adds them to the
    gradients once the handles are done. ``in_graph_backward``: this reduction was made by a backward that
    builds a graph (``create_graph=True``), so differentiating its result is a second-order derivative.
    """

    pending: Sequence[Handle] | None = None
    sink: dict[str, torch.Tensor] | None = None
    sink_dtypes: dict[str, torch.dtype] | None = None
    carry: dict[str, torch.Tensor] | None = None
    keep_none: bool = False
    deferred: DeferredReductions | None = None
    in_graph_backward: bool = False  # a reduction a backward with create_graph=True made (see second_order_error)


_NO_INFO = CallInfo()  # never mutated: a call without extras


class _BucketCollective(torch.autograd.Function):
    """Shared rules: the forward runs ``Buckets``; the backward applies its adjoint."""

    @staticmethod
    def forward(b: Buckets, info: CallInfo | None, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
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
        # A reduction made by a create_graph backward, differentiated now. Its own scale is exact (it is
        # the derivative of the average), but when a scaled reduction already ran in this backward, that
        # one took the mean over ranks of this backward's loss, and the gather backward this path reaches
        # next would take it again (a MAML step's fast weights): refused. A Hessian-vector product or a
        # penalty on the gradients meets one scaled reduction per path and stays exact.
        if info.in_graph_backward and b.scale != 1.0 and b.comm.scaled_backward_task == torch._C._current_graph_task_id():
            raise second_order_error(b)
        check_dense(b.fqns, grads)
        if info.sink is not None:  # deferred reduction: keep the full gradients, reduce later
            for f, g in zip(b.fqns, grads):
                if g is not None and f in info.sink_dtypes:
                    g = g.to(info.sink_dtypes[f])
                    info.sink[f] = info.sink[f] + g if f in info.sink else g
            return (None,) * (2 + len(b.fqns))
        adj = b.adjoint
        assert adj is not None, "collective without an adjoint"
        if adj.kind == "reduce" and adj.scale != 1.0:
            b.comm.scaled_backward_task = torch._C._current_graph_task_id()
        by_name = dict(zip(b.fqns, grads))
        if info.carry is not None:  # gradients accumulated without reduction in earlier backwards
            for f in b.fqns:
                acc = info.carry.pop(f, None)
                if acc is not None:
                    g = by_name.get(f)
                    by_name[f] = acc if g is None else acc + g
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
                check = UsedElsewhere(missing)
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


def _batch_shape(tensors: Sequence[torch.Tensor | None], nb: int) -> tuple[int, ...]:
    if nb == 0:
        return ()
    for t in tensors:
        if t is not None:
            return tuple(t.shape[:nb])
    raise ValueError("a batched collective needs at least one tensor to know the batch size")


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)
