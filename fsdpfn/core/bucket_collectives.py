"""The bucket collectives of ``Comm``: a unit's all-gather from its shards and reduce-scatter from its
full gradients, packed through one flat buffer or (CPU, gloo) exchanged straight between the tensors.

``Comm`` derives from ``BucketCollectives``; these methods build on its flat collectives (``all_gather``,
``reduce_scatter``, ``_launch``) and its groups, streams, guard and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdpfn.core.custom import CustomComms
from fsdpfn.core.exchange import Exchange, direct_route
from fsdpfn.core.guard import Guard
from fsdpfn.core.handle import ColumnsHandle, Handle
from fsdpfn.core.mesh import MeshGroups
from fsdpfn.core.stats import CommStats
from fsdpfn.layout import BucketLayout

__all__ = ["BucketCollectives"]


class BucketCollectives:
    """``Comm``'s collectives over bucket layouts (see the module docstring).

    Example:
        >>> handle = comm.gather_bucket(layout, shards)             # doctest: +SKIP
        >>> full = layout.unpack_full(handle.wait())                # doctest: +SKIP
    """

    # set by Comm.__init__; the flat collectives these build on (all_gather, _all_gather_into,
    # reduce_scatter, _launch, _stream) are Comm's methods
    groups: MeshGroups
    stats: CommStats
    guard: Guard
    exchange: Exchange | None
    reduce_exchange: Exchange | None
    exchange_min_bytes: int
    reduce_group: Any

    def direct(self, layout: BucketLayout, *, gather: bool) -> bool:
        """Whether ``layout``'s all-gather (``gather``) or reduce-scatter goes straight between the tensors
        (exchanges on CPU from ``exchange_min_bytes``), with no packed buffer, unless its small members
        would make that hold more in flight (``direct_route``): see ``gather_bucket``/``reduce_bucket``."""
        exchange = self.exchange if gather else self.reduce_exchange
        return exchange is not None and direct_route(
            layout, self.groups.world, gather=gather, device_type=self.groups.device_type, min_bytes=self.exchange_min_bytes,
            pack_below=exchange.pack_below,
        )  # fmt: skip

    def gather_bucket(
        self, layout: BucketLayout, shards: Sequence[torch.Tensor | None], *, label: str = "", custom: CustomComms | None = None
    ) -> Handle:
        """All-gather a bucket's shards. The result is ``(world, numel)`` rank-major (unpack with
        ``layout.unpack_full``) or, when ``direct(layout, gather=True)``, parameter-major (``layout.unpack_direct``):
        ``Handle.direct`` says which."""
        groups = self.groups
        if not self.direct(layout, gather=True) or any(t is None for t in shards) or (custom is not None and custom.gathers):
            user_gather = custom is not None and custom.all_gather is not None
            if groups.world == 1 or (user_gather and groups.device_type != "cuda"):
                flat = layout.pack_shards(shards, groups.rank, device=groups.device)
                return self.all_gather(flat, label=label, custom=custom)
            if user_gather:
                return self._gather_custom_cuda(layout, shards, label, custom)  # type: ignore[arg-type]
            return self._gather_in_place([layout], [shards], label)[0]
        buf = torch.empty(layout.full_numel, dtype=layout.dtype, device=groups.device)
        self.stats.track(buf)
        self.stats._note("all_gathers", label, layout.numel * groups.world * layout.dtype.itemsize)
        fp = self.guard.begin("all_gather", label, buf, groups.shard_group)
        assert self.exchange is not None  # direct(gather=True) says so
        fn, unpack = self.exchange.gather_direct(layout, shards, buf)  # type: ignore[arg-type]
        handle = self._launch("gather", fn, keep=tuple(shards), result=buf, fp=fp, finish=unpack)
        handle.direct = True
        return handle

    def _gather_custom_cuda(
        self, layout: BucketLayout, shards: Sequence[torch.Tensor | None], label: str, custom: CustomComms
    ) -> Handle:
        """A bucket through the user's all-gather on CUDA: the copy-in (and its cast) runs on the gather
        stream, as the user's gather does, into a buffer allocated on the current stream (which frees it
        after waiting for the gather; no record_stream); the handle keeps the shards until then."""
        flat = torch.empty(layout.numel, dtype=layout.dtype, device=self.groups.device)
        self._copy_in(lambda: layout.pack_shards(shards, self.groups.rank, out=flat))
        handle = self.all_gather(flat, label=label, custom=custom)
        handle.keep_also(tuple(t for t in shards if t is not None))
        return handle

    def gather_buckets(
        self, layouts: Sequence[BucketLayout], shards: Sequence[Sequence[torch.Tensor]], *, label: str = ""
    ) -> list[ColumnsHandle]:
        """All-gather several buckets in one collective (flat, in place): every bucket's shards are packed
        side by side into our row of one ``(world, sum of numels)`` result; one handle per bucket gives its
        columns, rank-major (unpack with ``layout.unpack_full``). One synchronisation of the ranks instead
        of one per bucket, for buckets that would each gather flat (several ranks, one dtype, no custom
        gather). Every rank must pass the same layouts in the same order.

        Example:
            >>> parts = comm.gather_buckets([lay_a, lay_b], [shards_a, shards_b])    # doctest: +SKIP
            >>> full_b = lay_b.unpack_full(parts[1].wait())                          # doctest: +SKIP
        """
        groups = self.groups
        dtypes = {lay.dtype for lay in layouts}
        if groups.world == 1 or len(dtypes) != 1 or len(layouts) != len(shards):
            raise ValueError(
                f"gather_buckets: needs several shard ranks (world {groups.world}), one dtype (got {sorted(map(str, dtypes))}) "
                f"and one list of shards per layout ({len(shards)} for {len(layouts)})"
            )
        whole, starts = self._gather_in_place(layouts, shards, label)
        return [ColumnsHandle(whole, a, b) for a, b in zip(starts, starts[1:])]

    def _gather_in_place(
        self, layouts: Sequence[BucketLayout], shards: Sequence[Sequence[torch.Tensor | None]], label: str
    ) -> tuple[Handle, list[int]]:
        """One flat all-gather of ``layouts`` (one dtype) into a new ``(world, sum of numels)`` result, in
        place as FSDP2 gathers: each bucket's shards are packed straight into its columns of our row, so no
        send buffer sits beside the result (1/world of the buckets less per gather in flight). Returns the
        handle and where each bucket's columns start (and, last, end)."""
        groups = self.groups
        starts = [0]
        for lay in layouts:
            starts.append(starts[-1] + lay.numel)
        out = torch.empty((groups.world, starts[-1]), dtype=layouts[0].dtype, device=groups.device)
        mine = out[groups.rank]

        def pack() -> None:
            for lay, ts, a, b in zip(layouts, shards, starts, starts[1:]):
                lay.pack_shards(ts, groups.rank, out=mine[a:b])

        self._copy_in(pack)
        # CUDA: the result is allocated on the current stream, which frees it after waiting for the gather
        # (no record_stream); the shards the copy-in reads on the gather stream are kept until then.
        keep = tuple(t for ts in shards for t in ts if t is not None) if groups.device_type == "cuda" else ()
        return self._all_gather_into(out, mine, label=label, keep=keep), starts

    def _copy_in(self, pack: Callable[[], Any]) -> None:
        """Run a gather's copy-in (packing the shards, with their cast): on CUDA on the gather stream, after
        the current stream's pending work, off the compute stream like the collective after it; on CPU here."""
        if self.groups.device_type != "cuda":
            pack()
            return
        stream = self._stream("gather")
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            pack()

    def reduce_bucket(
        self,
        layout: BucketLayout,
        fulls: Sequence[torch.Tensor | None],
        *,
        scale: float = 1.0,
        label: str = "",
        custom: CustomComms | None = None,
    ) -> Handle:
        """Reduce-scatter a bucket's full gradients into this rank's padded ``(numel,)`` segment (unpack
        with ``layout.unpack_shards``), then scale; from the gradients themselves when ``direct(layout, gather=False)``
        and they are contiguous in the bucket dtype, else through ``layout.pack_full``."""
        groups = self.groups
        if (custom is not None and custom.reduces) or not self.direct(layout, gather=False) or groups.replicate_group is not None or any(
            f is None or f.dtype != layout.dtype or not f.is_contiguous() for f in fulls
        ):
            full = layout.pack_full(fulls, device=groups.device)
            return self.reduce_scatter(full, scale=scale, label=label, custom=custom)
        out = torch.empty(layout.numel, dtype=layout.dtype, device=groups.device)
        self.stats._note("reduce_scatters", label, layout.numel * groups.world * layout.dtype.itemsize)
        fp = self.guard.begin("reduce_scatter", label, out, self.reduce_group)
        assert self.reduce_exchange is not None  # direct(gather=False) says so
        fn, add = self.reduce_exchange.reduce_direct(layout, fulls, out, lambda work: self.guard.wait(work, fp))  # type: ignore[arg-type]

        def finish(result: torch.Tensor) -> torch.Tensor:
            add(result)
            if scale != 1.0:
                result.mul_(scale)
            return result

        return self._launch("reduce", fn, keep=tuple(fulls), result=out, fp=fp, finish=finish)
