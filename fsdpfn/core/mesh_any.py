"""``any_over_mesh``: whether a flag is true on any rank of a ``DeviceMesh`` (a collective).

DTensor has no sharding rule for ``aten._is_any_true`` (what ``torch.autograd.detect_anomaly`` runs on every
gradient a backward node returns, ``isnan(grad)._is_any_true()``); ``fsdpfn.compat`` gives it one whose
answer covers every shard, with this all-reduce.

Example:
    >>> any_over_mesh(torch.tensor(False), mesh)      # doctest: +SKIP
    tensor(False)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["any_over_mesh"]


def any_over_mesh(flag: torch.Tensor, mesh: DeviceMesh, dims: tuple[int, ...]) -> torch.Tensor:
    """``flag`` (a 0-d bool tensor, this rank's answer) or-ed over mesh dims ``dims`` (every rank of those
    dims must call it). Returns a 0-d bool tensor."""
    count = flag.to(torch.int32).reshape(1)
    for dim in dims:
        if mesh.size(dim) > 1:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return count[0] > 0
