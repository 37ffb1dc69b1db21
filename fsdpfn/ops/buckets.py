"""What one bucket collective is: ``Buckets``, a gather or a reduce over a fixed list of tensors, with
its buckets' layouts, dtypes and scale, and its adjoint (``collective_pair``, ``reduce_collective``).

``Buckets`` runs on plain tensors without autograd (``launch``/``finish``/``run``); the differentiable
``UnshardFunction``/``ReduceFunction`` in ``fsdpfn.ops.functions`` apply it and its adjoint.

Example:
    >>> b = collective_pair(comm, rank, fqns, layouts, fqns, layouts, dtypes, scale=0.5)   # doctest: +SKIP
    >>> full = b.run(shards)                                                               # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fsdpfn.core import Comm, Handle
from fsdpfn.core.custom import CustomComms
from fsdpfn.layout import BucketLayout
from fsdpfn.ops.extension import AllGatherTransform, ExtensionGather

__all__ = ["Buckets", "collective_pair", "reduce_collective"]


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

    @property
    def gathers_into_core_buffer(self) -> bool:
        """A gather whose result is a buffer the core allocates: it moves something (not ``in_place``, where
        the results are the shards) and no all-gather transform or user's all-gather owns the buffers."""
        user_gathers = self.custom is not None and self.custom.gathers
        return self.kind == "gather" and not self.in_place and self.extension is None and not user_gathers

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

    def finish(self, pending: Sequence[Handle], *, release: bool = False) -> list[torch.Tensor]:
        """Wait for launched collectives and unpack them into results in ``fqns`` order. ``release``: no one
        else reads ``pending`` (an explicit ``unshard()``'s handles are finished twice), so a gathered
        buffer its members were copied out of is freed at once (``Handle.release``)."""
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
                    # nothing reads the gathered buffer once copied out (a shared gather's columns excepted:
                    # the other buckets still read theirs; torch.func's wrapped tensors show no storage)
                    if release and type(handle) is Handle and not any(_wrapped(t) for t in (buf, *outs)):
                        ptr = buf.untyped_storage().data_ptr()
                        if all(o.untyped_storage().data_ptr() != ptr for o in outs):
                            handle.release()
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
        return self.finish(self.launch(tensors), release=True)

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
            return self.finish(pending, release=True)
        results: dict[str, torch.Tensor] = {}
        for layout, handle in zip(self.layouts, pending):
            results.update(zip(layout.fqns, layout.unpack_shards(handle.peek(), self.rank)))
        into.extend(pending)
        return [results[f] for f in self.fqns]


def _wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is not a plain tensor with a storage of its own (torch.func's wrappers, subclasses)."""
    return type(t) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(t)


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


def _batch_shape(tensors: Sequence[torch.Tensor | None], nb: int) -> tuple[int, ...]:
    if nb == 0:
        return ()
    for t in tensors:
        if t is not None:
            return tuple(t.shape[:nb])
    raise ValueError("a batched collective needs at least one tensor to know the batch size")


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)
