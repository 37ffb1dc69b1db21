"""Storage of FSDP2's communication hooks on a ``UnitState``: ``set_custom_all_gather``,
``set_custom_reduce_scatter`` and ``set_all_reduce_hook`` become one ``fsdpfn.core.custom.CustomComms``
per unit, which the root hands to the core with the unit's collectives (the core calls them). The
gradient divide factor and ``set_force_sum_reduction_for_comms`` are copied in because they decide the
reduce op and the scaling the user's objects see.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fsdpfn.compat.state import UnitState
from fsdpfn.core.custom import CustomComms

__all__ = ["check_all_gather", "check_reduce_scatter", "update_custom"]

_UNSET: Any = object()


def update_custom(st: UnitState, *, all_gather: Any = _UNSET, reduce_scatter: Any = _UNSET, hook: Any = _UNSET, stream: Any = _UNSET) -> None:
    """Change ``st``'s custom collectives (arguments left out keep their value) and re-read the divide
    factor and force-sum knobs; ``st.custom`` is ``None`` when nothing is customised (the default path)."""
    cur = st.custom or CustomComms()
    changes: dict[str, Any] = {"divide_factor": st.divide_factor, "force_sum": st.force_sum_reduction}
    for name, value in (("all_gather", all_gather), ("reduce_scatter", reduce_scatter), ("all_reduce_hook", hook), ("hook_stream", stream)):
        if value is not _UNSET:
            changes[name] = value
    new = replace(cur, **changes)
    st.custom = new if new.active else None


def check_all_gather(comm: Any) -> None:
    """``comm`` follows torch's ``AllGather`` protocol (``allocate`` and ``__call__``)."""
    _check(comm, "set_custom_all_gather", "AllGather", "(output_tensor, input_tensor, group, async_op)")


def check_reduce_scatter(comm: Any) -> None:
    """``comm`` follows torch's ``ReduceScatter`` protocol (``allocate`` and ``__call__``)."""
    _check(comm, "set_custom_reduce_scatter", "ReduceScatter", "(output_tensor, input_tensor, group, op)")


def _check(comm: Any, what: str, proto: str, call: str) -> None:
    if not callable(getattr(comm, "allocate", None)) or not callable(comm):
        raise TypeError(
            f"{what}: {type(comm).__name__} is not a torch.distributed.fsdp {proto}: it needs an "
            f"allocate(size, *, dtype, device) method and a __call__{call}; subclass "
            f"torch.distributed.fsdp._fully_shard._fsdp_api.{proto}"
        )
