"""Tensor-parallel parameters under FSDP: a ``DTensor`` on a TP mesh, sharded once more over the
data-parallel mesh with FSDP2's layout (shared by ``fsdpfn.shard`` and ``fsdpfn.compat.fully_shard``).

This rank's TP-local tensor is split with ``torch.chunk`` along the FSDP shard dim over the dp ranks.
Seen from outside (``to_dtensor``, checkpoints, compat's parameters) the shard is a ``DTensor`` on the
concatenation of the dp and TP meshes (both sub-meshes of one root mesh) whose dp placement is
``_StridedShard`` where TP already shards that dim (the dp chunks interleave with the TP ones, as FSDP2
lays them out) and ``Shard`` otherwise. The dp all-gather rebuilds the TP-local tensor, which the
module's forward sees again as a ``DTensor`` on the TP mesh with its TP placements (``TPParam.wrap``):
collectives over dp are fsdpfn's, those over TP are DTensor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from fsdpfn.layout.spec import contiguous_stride
from fsdpfn.layout.tp import local_slice, split_factor

__all__ = ["TPLayout", "TPParam", "spmd_layout", "tp_layout", "tp_param", "unwrap"]


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
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=contiguous_stride(self.shape))


class _FromLocalKeepingDpGrads(torch.autograd.Function):
    """``DTensor.from_local`` whose backward redistributes the gradient to the parameter's placements on
    the model-parallel dims only: on the data-parallel dims the local gradient (a partial sum) goes to
    fsdpfn's reduce-scatter as it is, instead of being all-reduced first (FSDP2 does the same)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, tp: TPParam) -> DTensor:  # type: ignore[override]
        ctx.tp = tp
        return DTensor.from_local(local, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=contiguous_stride(tp.shape))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        tp = ctx.tp
        if not isinstance(grad, DTensor):
            return grad, None
        target = tuple(g if i in tp.dp_dims else p for i, (g, p) in enumerate(zip(grad.placements, tp.placements)))
        if target != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, target)
        return grad.to_local(), None


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
            f"{kind}: {where} has tensor-parallel placements {p.placements}; fsdpfn (like FSDP2) shards "
            "DTensor parameters of a 1-D or 2-D model-parallel mesh with Shard/Replicate placements only"
        )
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except Exception as e:  # noqa: BLE001 - torch's reasons vary by version; say what to do
        raise ValueError(
            f"{kind}: {where}: cannot combine the data-parallel mesh {dp_mesh} with its tensor-parallel mesh "
            f"{tp_mesh} ({e}); take both from one init_device_mesh with the data-parallel dims first"
        ) from e
    split = split_factor([(pl.dim, tp_mesh.size(i)) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)], dim)
    fsdp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    placements = tuple(fsdp if isinstance(pl, Shard) else pl for pl in dp_placements) + tuple(p.placements)
    return mesh, placements


def tp_param(p: DTensor) -> TPParam:
    """What ``fully_shard`` keeps of a TP parameter to rebuild it after the dp all-gather."""
    return TPParam(p.device_mesh, tuple(p.placements), p.shape)


def unwrap(value: Any) -> Any:
    """A ``DTensor``'s local tensor (anything else unchanged)."""
    return value._local_tensor if isinstance(value, DTensor) else value



@dataclass(frozen=True, eq=False)
class TPLayout:
    """A TP parameter under ``fsdpfn.shard``: its TP view (``tp``) and, for ``to_dtensor`` and
    checkpoints, the dp + tp ``mesh`` and FSDP2's ``placements`` of its dp shard.

    Example:
        >>> lay = params.plan.tp["0.weight"]                              # doctest: +SKIP
        >>> lay.placements                                                # doctest: +SKIP
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """

    tp: TPParam
    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    @property
    def shape(self) -> torch.Size:
        """The parameter's global shape."""
        return self.tp.shape

    def dtensor(self, shard: torch.Tensor) -> DTensor:
        """This rank's dp shard of the TP-local tensor as the global ``DTensor`` FSDP2 + TP would hold
        (shares ``shard``'s storage)."""
        return DTensor.from_local(
            shard, self.mesh, self.placements, run_check=False, shape=self.shape, stride=contiguous_stride(self.shape)
        )

    def tp_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local slice of the full (global) tensor ``full`` (a view; no communication)."""
        mesh = self.tp.mesh
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"tp_local: this rank is not in the tensor-parallel mesh {mesh}")
        splits = [(pl.dim, mesh.size(i), coord[i]) for i, pl in enumerate(self.tp.placements) if isinstance(pl, Shard)]
        return local_slice(full, splits)

    def full(self, tp_local: torch.Tensor) -> torch.Tensor:
        """The global tensor from this rank's TP-local tensor (a collective over the TP mesh when the
        parameter is TP-sharded; every TP rank must call it)."""
        if all(isinstance(pl, Replicate) for pl in self.tp.placements):
            return tp_local
        dt = DTensor.from_local(tp_local, self.tp.mesh, self.tp.placements, run_check=False, shape=self.shape, stride=contiguous_stride(self.shape))
        return dt.full_tensor()


def tp_layout(p: DTensor, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...], dim: int, where: str, kind: str) -> TPLayout:
    """The ``TPLayout`` of TP parameter ``p`` sharded on ``dim`` over ``dp_mesh`` (see ``spmd_layout``;
    same checks and errors).

    Example:
        >>> tp_layout(model[0].weight, mesh["dp"], (Shard(0),), 0, "parameter '0.weight'", "shard")  # doctest: +SKIP
    """
    mesh, placements = spmd_layout(p, dp_mesh, dp_placements, dim, where, kind)
    return TPLayout(tp_param(p), mesh, placements)
