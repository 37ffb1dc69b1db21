"""Gathered parameters kept after a unit's backward: FSDP2's ``set_reshard_after_backward(False)``.

A pipeline schedule runs several microbatches' backwards in a row and, for an ``FSDPModule`` stage, turns
resharding after backward off meanwhile (and on again before the step's reduction): FSDP2 then leaves the
unsharded parameters in memory after a unit's backward, so the next microbatch's backward gathers nothing.
fsdpfn keeps the copy a backward re-gathered (``KeptCopies``, one per root, by unit or group name) and the
next backward of that unit, in any forward's graph, uses it. The copy is dropped when the knob turns on
again, when a forward gathers the unit anew (one copy at a time, as FSDP2's forward reuses its own), or
when the shards changed since (an optimizer step: their version counters moved).

Example:
    >>> stage.set_reshard_after_backward(False)       # a schedule does this per microbatch   # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fsdpfn.compat.explicit_unshard import shard_versions

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext

__all__ = ["KeptCopies"]


class KeptCopies:
    """The gathered parameters a root's units keep after backward (``set_reshard_after_backward(False)``)."""

    def __init__(self) -> None:
        self._copies: dict[str, tuple[dict[str, torch.Tensor], Any]] = {}

    def get(self, root: RootContext, name: str) -> dict[str, torch.Tensor] | None:
        """Unit or group ``name``'s kept copy, if it still holds the current shards' values."""
        got = self._copies.get(name)
        if got is None:
            return None
        full, versions = got
        if versions != shard_versions(root, full):
            del self._copies[name]  # the shards changed since (an optimizer step): gather again
            return None
        return full

    def keep(self, root: RootContext, name: str, full: dict[str, torch.Tensor]) -> None:
        """Keep ``full`` (what a backward re-gathered for ``name``) if the unit does not reshard after backward."""
        if not root.knobs(name).reshard_after_backward:
            self._copies[name] = (full, shard_versions(root, full))

    def drop(self, names: set[str] | None = None) -> None:
        """Free the kept copies of ``names`` (of every unit: ``None``)."""
        if names is None:
            self._copies.clear()
        else:
            for name in names & self._copies.keys():
                del self._copies[name]
