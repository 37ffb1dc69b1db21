"""Per-parameter all-gather transforms: a parameter all-gathered in a representation of its own.

An ``AllGatherTransform`` turns a parameter's local shard into one or more *all-gather inputs* (for
instance float8 values) plus metadata that stays local (a scale), and rebuilds the full tensor from
the gathered inputs. This is FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` tensor-subclass
extension (``subclass_transform`` adapts one), usable from the functional layer too
(``fsdpfn.shard(..., all_gather_transforms=)``).

Every transformed member of a unit travels in one extra ``uint8`` collective per unit: each rank
contributes its inputs' bytes back to back, each input padded along dim 0 to the padded shard rows.
Gradients are unaffected: the gradient of the rebuilt tensor is reduce-scattered in the parameter's
own (or the reduction) dtype, as for any other parameter. Nothing here communicates; ``Comm`` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdpfn.layout import BucketLayout, ShardSpec

__all__ = ["AllGatherTransform", "ExtensionGather", "extension_of", "has_extension", "shard_mesh", "subclass_transform"]


@dataclass(frozen=True)
class AllGatherTransform:
    """How one parameter is all-gathered: ``pre(shard) -> (inputs, metadata)`` runs before the gather on
    the unpadded local shard; each input is gathered along dim 0 (inputs whose dim 0 is the local row
    count are zero-padded to the padded shard rows first); ``post(outputs, metadata, param_dtype)``
    gets the gathered inputs (``(world * rows, ...)``, padding included) and returns the full tensor
    (trimmed to the parameter's shape by ``as_strided`` when it comes back padded).

    Example (gather a float32 parameter as bfloat16):
        >>> t = AllGatherTransform(lambda s: ((s.to(torch.bfloat16),), None),
        ...                        lambda outs, meta, dtype: outs[0].to(dtype))
        >>> params = fsdpfn.shard(model, mesh, all_gather_transforms={"0.weight": t})  # doctest: +SKIP
    """

    pre: Callable[[torch.Tensor], tuple[Sequence[torch.Tensor], Any]]
    post: Callable[[tuple[torch.Tensor, ...], Any, torch.dtype], torch.Tensor]


def has_extension(t: torch.Tensor) -> bool:
    """Whether ``t``'s class defines both halves of FSDP2's all-gather extension."""
    return hasattr(t, "fsdp_pre_all_gather") and hasattr(t, "fsdp_post_all_gather")


def extension_of(t: torch.Tensor, where: str, kind: str) -> bool:
    """``has_extension(t)`` for a parameter being sharded (``where`` names it, ``kind`` the caller:
    ``fully_shard`` or ``shard``); a class with only one half is refused, not gathered as plain.

    Example:
        >>> extension_of(torch.ones(2), "parameter 'w' of Linear", "shard")
        False
    """
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"{kind}: {where} is a {type(t).__name__} defining only "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}; define both or neither"
        )
    return pre


def shard_mesh(mesh: Any) -> Any:
    """The mesh a subclass's ``fsdp_pre_all_gather`` is given: the shard dim's (FSDP2's shard mesh),
    the last dim of an HSDP ``(replicate, shard)`` mesh."""
    if mesh is None or mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    return mesh[names[-1]] if names else mesh


def subclass_transform(
    mesh: Any, outer_size: Sequence[int], module: Any, mp_policy: Any, fallback: Callable[[], torch.Tensor] | None = None
) -> AllGatherTransform:
    """The transform of a tensor subclass defining ``fsdp_pre_all_gather`` (FSDP2's five-argument form
    ``(mesh, outer_size, outer_stride, module, mp_policy)`` or the older ``(mesh)``) and
    ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (tensor, inner_tensors)``.
    ``fallback`` gives the subclass shard when the tensor handed to ``pre`` lost its class."""
    size = torch.Size(outer_size)
    stride = _contiguous_stride(size)
    def pre(shard: torch.Tensor) -> tuple[Sequence[torch.Tensor], Any]:
        if not has_extension(shard) and fallback is not None:
            shard = fallback()
        fn = shard.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if len(inspect.signature(fn).parameters) == 1:
            inputs, metadata = fn(mesh)
        else:
            inputs, metadata = fn(mesh, size, stride, module, mp_policy)
        return inputs, (shard, metadata)  # post is a method of the same tensor

    def post(outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype) -> torch.Tensor:
        shard, inner_metadata = metadata
        tensor, _inner = shard.fsdp_post_all_gather(outputs, inner_metadata, param_dtype)  # type: ignore[attr-defined]
        return tensor

    return AllGatherTransform(pre, post)


@dataclass(frozen=True)
class _Pending:
    """A launched extension gather: the collective's handle (anything with ``wait``) and, per member,
    the metadata and the (dtype, padded shape) of each input."""

    handle: Any
    entries: tuple[tuple[Any, tuple[tuple[torch.dtype, tuple[int, ...]], ...]], ...]

    def wait(self) -> torch.Tensor:
        return self.handle.wait()

    def peek(self) -> torch.Tensor:
        return self.handle.peek()


@dataclass(frozen=True)
class ExtensionGather:
    """The transformed members of one gather: pack their inputs into one ``uint8`` segment per rank,
    and rebuild full tensors from the gathered ``(world, bytes)`` buffer."""

    fqns: tuple[str, ...]
    specs: tuple[ShardSpec, ...]
    transforms: tuple[AllGatherTransform, ...]
    param_dtypes: tuple[torch.dtype, ...]

    def other_layouts(self, layouts: Sequence[BucketLayout]) -> tuple[BucketLayout, ...]:
        """``layouts`` without these members (they travel in the ``uint8`` collective instead)."""
        skip = set(self.fqns)
        kept = []
        for lay in layouts:
            idx = [i for i, f in enumerate(lay.fqns) if f not in skip]
            if len(idx) == len(lay.fqns):
                kept.append(lay)
            elif idx:
                kept.append(BucketLayout.build([lay.fqns[i] for i in idx], [lay.specs[i] for i in idx], lay.dtype))
        return tuple(kept)

    def pack(self, shards: Sequence[torch.Tensor], rank: int, device: torch.device) -> tuple[torch.Tensor, list[Any]]:
        """This rank's ``uint8`` segment and the per-member entries ``_Pending`` keeps."""
        parts, entries = [], []
        for fqn, spec, tr, shard in zip(self.fqns, self.specs, self.transforms, shards):
            with torch.no_grad():
                inputs, meta = tr.pre(shard)
            local_rows = spec.local_rows(rank)
            geometry = []
            for t in inputs:
                t = t.reshape(1) if t.dim() == 0 else t
                if t.shape[0] != spec.chunk:
                    if spec.rows == spec.world * spec.chunk:
                        pass  # evenly sharded: any leading size, the same on every rank
                    elif t.shape[0] == local_rows:
                        pad = t.new_zeros(spec.chunk - local_rows, *t.shape[1:])
                        t = torch.cat([t, pad]) if local_rows else pad
                    else:
                        raise ValueError(
                            f"all-gather transform of {fqn!r}: parameter of shape {spec.shape} is unevenly sharded over "
                            f"{spec.world} ranks, so every all-gather input must have {local_rows} (this rank's rows) or "
                            f"{spec.chunk} (the padded rows) rows, got shape {tuple(t.shape)}; return inputs split along "
                            "dim 0 like the shard"
                        )
                geometry.append((t.dtype, tuple(t.shape)))
                parts.append(t.contiguous().reshape(-1).view(torch.uint8).to(device))
            entries.append((meta, tuple(geometry)))
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        return flat, entries

    def launch(self, comm: Any, shards: Sequence[torch.Tensor], rank: int, label: str) -> _Pending:
        """Pre-transform, pack and start the one ``uint8`` all-gather of these members."""
        flat, entries = self.pack(shards, rank, comm.groups.device)
        return _Pending(comm.all_gather(flat, label=label), tuple(entries))

    def finish(self, pending: _Pending, track: Callable[[torch.Tensor], None] | None = None) -> dict[str, torch.Tensor]:
        """Wait for the gather and rebuild every member's full tensor; ``track`` is shown the memory each
        one holds (the tensor itself, or for a subclass the gathered inputs it wraps)."""
        gathered = pending.wait()
        world = gathered.shape[0]
        gathered = gathered.view(world, -1)
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for fqn, spec, tr, dtype, (meta, geometry) in zip(self.fqns, self.specs, self.transforms, self.param_dtypes, pending.entries):
            outputs = []
            for in_dtype, shape in geometry:
                n = _numel(shape) * in_dtype.itemsize
                raw = gathered[:, offset : offset + n].clone().view(-1)  # a fresh, aligned buffer to view as the dtype
                offset += n
                outputs.append(raw.view(in_dtype).view(world * shape[0], *shape[1:]))
            with torch.no_grad():
                full = tr.post(tuple(outputs), meta, dtype)
            if tuple(full.shape) != spec.shape:  # padded rows: FSDP2 trims the same way
                full = torch.as_strided(full, spec.shape, _contiguous_stride(torch.Size(spec.shape)), 0)
            if track is not None:
                for t in [full] if type(full) is torch.Tensor and full._base is None else outputs:
                    track(t)
            out[fqn] = full
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
