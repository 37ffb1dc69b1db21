"""Tensor-parallel parameters under ``fully_shard``: a ``DTensor`` on a TP mesh, sharded once more over
the data-parallel mesh with FSDP2's layout.

The layout itself (``TPParam``, ``spmd_layout``: the TP-local tensor split with ``torch.chunk`` over the dp
ranks, FSDP2's ``_StridedShard``/``Shard`` placements on the dp + tp mesh, the ``DTensor`` the TP forward
sees) lives in ``fsdpfn.ops.tp``, shared with the functional layer (``fsdpfn.shard``); this file keeps
compat's own form, ``dp_mesh_dims`` (parameters that are ``DTensor``s on the whole SPMD mesh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdpfn.layout.tp import split_factor
from fsdpfn.ops.tp import TPParam, spmd_layout, tp_param, unwrap

__all__ = ["SpmdMesh", "TPParam", "spmd_layout", "tp_param", "unwrap"]


@dataclass(frozen=True, eq=False)
class SpmdMesh:
    """``fully_shard(mesh, dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``: the whole SPMD
    mesh, the data-parallel sub-mesh fsdpfn communicates over (``shard``, or ``(replicate, shard)``), and
    the indices of the data-parallel dims in the whole mesh."""

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    shard_dim: int
    replicate_dim: int | None

    @classmethod
    def of(cls, mesh: DeviceMesh, dims: Any, kind: str) -> SpmdMesh:
        """Validate ``dims`` against ``mesh`` (names as FSDP2 takes them)."""
        if not (hasattr(dims, "shard_names") and hasattr(dims, "replicate_names")):
            raise TypeError(
                f"{kind}: dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims(shard=..., replicate=...) "
                f"naming dims of the mesh, got {type(dims).__name__}"
            )
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"{kind}: mesh must have mesh_dim_names when dp_mesh_dims is provided")
        shard, replicate = tuple(dims.shard_names), tuple(dims.replicate_names)
        for name in shard + replicate:
            if name not in names:
                raise ValueError(f"{kind}: mesh dim name {name!r} of dp_mesh_dims not found in mesh.mesh_dim_names {names}")
        if len(shard) != 1 or len(replicate) > 1:
            raise NotImplementedError(
                f"{kind}: dp_mesh_dims={dims}: fsdpfn.compat shards over exactly one named dim (and replicates over at "
                "most one); flatten several dims into one mesh dim first, or shard over a sub-mesh (mesh=mesh['dp'])"
            )
        dp_mesh = mesh[shard[0]] if not replicate else DeviceMesh._concatenate([mesh[replicate[0]], mesh[shard[0]]])
        return cls(mesh, dp_mesh, names.index(shard[0]), names.index(replicate[0]) if replicate else None)

    def layout(self, p: Any, dim: int, where: str, kind: str) -> tuple[TPParam, tuple[Placement, ...]]:
        """The TP view and the sharded placements of parameter ``p`` (a ``DTensor`` on the whole mesh,
        ``Replicate()`` on the data-parallel dims)."""
        dp = {self.shard_dim} | ({self.replicate_dim} if self.replicate_dim is not None else set())
        if not isinstance(p, DTensor) or p.device_mesh != self.mesh:
            got = f"a DTensor on {p.device_mesh}" if isinstance(p, DTensor) else f"a plain {type(p).__name__}"
            raise ValueError(
                f"{kind}: {where} is {got}; with dp_mesh_dims every parameter must be a DTensor on the whole mesh "
                f"{self.mesh} (e.g. via distribute_module), Replicate() on the data-parallel dims"
            )
        if any(not isinstance(p.placements[i], Replicate) for i in dp):
            raise ValueError(
                f"{kind}: {where} has placements {p.placements}; with dp_mesh_dims it must be Replicate() on the "
                f"data-parallel dims {sorted(dp)} of {self.mesh}"
            )
        later = range(self.shard_dim + 1, self.mesh.ndim)
        split = split_factor([(p.placements[j].dim, self.mesh.size(j)) for j in later if isinstance(p.placements[j], (Shard, _StridedShard))], dim)
        placements = list(p.placements)
        placements[self.shard_dim] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        return TPParam(self.mesh, tuple(p.placements), p.shape, frozenset(dp)), tuple(placements)


