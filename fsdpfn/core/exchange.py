"""Point-to-point exchanges on gloo: all-gathers and reduce-scatters built from ``isend``/``irecv``.

On these CPU machines gloo's ``reduce_scatter`` costs twice an exchange of the same bytes, and its
``all_gather`` more than an exchange from a few MiB up (numbers in ``comm.py``). An exchange can also
write straight into the full tensors: the *direct* forms send each parameter's rows on their own, so
the all-gather needs no packing of the shards and no copy out of a rank-major buffer, and the
reduce-scatter sends slices of the gradients themselves.

Every rank issues the same exchanges in the same order, so equal tag counters pair the messages up;
each member of a direct exchange has its own tag. The counter belongs to the process group, not to an
``Exchange``: two meshes whose dims span the same ranks share one group (torch's ``DeviceMesh`` reuses the
default group for a dim over the whole world), and their exchanges must never issue the same tag, or a
receive posted as a reduction finishes takes the other's message (world 3, blocks and experts on two
meshes: gloo aborted on the size; messages of equal size would have been swapped silently).

Members too small to be worth a message of their own (under ``Exchange.pack_below`` bytes per rank:
biases, norms) travel together, one message per peer and bucket: on loopback gloo a message costs about
0.2 ms of CPU whatever its size, as much as ~0.35 MiB of payload, so a LayerNorm-MLP block's six
parameters cost three messages instead of six. The functions
here build the ``fn(async_op)`` closures ``Comm`` launches; they allocate what the result needs and
nothing else (but one segment, while a direct reduction over three ranks or more finishes). A reduction
receives the first peer's part while in flight and the later peers' in turn as it finishes, so that it
holds no more than its input and output, as FSDP2's reduce-scatter does. Messages go straight to the
process group's ``send``/``recv`` (group ranks), skipping ``torch.distributed``'s per-call wrappers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdpfn.layout import BucketLayout

__all__ = ["Exchange", "Works", "PACK_BELOW", "direct_route", "packed_share_ok"]

_TAGS = 1 << 20
# Each process group's next tag (a one-item list), shared by every Exchange over it. Keyed by the group
# object, which belongs to one rank (ranks that are threads of one process have groups of their own).
_GROUP_TAGS: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()

# Members of a direct exchange with fewer padded bytes per rank than this travel packed together. A
# message costs ~0.2 ms of CPU on loopback gloo (16 KiB exchanges: 0.22 ms each) and payload ~0.55 ms
# per MiB, while packing copies at several GiB/s: below ~256 KiB a message of its own costs more than
# the copy. In a microbenchmark of 36 LayerNorm-MLP unit exchanges (world 2) three messages instead of
# six cut CPU from 54-63 to 49-53 ms and wall time from 73-87 to 61-75 ms.
PACK_BELOW = 256 << 10


def packed_share_ok(layout: BucketLayout, world: int, *, gather: bool, pack_below: int = PACK_BELOW) -> bool:
    """Whether a direct exchange of ``layout`` holds no more in flight than the flat (rank-major) one.
    Its small members (``pack_below``) still travel packed: a gather holds our rows of them packed and
    the peers' inboxes, ``world`` copies of a rank's small rows, where the flat gather holds one packed
    shard of every member; a reduce-scatter holds the rows packed for each peer and the inboxes,
    ``2 (world - 1)`` copies, where the flat one packs every member once, ``world`` times a rank's rows.
    A bucket of mostly small members (narrow layers fused, or sharded over many ranks) goes flat.

    Example:
        >>> packed_share_ok(layout, 2, gather=False)     # at world 2 a direct reduce never holds more  # doctest: +SKIP
        True
    """
    item = layout.dtype.itemsize
    total = sum(spec.padded_numel for spec in layout.specs) * item
    small = sum(spec.padded_numel * item for spec in layout.specs if spec.padded_numel * item < pack_below)
    return world * small <= total if gather else 2 * (world - 1) * small <= world * total


def direct_route(
    layout: BucketLayout, world: int, *, gather: bool, device_type: str, min_bytes: int, pack_below: int = PACK_BELOW
) -> bool:
    """Whether ``layout``'s all-gather (``gather``) or reduce-scatter may go as direct exchanges between the
    tensors instead of through one packed buffer: CPU, several ranks, each parameter's rows contiguous in
    its full tensor, at least ``min_bytes`` gathered, and ``packed_share_ok``. ``Comm.direct`` decides with
    it (given a backend with point-to-point sends), and ``fsdpfn.memory`` prices the same route.

    Example:
        >>> direct_route(layout, 2, gather=True, device_type="cpu", min_bytes=1 << 20)   # doctest: +SKIP
        True
    """
    return (
        device_type != "cuda" and world > 1 and layout.rows_contiguous
        and layout.numel * world * layout.dtype.itemsize >= min_bytes
        and packed_share_ok(layout, world, gather=gather, pack_below=pack_below)
    )  # fmt: skip


@dataclass(frozen=True)
class _Route:
    """How one bucket's members travel in direct exchanges (the same on every rank)."""

    alone: tuple[int, ...]  # members sent as messages of their own
    packed: tuple[int, ...]  # members sent together: one message per peer
    rows: tuple[tuple[tuple[int, int], ...], ...]  # rows[i][j]: elements of member i's full tensor rank j owns
    full_offsets: tuple[int, ...]


