"""The few collectives the checkpoint layer needs, all through ``fsdpfn.core.Comm``.

``comm`` may be ``None`` for a single process without a process group: every helper is then local.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdpfn.checkpoint.errors import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError
from fsdpfn.core import Comm
from fsdpfn.core.guard import INTERNAL
from fsdpfn.ops.span import span_comm

__all__ = ["broadcast_tensors", "comm_for", "dcp_group", "dist_ready", "is_root", "root_run"]

_ALIGN = 16  # byte alignment of each tensor inside a packed broadcast buffer


def is_root(comm: Comm | None) -> bool:
    """Whether this process is the mesh's first rank (coordinate 0 in every dim): the one that writes
    the checkpoint's side files and whose replicated values are saved."""
    if comm is None:
        return True
    coord = comm.mesh.get_coordinate()
    return coord is not None and all(c == 0 for c in coord)


def dist_ready() -> bool:
    """Whether a default process group exists (else DCP runs in its single-process mode)."""
    from torch.distributed import is_available, is_initialized

    return is_available() and is_initialized()


def comm_for(plans: Sequence[Any]) -> Comm | None:
    """The ``Comm`` a checkpoint of ``plans`` (``ShardPlan``s) coordinates over: 1-D, over every rank
    that holds a part of them (each plan's mesh and, for tensor-parallel parameters, their dp + tp mesh)
    and no other, so that pipeline stages sharded over sub-meshes of one world checkpoint independently
    (``fsdpfn.ops.span.span_comm``). Without plans: every rank of the default process group (``None``
    when there is none, or a world of one: a single process)."""
    plans = [plan for plan in plans if plan.comm is not None]
    if plans:
        return span_comm(plans)
    from torch.distributed import get_world_size

    if not dist_ready() or get_world_size() == 1:
        return None
    from fsdpfn.core import init_mesh

    return Comm(init_mesh())


def dcp_group(comm: Comm | None) -> Any:
    """The process group ``torch.distributed.checkpoint`` runs over for ``comm`` (from ``comm_for``):
    its ranks only (``None``: the default group, or no group at all)."""
    return None if comm is None else comm.groups.shard_group


def _device(comm: Comm) -> torch.device:
    return comm.groups.device


_LABEL = INTERNAL + "checkpoint broadcast from the root rank"


def root_run(comm: Comm | None, fn: Callable[[], int | None]) -> int:
    """Run ``fn`` on the mesh root only and share its integer result (0 for ``None``) with every rank.

    If ``fn`` raises, the root re-raises it and every other rank raises the same message (as the same
    type for the checkpoint errors and common built-ins, else ``CheckpointError``), so no rank is left
    waiting in a later collective.
    """
    root = is_root(comm)
    value, err, exc = 0, b"", None
    if root:
        try:
            value = int(fn() or 0)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others were told
            exc, err = e, f"{type(e).__name__}\n{e}".encode()[:65536]
    if comm is not None and comm.dp_world > 1:
        head = torch.tensor([value, len(err)], dtype=torch.int64).to(_device(comm))
        comm.broadcast(head, label=_LABEL).wait()
        value, n = (int(v) for v in head.tolist())
        if n:
            buf = torch.tensor(list(err), dtype=torch.uint8) if root else torch.empty(n, dtype=torch.uint8)
            buf = buf.to(_device(comm))
            comm.broadcast(buf, label=_LABEL).wait()
            err = bytes(buf.cpu().tolist())
    if exc is not None:
        raise exc
    if err:
        name, _, message = err.decode(errors="replace").partition("\n")
        raise _ERRORS.get(name, CheckpointError)(f"{message} [raised on the root rank]")
    return value


_ERRORS: dict[str, type[Exception]] = {
    c.__name__: c
    for c in (CheckpointError, CheckpointMismatchError, UnsafeCheckpointError, ValueError, TypeError, KeyError,
              FileExistsError, FileNotFoundError, NotADirectoryError, PermissionError)
}


def _offsets(metas: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for shape, dtype in metas:
        offsets.append(total)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, total


def broadcast_tensors(
    comm: Comm | None,
    metas: Sequence[tuple[tuple[int, ...], torch.dtype]],
    values: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """Every rank gets the root's ``values`` (shapes and dtypes ``metas``) in ONE broadcast of packed bytes.

    ``values`` is read on the root only (others pass ``None``). Results live on the mesh's device and are
    views of one buffer.
    """
    if comm is None or comm.dp_world == 1:
        assert values is not None, "broadcast_tensors: the only rank must provide the values"
        return [v.reshape(shape) for v, (shape, _) in zip(values, metas)]
    offsets, total = _offsets(metas)
    device = _device(comm)
    if is_root(comm):
        assert values is not None, "broadcast_tensors: the root must provide the values"
        buf = torch.zeros(total, dtype=torch.uint8, device=device)
        for v, off, (shape, dtype) in zip(values, offsets, metas):
            flat = v.detach().to(device=device, dtype=dtype).contiguous().reshape(-1).view(torch.uint8)
            buf[off : off + flat.numel()].copy_(flat)
    else:
        buf = torch.empty(total, dtype=torch.uint8, device=device)
    comm.broadcast(buf, label=_LABEL).wait()
    out = []
    for off, (shape, dtype) in zip(offsets, metas):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off : off + n].view(dtype).reshape(shape))
    return out
