"""Traceable collectives: what the traced executor emits into a compiled graph.

The eager core (``comm.py``) launches work on side streams or gloo's thread and hands back handles;
under ``torch.compile(fullgraph=True)`` the same collectives are torch's functional collectives
(``_c10d_functional`` ops and their ``wait_tensor``), which the compiler sees, orders and may fuse. Like the
eager core, all-gathers move raw bytes (any dtype) and reduce-scatters sum (complex as pairs of reals),
leaving the scaling to the caller.
"""

from __future__ import annotations

import torch

from fsdpfn.core.mesh import MeshGroups

__all__ = ["traced_all_gather", "traced_reduce_scatter"]

_ops = torch.ops._c10d_functional


def traced_all_gather(flat: torch.Tensor, groups: MeshGroups) -> torch.Tensor:
    """All-gather this rank's ``(n,)`` segment over the shard group into ``(world, n)``.

    Example:
        >>> full = traced_all_gather(flat, plan.comm.groups)   # inside a compiled function  # doctest: +SKIP
    """
    world = groups.world
    if world == 1:
        return flat.unsqueeze(0)
    data = flat.contiguous().view(torch.uint8)
    out = _ops.wait_tensor(_ops.all_gather_into_tensor(data, world, groups.shard_group.group_name))
    return out.view(flat.dtype).view(world, -1)


def traced_reduce_scatter(full: torch.Tensor, groups: MeshGroups) -> torch.Tensor:
    """Sum ``(world, n)`` over the shard group keeping this rank's ``(n,)``, then sum that over the
    replicate group (HSDP).

    Example:
        >>> mine = traced_reduce_scatter(packed, plan.comm.groups)   # doctest: +SKIP
    """
    world = groups.world
    out = full.reshape(-1) if world == 1 else None
    complex_ = full.is_complex()
    if out is None:
        data = torch.view_as_real(full).reshape(-1) if complex_ else full.reshape(-1)
        data = _ops.wait_tensor(_ops.reduce_scatter_tensor(data, "sum", world, groups.shard_group.group_name))
        out = torch.view_as_complex(data.view(-1, 2)) if complex_ else data
    if groups.replicate_group is not None and groups.replicas > 1:
        data = torch.view_as_real(out).reshape(-1) if complex_ else out
        data = _ops.wait_tensor(_ops.all_reduce(data, "sum", groups.replicate_group.group_name))
        out = torch.view_as_complex(data.view(-1, 2)) if complex_ else data
    return out
