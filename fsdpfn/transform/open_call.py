"""``OpenCall``: the record of one ``apply`` call between its ``begin`` and ``end``."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import FrameType
from typing import Any

__all__ = ["OpenCall"]


@dataclass(eq=False)
class OpenCall:
    """One ``apply`` call between ``begin`` and ``end``: what ``close`` must undo.

    ``anchor`` (calls begun from compiled code only) is the frame that began the call; once it is off
    the stack without the call having ended, the forward raised inside compiled code and the call is
    stale."""

    call: Any  # a Call, or the traced executor's TracedCall
    anchor: FrameType | None = None
    swapped: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)
    overridden: list[tuple[Any, bool, Any]] = field(default_factory=list)
    hooks: Any = None  # the entered saved_tensors_hooks context
    closed: bool = False
    traced: bool = False  # run by the traced executor (inside one compiled graph)
    thread: int | None = None  # the thread that began it (fsdpfn.transform.occupancy); None: not recorded
