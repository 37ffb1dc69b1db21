"""``torch.autograd.detect_anomaly`` with ``fully_shard``: a rule for ``aten._is_any_true`` on ``DTensor``s.

Anomaly mode checks every gradient a backward node returns with ``isnan(grad)._is_any_true()``. The
compat layer's parameters receive their gradients as ``DTensor``s from one autograd node (``LocalShards``),
and DTensor has no sharding rule for ``_is_any_true``: every backward under ``detect_anomaly`` failed
with "Operator aten._is_any_true.default does not have a sharding strategy registered" (torch's
``fully_shard`` sets ``.grad`` outside autograd and is not checked). ``allow_anomaly_checks`` adds a
rule (once per process, only where torch has none): this rank's answer on its local tensor, or-ed over
the mesh dims the tensor is sharded or partial on, so every rank reads the same answer and raises
together.

Example:
    >>> allow_anomaly_checks()                          # doctest: +SKIP
    >>> with torch.autograd.detect_anomaly():
    ...     model(x).sum().backward()                   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdpfn.core.mesh_any import any_over_mesh

__all__ = ["allow_anomaly_checks"]


def allow_anomaly_checks() -> None:
    """Give DTensor a rule for ``aten._is_any_true`` unless it has one (idempotent)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if not isinstance(handlers, dict):
        return  # another torch: nothing to add to
    handlers.setdefault(torch.ops.aten._is_any_true.default, _is_any_true)  # one step: safe across rank threads


def _is_any_true(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    t = args[0]
    local = op_call(t._local_tensor)
    dims = tuple(i for i, p in enumerate(t.placements) if not p.is_replicate())
    return any_over_mesh(local, t.device_mesh, dims) if dims else local
