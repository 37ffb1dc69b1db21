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

import torch
import torch.distributed.fsdp as torch_fsdp

__all__ = ["fsdp2_has", "fsdp2_lacks", "torch_version"]


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