def _route(layout: BucketLayout, pack_below: int) -> _Route:
    key = ("exchange_route", pack_below)
    got = layout._cache.get(key)
    if got is None:
        item = layout.dtype.itemsize
        small = [spec.padded_numel * item < pack_below for spec in layout.specs]
        rows = tuple(tuple(layout.row_range(i, j) for j in range(layout.world)) for i in range(len(layout.specs)))
        got = layout._cache[key] = _Route(
            tuple(i for i, s in enumerate(small) if not s), tuple(i for i, s in enumerate(small) if s), rows, layout.full_offsets
        )
    return got


class Works:
    """Several point-to-point works waited for as one (gloo's p2p works have no futures)."""

    __slots__ = ("works", "keep")

    def __init__(self, works: list[Any], keep: tuple = ()):
        self.works = works
        self.keep = keep  # buffers the sends read from, alive until waited for

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


class Exchange:
    """The exchanges of one shard group: ``rank`` among ``world`` ranks of ``group``."""

    def __init__(self, group: Any, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.others = [j for j in range(world) if j != rank]  # the peers, by group rank
        self.pack_below = PACK_BELOW  # members under this many bytes per rank share a message (tests vary it)
        self._next = _GROUP_TAGS.setdefault(group, [0])  # the group's, shared with its other exchanges

    def tags(self, count: int = 1) -> int:
        """The first of ``count`` fresh consecutive tags of the group."""
        first = self._next[0]
        self._next[0] = (first + count) % _TAGS
        return first

    def _send(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return self.group.send([t], peer, tag)

    def _recv(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        return self.group.recv([t], peer, tag)

    # --- rank-major buffers (the layout's packed form) --------------------------------------------
    def gather_flat(self, send: torch.Tensor, rows: torch.Tensor) -> Callable[[bool], Works]:
        """Fill ``rows`` (``(world, n)`` raw bytes) with every rank's ``send`` (``n`` raw bytes; may be
        ``rows[rank]`` itself)."""
        tag = self.tags()

        def fn(_async: bool) -> Works:
            works = [self._recv(rows[j], j, tag) for j in self.others]
            works += [self._send(send, j, tag) for j in self.others]
            if rows[self.rank].data_ptr() != send.data_ptr():  # else gathered in place
                rows[self.rank].copy_(send)
            return Works(works)

        return fn

    def reduce_flat(
        self, full: torch.Tensor, out: torch.Tensor, wait: Callable[[Any], None]
    ) -> tuple[Callable[[bool], Works], Callable[[torch.Tensor], None]]:
        """Send chunk ``j`` of ``full`` (``(world, *shape)``, consumed) to rank ``j`` and receive the first
        peer's chunk of ours into ``out``; ``add(out)`` then sums in our own chunk and receives each later
        peer's chunk, in turn, into our own chunk of ``full`` (free once summed) and sums it too: nothing
        but ``full`` and ``out`` is held (FSDP2 holds its reduce-scatter's input and output). ``wait(work)``
        waits for each later message (the guard's timed wait). Returns ``(fn, add)``."""
        chunks = _bytes(full).view(self.world, -1)
        tag = self.tags()
        first, later = self.others[0], self.others[1:]
        sends: list[Any] = []

        def fn(_async: bool) -> Works:
            sends[:] = [self._send(chunks[j], j, tag) for j in self.others]
            return Works([self._recv(_bytes(out), first, tag)])

        def add(result: torch.Tensor) -> None:
            mine = full[self.rank]
            result.add_(mine)
            for j in later:
                wait(self._recv(chunks[self.rank], j, tag))
                result.add_(mine)
            wait(Works(sends))

        return fn, add

    # --- straight into / out of the full tensors (dim-0 members) ---------------------------------
    def gather_direct(
        self, layout: BucketLayout, shards: Sequence[torch.Tensor], buf: torch.Tensor
    ) -> tuple[Callable[[bool], Works], Callable[[torch.Tensor], torch.Tensor] | None]:
        """Gather every member's full tensor into ``buf`` (``layout.full_numel``, parameter-major):
        our shards are cast into our rows of ``buf`` and sent from there, the peers' rows land in place,
        except the small members' (``pack_below``), which arrive packed. Returns ``(fn, unpack)``;
        ``unpack(buf)`` (``None`` when nothing is packed) places them once the exchange is done."""
        route = _route(layout, self.pack_below)
        rows, offs, me, others = route.rows, route.full_offsets, self.rank, self.others
        base = self.tags(len(layout.fqns) + 1)
        packed_tag = base + len(layout.fqns)
        inboxes = [buf.new_empty(sum(rows[i][j][1] - rows[i][j][0] for i in route.packed)) for j in others] if route.packed else []

        def fn(_async: bool) -> Works:
            works = []
            for off, shard, r in zip(offs, shards, rows):
                start, stop = r[me]
                if stop > start:
                    buf[off + start : off + stop].view(shard.shape).copy_(shard)
            for i in route.alone:
                off = offs[i]
                for j in others:
                    start, stop = rows[i][j]
                    if stop > start:
                        works.append(self._recv(buf[off + start : off + stop].view(torch.uint8), j, base + i))
            for j, box in zip(others, inboxes):
                if box.numel():
                    works.append(self._recv(box.view(torch.uint8), j, packed_tag))
            for i in route.alone:
                start, stop = rows[i][me]
                if stop > start:
                    own = buf[offs[i] + start : offs[i] + stop].view(torch.uint8)
                    works += [self._send(own, j, base + i) for j in others]
            keep: tuple = ()
            if route.packed:
                mine = [buf[offs[i] + rows[i][me][0] : offs[i] + rows[i][me][1]] for i in route.packed]
                out = torch.cat(mine) if len(mine) > 1 else mine[0]
                if out.numel():
                    works += [self._send(out.view(torch.uint8), j, packed_tag) for j in others]
                    keep = (out,)
            return Works(works, keep)

        if not route.packed:
            return fn, None

        def unpack(result: torch.Tensor) -> torch.Tensor:
            for j, box in zip(others, inboxes):
                pos = 0
                for i in route.packed:
                    start, stop = rows[i][j]
                    if stop > start:
                        result[offs[i] + start : offs[i] + stop].copy_(box[pos : pos + stop - start])
                        pos += stop - start
            return result

        return fn, unpack

    def reduce_direct(
        self, layout: BucketLayout, fulls: Sequence[torch.Tensor], out: torch.Tensor, wait: Callable[[Any], None]
    ) -> tuple[Callable[[bool], Works], Callable[[torch.Tensor], None]]:
        """Reduce-scatter contiguous full gradients (bucket dtype) into ``out`` (``layout.numel``, our
        padded segment; padding zeroed): rank ``j``'s rows of each gradient go to ``j`` as they are
        (the small members' packed into one message), the first peer's rows of ours land in ``out``;
        ``add(out)`` places the packed ones, sums in our own rows, then receives each later peer's rows
        in turn into one scratch segment (the gradients are autograd's: never written) and sums them.
        ``wait(work)`` waits for each later message (the guard's timed wait). Returns ``(fn, add)``."""
        route = _route(layout, self.pack_below)
        rows, me, others = route.rows, self.rank, self.others
        base = self.tags(len(layout.fqns) + 1)
        packed_tag = base + len(layout.fqns)
        flat = [f.reshape(-1) for f in fulls]
        offsets = layout.offsets
        own = [stop - start for start, stop in (r[me] for r in rows)]  # our rows of each member, in elements

        def zero_padding(t: torch.Tensor) -> torch.Tensor:  # the peers' padding is summed into ours: keep it zero
            for off, spec, n in zip(offsets, layout.specs, own):
                if n < spec.padded_numel:
                    t[off + n : off + spec.padded_numel].zero_()
            return t

        zero_padding(out)
        mine = [(i, own[i]) for i in route.packed]
        inbox_numel = sum(n for _, n in mine)
        inboxes = [out.new_empty(inbox_numel) for _ in others] if inbox_numel else []
        sends: list[Any] = []

        def receive(slot: torch.Tensor, j: int) -> list[Any]:
            return [self._recv(slot[offsets[i] : offsets[i] + own[i]].view(torch.uint8), j, base + i) for i in route.alone if own[i]]

        def fn(_async: bool) -> Works:
            works = receive(out, others[0])
            works += [self._recv(box.view(torch.uint8), j, packed_tag) for j, box in zip(others, inboxes)]
            for i in route.alone:
                f = flat[i]
                for j in others:
                    start, stop = rows[i][j]
                    if stop > start:
                        sends.append(self._send(f[start:stop].view(torch.uint8), j, base + i))
            keep = []
            if route.packed:
                for j in others:
                    parts = [flat[i][rows[i][j][0] : rows[i][j][1]] for i in route.packed]
                    pack = torch.cat(parts) if len(parts) > 1 else parts[0]
                    if pack.numel():
                        sends.append(self._send(pack.view(torch.uint8), j, packed_tag))
                        keep.append(pack)
            return Works(works, tuple(keep))

        def place(target: torch.Tensor, box: torch.Tensor) -> None:
            pos = 0
            for i, n in mine:
                if n:
                    target[offsets[i] : offsets[i] + n].copy_(box[pos : pos + n])
                    pos += n

        def add(result: torch.Tensor) -> None:
            if inboxes:
                place(result, inboxes[0])
            for i, (off, f) in enumerate(zip(offsets, flat)):
                start, stop = rows[i][me]
                if stop > start:
                    result[off : off + stop - start].add_(f[start:stop])
            if len(others) > 1:
                slot = zero_padding(torch.empty_like(result))  # the rest arrives: received, or placed from the inbox
                for k, j in enumerate(others[1:], 1):
                    wait(Works(receive(slot, j)))
                    if inboxes:
                        place(slot, inboxes[k])
                    result.add_(slot)
                slot.untyped_storage().resize_(0)  # now: gloo's thread may hold the finished receives a while
            wait(Works(sends))

        return fn, add


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
