"""The bucket layout: how many parameters' shards travel in one flat collective buffer.

A bucket holds the parameters of one unit that share a collective dtype. Each rank contributes one flat
segment of ``numel`` elements: its padded shards one after another, each stored *dim-major* (the sharded
dimension first, shape ``(chunk, *other_dims)``). The all-gather output is ``(world, numel)``; a parameter
sharded on any dim is then a view ``(world * chunk, *other_dims)[:rows].movedim(0, dim)`` of its own
contiguous segment, so a one-parameter bucket yields its full parameter as a pure view of the gathered
buffer and a many-parameter bucket needs a single copy-out (``torch.split_with_sizes_copy``).

Every function here also takes leading *batch* dimensions (used by ``vmap`` rules): shards of shape
``(*batch, *local_shape)`` pack to ``(*batch, numel)`` and a gathered ``(world, *batch, numel)`` unpacks
to full tensors ``(*batch, *shape)``. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpfn.layout.spec import ShardSpec

__all__ = ["BucketLayout"]


@dataclass(frozen=True)
class BucketLayout:
    """Offsets of several parameters' padded shards inside one flat per-rank segment.

    Example:
        >>> specs = (ShardSpec((5, 2), 2), ShardSpec((3,), 2))
        >>> layout = BucketLayout.build(("w", "b"), specs, torch.float32)
        >>> layout.offsets, layout.numel   # w: 3 rows x 2, b: 2 rows
        ((0, 6), 8)
        >>> flat = layout.pack_shards([torch.ones(3, 2), torch.ones(2)], rank=0)
        >>> flat.shape
        torch.Size([8])
    """

    fqns: tuple[str, ...]
    specs: tuple[ShardSpec, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]
    numel: int
    _cache: dict[Any, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)  # per-rank geometry

    @classmethod
    def build(cls, fqns: Sequence[str], specs: Sequence[ShardSpec], dtype: torch.dtype) -> BucketLayout:
        """Lay ``specs`` out back to back (no gaps) in the order given."""
        if len(fqns) != len(specs):
            raise ValueError(f"BucketLayout: {len(fqns)} names for {len(specs)} specs")
        worlds = {s.world for s in specs}
        if len(worlds) > 1:
            raise ValueError(f"BucketLayout: specs disagree on the world size: {sorted(worlds)}")
        offsets, total = [], 0
        for spec in specs:
            offsets.append(total)
            total += spec.padded_numel
        return cls(tuple(fqns), tuple(specs), dtype, tuple(offsets), total)

    @property
    def world(self) -> int:
        """Number of ranks the bucket is split over."""
        return self.specs[0].world if self.specs else 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """Padded per-rank elements of each member."""
        return tuple(s.padded_numel for s in self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's segment."""
        return self.numel * self.dtype.itemsize

    # --- parameter-major layout (point-to-point transports) ----------------------------------
    @property
    def full_offsets(self) -> tuple[int, ...]:
        """Offset of each member's full tensor in a parameter-major buffer (full tensors back to back)."""
        out, total = [], 0
        for spec in self.specs:
            out.append(total)
            total += spec.numel
        return tuple(out)

    @property
    def full_numel(self) -> int:
        """Elements of the parameter-major buffer: every member's full tensor, unpadded."""
        return sum(spec.numel for spec in self.specs)

    @property
    def rows_contiguous(self) -> bool:
        """Whether every member is split on dim 0, so that each rank's rows are one contiguous range
        of the member's full tensor (what a transport writing straight into full tensors needs)."""
        return all(spec.dim == 0 for spec in self.specs)

    def row_range(self, member: int, rank: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of member ``member``'s full tensor that ``rank`` owns (dim 0 split)."""
        spec = self.specs[member]
        start, stop = spec.bounds(rank)
        return start * spec.row_numel, stop * spec.row_numel

    def unpack_direct(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Full tensors as views of a parameter-major buffer (no copy)."""
        return [buf[off : off + spec.numel].view(spec.shape) for off, spec in zip(self.full_offsets, self.specs)]

    # --- all-gather side --------------------------------------------------------------------
    def pack_shards(
        self,
        shards: Sequence[torch.Tensor | None],
        rank: int,
        *,
        batch: tuple[int, ...] = (),
        device: torch.device | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy unpadded local shards (cast to ``dtype``) into a new zero-padded ``(*batch, numel)`` buffer
        (or into ``out``, of that shape and ``dtype``, which is returned).

        A ``None`` shard counts as zeros."""
        self._check_count(shards)
        nb = len(batch)
        if out is None:
            if device is None:
                device = next((s.device for s in shards if s is not None), torch.device("cpu"))
            # every element is written below (copies, then zeros for padding and None), so no zero-fill
            out = torch.empty(*batch, self.numel, dtype=self.dtype, device=device)
        elif tuple(out.shape) != (*batch, self.numel) or out.dtype != self.dtype:
            raise ValueError(f"pack_shards: out is {tuple(out.shape)} {out.dtype}, expected {(*batch, self.numel)} {self.dtype}")
        dsts, srcs = [], []
        for (fqn, off, padded, rows, n, local, view, dim), shard in zip(self._members(rank), shards):
            real = n if shard is not None else 0
            if real < padded:
                out[..., off + real : off + padded].zero_()
            if shard is None:
                continue
            if shard.shape[nb:] != local or shard.shape[:nb] != batch:
                raise ValueError(
                    f"shard of {fqn!r} has shape {tuple(shard.shape)} but rank {rank} of this plan "
                    f"holds {batch + local}; was it built by another plan or world size?"
                )
            if n == 0:
                continue
            dsts.append(out[..., off : off + n].view(*batch, *view))
            srcs.append(shard.movedim(nb + dim, nb) if dim else shard)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return out

    def _members(self, rank: int) -> list[tuple[str, int, int, int, int, torch.Size, tuple[int, ...], int]]:
        """Per member on ``rank`` (computed once): name, offset, padded size, local rows, local
        elements, local shape, the dim-major view shape of its rows, and its split dim."""
        got = self._cache.get(("members", rank))
        if got is None:
            got = self._cache[("members", rank)] = [
                (fqn, off, spec.padded_numel, rows, rows * spec.row_numel, torch.Size(spec.local_shape(rank)), (rows, *spec.other_dims), spec.dim)
                for fqn, spec, off in zip(self.fqns, self.specs, self.offsets)
                for rows in (spec.local_rows(rank),)
            ]
        return got

    def unpack_full(self, gathered: torch.Tensor, *, batch_ndim: int = 0) -> list[torch.Tensor]:
        """Full tensors from the all-gather output ``(world, *batch, numel)``.

        A one-member unbatched bucket gives a view of ``gathered`` (when contiguous: not columns of a
        gather shared with other buckets); otherwise one copy-out per call.
        """
        nb = batch_ndim
        world = self.world
        if nb == 0:
            g = gathered.view(world, self.numel)
            if len(self.specs) == 1 and g.is_contiguous():  # (columns of a shared gather are copied out)
                return [_full_view(g, self.specs[0], 0)]
            # one buffer for every member's copy (one allocation, one thing to account for)
            whole = g.new_empty(world * self.numel)
            bufs = [whole[world * off : world * (off + size)].view(world, size) for off, size in zip(self.offsets, self.sizes)]
            torch.split_with_sizes_copy(g, list(self.sizes), dim=1, out=bufs)
            return [_full_view(b, spec, 0) for b, spec in zip(bufs, self.specs)]
        out = []
        for spec, off, size in zip(self.specs, self.offsets, self.sizes):
            seg = gathered[..., off : off + size].movedim(0, nb)  # (*batch, world, size)
            out.append(_full_view(seg.reshape(*seg.shape[:nb], world * size), spec, nb))
        return out

    # --- reduce-scatter side ----------------------------------------------------------------
    def pack_full(
        self,
        fulls: Sequence[torch.Tensor | None],
        *,
        batch: tuple[int, ...] = (),
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """Lay full tensors out as the reduce-scatter input ``(world, *batch, numel)``; ``None`` is zero."""
        self._check_count(fulls)
        nb = len(batch)
        if device is None:
            device = next((f.device for f in fulls if f is not None), torch.device("cpu"))
        out = torch.empty(self.world, *batch, self.numel, dtype=self.dtype, device=device)
        for fqn, spec, off, full in zip(self.fqns, self.specs, self.offsets, fulls):
            seg = out[..., off : off + spec.padded_numel]
            if full is None:
                seg.zero_()
                continue
            if tuple(full.shape) != batch + spec.shape:
                raise ValueError(
                    f"gradient of {fqn!r} has shape {tuple(full.shape)}, expected {batch + spec.shape}"
                )
            chunk, rows = spec.chunk, spec.rows
            if chunk == 0 or spec.row_numel == 0:
                continue
            src = full.reshape(*batch, 1) if not spec.shape else full.movedim(nb + spec.dim, nb) if spec.dim else full
            if not nb and rows == self.world * chunk:  # no padding: one copy of the whole tensor, rank-major
                seg.copy_(src.reshape(self.world, spec.padded_numel))
                continue
            dst = seg.view(self.world, *batch, chunk, *spec.other_dims)
            q, rem = divmod(rows, chunk)
            if q:
                body = src.narrow(nb, 0, q * chunk).reshape(*batch, q, chunk, *spec.other_dims)
                dst[:q].copy_(body.movedim(nb, 0))
            if rem:
                dst[q].narrow(nb, 0, rem).copy_(src.narrow(nb, q * chunk, rem))
                dst[q].narrow(nb, rem, chunk - rem).zero_()  # padding
            if q + (rem > 0) < self.world:
                dst[q + (rem > 0) :].zero_()  # ranks that own no rows
        return out

    def unpack_shards(self, flat: torch.Tensor, rank: int, *, batch_ndim: int = 0) -> list[torch.Tensor]:
        """Unpadded local shards as views of a ``(*batch, numel)`` segment (reduce-scatter output)."""
        batch = tuple(flat.shape[:batch_ndim])
        out = []
        for _fqn, off, _padded, _rows, n, _local, view, dim in self._members(rank):
            seg = flat[..., off : off + n].view(*batch, *view)
            out.append(seg.movedim(batch_ndim, batch_ndim + dim) if dim else seg)
        return out

    # --- the same, without writes into buffers (compiled graphs) -----------------------------------
    # The methods above fill a fresh buffer in place, which a compiled graph functionalises into a chain
    # of whole-buffer copies (one per member). These build each result from its members in one
    # concatenation instead; same layout, same values, no batch dimensions.
    def concat_shards(self, shards: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """``pack_shards`` as one concatenation: the ``(numel,)`` padded segment of ``rank``."""
        self._check_count(shards)
        parts = []
        for (_fqn, _off, padded, _rows, n, _local, _view, dim), shard in zip(self._members(rank), shards):
            flat = (shard.movedim(dim, 0) if dim else shard).reshape(-1).to(self.dtype)
            parts.append(flat if n == padded else torch.cat([flat, flat.new_zeros(padded - n)]))
        return torch.cat(parts)

    def split_full(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """``unpack_full`` without the shared copy-out buffer: each member's full tensor from the
        ``(world, numel)`` gathered buffer (a view for a one-member bucket, one copy per member else)."""
        g = gathered.view(self.world, self.numel)
        if len(self.specs) == 1:
            return [_full_view(g, self.specs[0], 0)]
        return [
            _full_view(g[:, off : off + size].reshape(-1), spec, 0) for spec, off, size in zip(self.specs, self.offsets, self.sizes)
        ]

    def concat_full(self, fulls: Sequence[torch.Tensor | None], *, device: torch.device | None = None) -> torch.Tensor:
        """``pack_full`` as one concatenation: the ``(world, numel)`` reduce-scatter input (``None`` is zero)."""
        self._check_count(fulls)
        world = self.world
        parts = []
        for spec, full in zip(self.specs, fulls):
            if full is None:
                parts.append(torch.zeros(world, spec.padded_numel, dtype=self.dtype, device=device))
                continue
            rows = (full.reshape(1) if not spec.shape else full.movedim(spec.dim, 0)).to(self.dtype)
            rows = rows.reshape(spec.rows, spec.row_numel)
            pad = world * spec.chunk - spec.rows
            if pad:
                rows = torch.cat([rows, rows.new_zeros(pad, spec.row_numel)])
            parts.append(rows.reshape(world, spec.padded_numel))
        return torch.cat(parts, dim=1)

    def _check_count(self, tensors: Sequence[object]) -> None:
        if len(tensors) != len(self.fqns):
            raise ValueError(f"bucket of {list(self.fqns)} got {len(tensors)} tensors")


def _full_view(buf: torch.Tensor, spec: ShardSpec, nb: int) -> torch.Tensor:
    """``buf`` is ``(*batch, world * padded_numel)`` in dim-major order; return the full tensor view."""
    batch = tuple(buf.shape[:nb])
    padded_rows = spec.world * spec.chunk
    rows_major = buf.view(*batch, padded_rows, *spec.other_dims)
    # each view op costs ~1 us of host time per parameter per gather: skip the ones that change nothing
    if spec.rows != padded_rows:
        rows_major = rows_major.narrow(nb, 0, spec.rows)
    if not spec.shape:
        return rows_major.view(batch)
    return rows_major.movedim(nb, nb + spec.dim) if spec.dim else rows_major
