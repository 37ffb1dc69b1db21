"""Process-group and device-mesh set-up: ``init_mesh`` and the groups a mesh implies."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MeshGroups", "default_mesh", "init_mesh", "mesh_groups", "span_mesh"]


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend(device_type: str) -> str:
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def _ensure_process_group(device_type: str) -> None:
    """Start the default process group from torchrun's environment, or as a world of one."""
    if dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(_backend(device_type))
    else:
        dist.init_process_group(_backend(device_type), store=dist.HashStore(), rank=0, world_size=1)


def default_mesh() -> DeviceMesh:
    """The mesh ``torch.distributed.fsdp.fully_shard`` uses when given none: 1-D over the default
    process group, without dim names, on ``cuda`` when a GPU is visible and ``cpu`` otherwise; the group
    is started as ``init_mesh`` starts it when there is none yet.

    Made anew on each call, in the calling thread, as torch does: a mesh belongs to the ranks (threads,
    under PyTorch's threaded test group) of the process group it was made in, so it is never cached
    per process.

    Example:
        >>> mesh = default_mesh()          # DeviceMesh('cpu', [0, 1]) on two ranks  # doctest: +SKIP
    """
    device_type = _default_device_type()
    _ensure_process_group(device_type)
    return init_device_mesh(device_type, (dist.get_world_size(),))


def init_mesh(
    shape: Sequence[int] | int | None = None,
    *,
    names: Sequence[str] | None = None,
    device: str | torch.device | None = None,
) -> DeviceMesh:
    """Create the device mesh fsdpfn shards over, starting the default process group if needed.

    Under ``torchrun`` the group comes from the environment (``RANK``, ``WORLD_SIZE``, ...); run as
    plain ``python`` it is a world of one. ``device`` defaults to ``cuda`` (NCCL) when a GPU is visible,
    else ``cpu`` (gloo). ``shape=None`` is 1-D over every rank (FSDP); ``(R, S)`` is HSDP with ``R``
    replicas of ``S``-way sharding, dims named ``("replicate", "shard")`` unless ``names`` says otherwise.

    Example:
        >>> mesh = fsdpfn.init_mesh()          # 1-D, every rank  # doctest: +SKIP
        >>> mesh = fsdpfn.init_mesh((2, 2))    # HSDP on 4 ranks  # doctest: +SKIP
    """
    try:
        device_type = torch.device(device).type if device is not None else _default_device_type()
    except (RuntimeError, TypeError):
        device_type = str(device)  # not a device torch knows: refused below, by name
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"init_mesh: device {device!r} is not supported; use 'cpu' or 'cuda'")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("init_mesh: device='cuda' was asked for but no GPU is visible; use device='cpu'")
    _ensure_process_group(device_type)
    world = dist.get_world_size()
    if shape is None:
        shape = (world,)
    elif isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2) or any(s < 1 for s in shape):
        raise ValueError(f"init_mesh: shape {shape} must be (shard,) or (replicate, shard) with positive sizes")
    if math.prod(shape) != world:
        raise ValueError(
            f"init_mesh: shape {shape} covers {math.prod(shape)} ranks but the world has {world}; "
            f"pick a shape whose product is {world}"
        )
    if names is None:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"init_mesh: {len(names)} names {names} for a {len(shape)}-D shape {shape}")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def span_mesh(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """A 1-D mesh over every rank of ``meshes``: the ranks that must all take part in a step that
    concerns the whole of what lives on them (a checkpoint of a tree sharded over a data-parallel mesh
    and, with tensor parallelism, its TP mesh too).

    A 1-D mesh that already holds every one of those ranks is returned as it is; ranks that make up the
    whole world get the default group's mesh. Otherwise (a sub-mesh: one pipeline stage's data-parallel
    ranks, or HSDP's two dims) a group of those ranks alone is made, by them alone (``new_group`` with
    local synchronisation), so ranks outside it (other pipeline stages) need not join. Collective over
    those ranks: each calls it at the same point.

    Example:
        >>> stage = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]  # doctest: +SKIP
        >>> span_mesh([stage])                   # the stage's own dp mesh          # doctest: +SKIP
    """
    if not meshes:
        raise ValueError("span_mesh: no mesh given")
    ranks = sorted({int(r) for mesh in meshes for r in mesh.mesh.flatten().tolist()})
    for mesh in meshes:
        if mesh.ndim == 1 and sorted(int(r) for r in mesh.mesh.tolist()) == ranks:
            return mesh
    device_type = meshes[0].device_type
    if len(ranks) == dist.get_world_size():
        return init_device_mesh(device_type, (len(ranks),))
    group = dist.new_group(ranks, use_local_synchronization=True)
    return DeviceMesh.from_group(group, device_type)


@dataclass(frozen=True)
class MeshGroups:
    """The groups fsdpfn communicates over for a mesh: shard group (last dim) and replicate group."""

    shard_group: dist.ProcessGroup | None  # None: replicate-only (DDP), every rank holds everything
    replicate_group: dist.ProcessGroup | None  # None: no replicas (1-D, or a replicate dim of one rank)
    rank: int
    world: int
    replicas: int
    device_type: str

    @property
    def device(self) -> torch.device:
        """The device shards and gathered buffers live on."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    @property
    def simulated(self) -> bool:
        """Whether the other ranks are simulated (``simulated_group``)."""
        group = self.shard_group if self.shard_group is not None else self.replicate_group
        return group is not None and simulated_group(group)


def simulated_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s other ranks are simulated: torch's ``fake`` backend, where one process stands
    for rank 0 of a larger world and collectives return at once, moving nothing (memory and host-overhead
    studies of a world the machine does not have).

    Example:
        >>> simulated_group(dist.group.WORLD)   # doctest: +SKIP
        False
    """
    return dist.get_backend(group) == "fake"


def mesh_groups(mesh: DeviceMesh, *, replicate_only: bool = False) -> MeshGroups:
    """The shard and replicate groups of a 1-D (FSDP) or 2-D (HSDP, ``(replicate, shard)``) mesh.

    ``replicate_only`` reads a 1-D mesh as replicas of a world of one (data parallelism without
    sharding: gradients are all-reduced, nothing is gathered).

    Example:
        >>> groups = mesh_groups(fsdpfn.init_mesh())   # doctest: +SKIP
        >>> groups.rank, groups.world                   # doctest: +SKIP
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"expected a torch.distributed.device_mesh.DeviceMesh (from fsdpfn.init_mesh), got {type(mesh).__name__}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(f"a {mesh.ndim}-D mesh is not supported; use 1-D (FSDP) or 2-D (replicate, shard)")
    if replicate_only:
        if mesh.ndim != 1:
            raise ValueError(f"replicate-only data parallelism needs a 1-D mesh, got {mesh.ndim}-D")
        group = mesh.get_group(0)
        return MeshGroups(None, group, 0, 1, dist.get_world_size(group), mesh.device_type)
    shard_group = mesh.get_group(mesh.ndim - 1)
    # a replicate dim of one rank (torchtitan's meshes keep such dims) has nothing to all-reduce: without
    # its group a reduction skips the all-reduce and keeps the direct exchanges (FSDP2 runs it anyway)
    replicate_group = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None
    return MeshGroups(
        shard_group=shard_group,
        replicate_group=replicate_group,
        rank=dist.get_rank(shard_group),
        world=dist.get_world_size(shard_group),
        replicas=dist.get_world_size(replicate_group) if replicate_group is not None else 1,
        device_type=mesh.device_type,
    )
