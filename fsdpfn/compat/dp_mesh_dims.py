"""``DataParallelMeshDims`` for a torch that has none (2.11): the data-parallel dims of a whole SPMD mesh.

torch 2.12 added ``torch.distributed.fsdp.DataParallelMeshDims``; ``fsdpfn.compat`` re-exports torch's
where it exists and this dataclass, with the same fields and checks, where it does not, so
``fully_shard(mesh, dp_mesh_dims=...)`` reads the same on every supported torch.

Example:
    >>> DataParallelMeshDims(shard="dp").shard_names
    ('dp',)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataParallelMeshDims"]


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Names of the mesh dims that ``fully_shard`` shards over (``shard``) and replicates over
    (``replicate``, HSDP); a tuple of names flattens several dims into one. At least one must be set."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty when unset)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty when unset)."""
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)
