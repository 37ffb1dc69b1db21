"""Tensor-parallel parameters under ``fully_shard``: a ``DTensor`` on a TP mesh, sharded once more over
the data-parallel mesh with FSDP2's layout.

This rank's TP-local tensor is split with ``torch.chunk`` along the FSDP shard dim over the dp ranks.
The parameter becomes a ``DTensor`` on the concatenation of the dp and TP meshes (both sub-meshes of one
root mesh) whose dp placement is ``_StridedShard`` where TP already shards that dim (the dp chunks
interleave with the TP ones, as FSDP2 lays them out) and ``Shard`` otherwise. The dp all-gather
rebuilds the TP-local tensor, which the module's forward sees again as a ``DTensor`` on the TP mesh
with its TP placements (``TPParam.wrap``): collectives over dp are fsdpfn's, those over TP are
DTensor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["SpmdMesh", "TPParam", "spmd_layout"]


@dataclass(frozen=True, eq=False)
class TPParam:
    """A TP parameter's layout before ``fully_shard``: its mesh, placements and global shape, and (with
    ``dp_mesh_dims``) which dims of that mesh are data-parallel.

    Example:
        >>> tp = TPParam(mesh["tp"], (Shard(0),), torch.Size([6, 4]))   # doctest: +SKIP
        >>> tp.wrap(gathered_local).placements                            # doctest: +SKIP
        (Shard(dim=0),)
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    dp_dims: frozenset[int] = frozenset()

    def wrap(self, local: torch.Tensor) -> DTensor:
        """The gathered TP-local tensor as the ``DTensor`` the TP module expects (differentiable: its
        gradient comes back as the local gradient, redistributed to these placements by DTensor; on the
        data-parallel dims of an SPMD mesh it is left as it is, e.g. ``Partial``, for fsdpfn to reduce)."""
        if self.dp_dims:
            return _FromLocalKeepingDpGrads.apply(local, self)
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=_contiguous(self.shape))


class _FromLocalKeepingDpGrads(torch.autograd.Function):
    """``DTensor.from_local`` whose backward redistributes the gradient to the parameter's placements on
    the model-parallel dims only: on the data-parallel dims the local gradient (a partial sum) goes to
    fsdpfn's reduce-scatter as it is, instead of being all-reduced first (FSDP2 does the same)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, tp: TPParam) -> DTensor:  # type: ignore[override]
        ctx.tp = tp
        return DTensor.from_local(local, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=_contiguous(tp.shape))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        tp = ctx.tp
        if not isinstance(grad, DTensor):
            return grad, None
        target = tuple(g if i in tp.dp_dims else p for i, (g, p) in enumerate(zip(grad.placements, tp.placements)))
        if target != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, target)
        return grad.to_local(), None


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
        split = 1
        for j in range(self.shard_dim + 1, self.mesh.ndim):
            pl = p.placements[j]
            if isinstance(pl, (Shard, _StridedShard)) and pl.dim == dim:
                split *= self.mesh.size(j)
        placements = list(p.placements)
        placements[self.shard_dim] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        return TPParam(self.mesh, tuple(p.placements), p.shape, frozenset(dp)), tuple(placements)


def spmd_layout(
    p: DTensor, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], dim: int, where: str, kind: str
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of TP parameter ``p`` once sharded on ``dim`` over ``dp_mesh`` (whose own
    placements, ``Shard(dim)`` or ``(Replicate(), Shard(dim))``, are ``dp_placements``). ``where`` names the
    parameter in errors (``"parameter 'weight' of Linear"``)."""
    tp_mesh = p.device_mesh
    if tp_mesh._get_root_mesh() != dp_mesh._get_root_mesh():
        raise ValueError(
            f"{kind}: {where} is a DTensor on {tp_mesh}, which is not a sub-mesh of the same device mesh as the "
            f"data-parallel mesh {dp_mesh}; build both from one init_device_mesh (e.g. mesh['dp'] for {kind} and "
            "mesh['tp'] for parallelize_module)"
        )
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if dp_names is None or tp_names is None or set(dp_names) & set(tp_names):
        raise ValueError(
            f"{kind}: {where} is already a DTensor on {tp_mesh}, which shares mesh dims with the data-parallel mesh "
            f"{dp_mesh}. Tensor-parallel parameters must live on a sibling sub-mesh: pass {kind}(..., mesh=mesh['dp']) "
            "with the parameters on mesh['tp'] of the same named mesh (or is the module already managed by another "
            f"{kind} root?)"
        )
    bad = [pl for pl in p.placements if not isinstance(pl, (Shard, Replicate))]
    if bad or len(p.placements) > 2:
        raise NotImplementedError(
            f"{kind}: {where} has tensor-parallel placements {p.placements}; fsdpfn.compat (like FSDP2) shards "
            "DTensor parameters of a 1-D or 2-D model-parallel mesh with Shard/Replicate placements only"
        )
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except Exception as e:  # noqa: BLE001 - torch's reasons vary by version; say what to do
        raise ValueError(
            f"{kind}: {where}: cannot combine the data-parallel mesh {dp_mesh} with its tensor-parallel mesh "
            f"{tp_mesh} ({e}); take both from one init_device_mesh with the data-parallel dims first"
        ) from e
    split = p._spec.num_shards_map[dim]
    fsdp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    placements = tuple(fsdp if isinstance(pl, Shard) else pl for pl in dp_placements) + tuple(p.placements)
    return mesh, placements


def tp_param(p: DTensor) -> TPParam:
    """What ``fully_shard`` keeps of a TP parameter to rebuild it after the dp all-gather."""
    return TPParam(p.device_mesh, tuple(p.placements), p.shape)


def unwrap(value: Any) -> Any:
    """A ``DTensor``'s local tensor (anything else unchanged)."""
    return value._local_tensor if isinstance(value, DTensor) else value


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
