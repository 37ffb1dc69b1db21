"""What this torch's FSDP2 offers, for tests that compare fsdpfn with it across supported torch versions.

fsdpfn supports torch 2.11 and newer; FSDP2 grew API since 2.11 (``DataParallelMeshDims``,
``FSDPModule.reset_iter_state``, ``set_separate_reduce_scatter_group``, ...). A test that runs torch's
``fully_shard`` as the reference for such a feature asks here first, and skips the torch side (saying
which torch lacks what) rather than fail on an ``AttributeError`` of the reference.

Example:
    >>> fsdp2_has("fully_shard")
    True
    >>> torch_version() >= (2, 11)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp

__all__ = ["GatherCount", "fsdp2_all_gathers", "fsdp2_has", "fsdp2_lacks", "torch_version"]


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch (``(2, 13)`` for ``2.13.0+cpu``)."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def fsdp2_has(name: str) -> bool:
    """Whether ``torch.distributed.fsdp`` or its ``FSDPModule`` has ``name`` in this torch."""
    return hasattr(torch_fsdp, name) or hasattr(torch_fsdp.FSDPModule, name)


def fsdp2_lacks(name: str) -> str:
    """A skip reason: this torch's FSDP2 has no ``name`` to compare fsdpfn with (``""`` when it has)."""
    return "" if fsdp2_has(name) else f"torch {torch.__version__}'s FSDP2 has no {name} to compare fsdpfn.compat with"


class GatherCount:
    """What ``fsdp2_all_gathers`` counts: ``count``, torch's FSDP2 all-gathers so far."""

    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def fsdp2_all_gathers() -> Iterator[GatherCount]:
    """Count torch's ``fully_shard`` all-gathers (one per parameter group unsharded, at its
    ``foreach_all_gather``) while the block runs: how often FSDP2 gathers, to compare fsdpfn's
    ``comm.stats.all_gathers`` with.

    Example:
        >>> with fsdp2_all_gathers() as gathers:
        ...     pass                      # torch's fully_shard forwards and backwards here
        >>> gathers.count
        0
    """
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as groups

    counter, real = GatherCount(), groups.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.count += 1
        return real(*args, **kwargs)

    groups.foreach_all_gather = counted
    try:
        yield counter
    finally:
        groups.foreach_all_gather = real
