"""Point-to-point exchanges on gloo: all-gathers and reduce-scatters built from ``isend``/``irecv``.

On these CPU machines gloo's ``reduce_scatter`` costs twice an exchange of the same bytes, and its
``all_gather`` more than an exchange from a few MiB up (numbers in ``comm.py``). An exchange can also
write straight into the full tensors: the *direct* forms send each parameter's rows on their own, so
the all-gather needs no packing of the shards and no copy out of a rank-major buffer, and the
reduce-scatter sends slices of the gradients themselves.

Every rank issues the same exchanges in the same order, so equal tag counters pair the messages up;
each member of a direct exchange has its own tag. The functions here build the ``fn(async_op)``
closures ``Comm`` launches; they allocate what the result needs and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdpfn.layout import BucketLayout

__all__ = ["Exchange", "Works"]

_TAGS = 1 << 20


class Works:
    """Several point-to-point works waited for as one (gloo's p2p works have no futures)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


class Exchange:
    """The exchanges of one shard group: ``rank`` among ``world`` ranks of ``group``."""

    def __init__(self, group: Any, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.others = [j for j in range(world) if j != rank]  # the peers, by group rank
        self._peers: list[int] | None = None
        self._tag = 0

    @property
    def peers(self) -> list[int]:
        """Global ranks of the group's members, by group rank."""
        if self._peers is None:
            self._peers = [dist.get_global_rank(self.group, j) for j in range(self.world)]
        return self._peers

    def tags(self, count: int = 1) -> int:
        """The first of ``count`` fresh consecutive tags."""
        self._tag = (self._tag + count) % _TAGS
        return (self._tag - count) % _TAGS

    def _send(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.isend(t, self.peers[peer], group=self.group, tag=tag)

    def _recv(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.irecv(t, self.peers[peer], group=self.group, tag=tag)

    # --- rank-major buffers (the layout's packed form) --------------------------------------------
    def gather_flat(self, send: torch.Tensor, rows: torch.Tensor) -> Callable[[bool], Works]:
        """Fill ``rows`` (``(world, n)`` raw bytes) with every rank's ``send`` (``n`` raw bytes)."""
        tag = self.tags()

        def fn(_async: bool) -> Works:
            works = [self._recv(rows[j], j, tag) for j in self.others]
            works += [self._send(send, j, tag) for j in self.others]
            rows[self.rank].copy_(send)
            return Works(works)

        return fn

    def reduce_flat(self, full: torch.Tensor, out: torch.Tensor) -> tuple[Callable[[bool], Works], Callable[[torch.Tensor], None], torch.Tensor]:
        """Send chunk ``j`` of ``full`` (``(world, *shape)``) to rank ``j`` and receive the peers' chunks
        of ours, the first straight into ``out``; ``add(out)`` then sums in our own chunk (and the
        other peers'). Returns ``(fn, add, extra)``; ``extra`` holds the chunks of peers beyond the first."""
        chunks = _bytes(full).view(self.world, -1)
        extra = full.new_empty((max(0, self.world - 2), *out.shape))
        slots = [out, *extra.unbind(0)]
        tag = self.tags()

        def fn(_async: bool) -> Works:
            works = [self._recv(_bytes(slot), j, tag) for j, slot in zip(self.others, slots)]
            works += [self._send(chunks[j], j, tag) for j in self.others]
            return Works(works)

        def add(result: torch.Tensor) -> None:
            if len(extra):
                result.add_(extra.sum(0))
            result.add_(full[self.rank])

        return fn, add, extra

    # --- straight into / out of the full tensors (dim-0 members) ---------------------------------
    def gather_direct(self, layout: BucketLayout, shards: Sequence[torch.Tensor], buf: torch.Tensor) -> Callable[[bool], Works]:
        """Gather every member's full tensor into ``buf`` (``layout.full_numel``, parameter-major):
        our shards are cast into our rows of ``buf`` and sent from there, the peers' rows land in place."""
        base = self.tags(len(layout.fqns))
        offsets = layout.full_offsets

        def fn(_async: bool) -> Works:
            works = []
            mine = []
            for i, (off, shard) in enumerate(zip(offsets, shards)):
                start, stop = layout.row_range(i, self.rank)
                own = buf[off + start : off + stop]
                if stop > start:
                    own.view(shard.shape).copy_(shard)
                mine.append(own)
            for i, off in enumerate(offsets):
                for j in self.others:
                    start, stop = layout.row_range(i, j)
                    if stop > start:
                        works.append(self._recv(_bytes(buf[off + start : off + stop]), j, base + i))
            for i, own in enumerate(mine):
                if own.numel():
                    works += [self._send(_bytes(own), j, base + i) for j in self.others]
            return Works(works)

        return fn

    def reduce_direct(
        self, layout: BucketLayout, fulls: Sequence[torch.Tensor], out: torch.Tensor
    ) -> tuple[Callable[[bool], Works], Callable[[torch.Tensor], None], torch.Tensor]:
        """Reduce-scatter contiguous full gradients (bucket dtype) into ``out`` (``layout.numel``, our
        padded segment; padding zeroed): rank ``j``'s rows of each gradient go to ``j`` as they are, the
        peers' rows of ours land in ``out`` (first peer) or ``extra``; ``add(out)`` sums in our own."""
        base = self.tags(len(layout.fqns))
        others = self.others
        extra = out.new_empty((max(0, self.world - 2), *out.shape))
        slots = [out, *extra.unbind(0)]
        flat = [f.reshape(-1) for f in fulls]
        own = [layout.row_range(i, self.rank) for i in range(len(fulls))]
        for i, (off, spec) in enumerate(zip(layout.offsets, layout.specs)):
            n = own[i][1] - own[i][0]
            if n < spec.padded_numel:
                out[off + n : off + spec.padded_numel].zero_()

        def fn(_async: bool) -> Works:
            works = []
            for i, off in enumerate(layout.offsets):
                n = own[i][1] - own[i][0]
                if n:
                    works += [self._recv(_bytes(slot[off : off + n]), j, base + i) for j, slot in zip(others, slots)]
            for i, f in enumerate(flat):
                for j in others:
                    start, stop = layout.row_range(i, j)
                    if stop > start:
                        works.append(self._send(_bytes(f[start:stop]), j, base + i))
            return Works(works)

        def add(result: torch.Tensor) -> None:
            if len(extra):
                result.add_(extra.sum(0))
            for i, (off, f) in enumerate(zip(layout.offsets, flat)):
                start, stop = own[i]
                if stop > start:
                    result[off : off + stop - start].add_(f[start:stop])

        return fn, add, extra


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
