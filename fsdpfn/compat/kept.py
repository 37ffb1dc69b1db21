"""Gathered parameters kept after a unit's backward: FSDP2's ``set_reshard_after_backward(False)``.

A pipeline schedule runs several microbatches' backwards in a row and, for an ``FSDPModule`` stage, turns
resharding after backward off meanwhile (and on again before the step's reduction): FSDP2 then leaves the
unsharded parameters in memory after a unit's backward, so the next microbatch's backward gathers nothing.
fsdpfn keeps the copy a backward used (``KeptCopies``, one per root, by unit or group name: the re-gathered
one, or the forward's own when the unit does not reshard after forward); the next gather of that unit uses
it, in a backward of any forward's graph or in the next forward (as FSDP2's forward reuses its unsharded
parameters: one gather less per microbatch under 1F1B), which takes it over and drops it as it drops its
own. The copy is dropped when the knob turns on again, when a forward gathers the unit anew (one copy at a
time), or when the shards changed since (an optimizer step: their version counters moved). ``unshard()``
of a unit kept gathered moves nothing; the ``unshard()`` results of every unit of a fused group become the
group's kept copy (``CompatApply.new_call``).

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
    """The gathered parameters a root's units keep between gathers: after a backward
    (``set_reshard_after_backward(False)``), or after a forward that does not reshard."""

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

    def take(self, root: RootContext, name: str) -> dict[str, torch.Tensor] | None:
        """``get``, for a forward's gather: the copy leaves the kept set (that forward owns it now)."""
        full = self.get(root, name)
        if full is not None:
            del self._copies[name]
        return full

    def keep(self, root: RootContext, name: str, full: dict[str, torch.Tensor]) -> None:
        """At the start of ``name``'s reduction: keep ``full`` (what its backward used) if the unit does not
        reshard after backward, else drop what is kept (FSDP2 reshards there)."""
        if root.knobs(name).reshard_after_backward:
            self._copies.pop(name, None)
        else:
            self.hold(root, name, full)

    def hold(self, root: RootContext, name: str, full: dict[str, torch.Tensor]) -> None:
        """Keep ``full`` (detached aliases: no graph) for the next gather of ``name``; not a copy made under
        ``inference_mode`` (autograd refuses to save inference tensors for a later training forward)."""
        if any(t.is_inference() for t in full.values()):
            self._copies.pop(name, None)
            return
        self._copies[name] = ({f: t.detach() for f, t in full.items()}, shard_versions(root, full))

    def drop_resharded(self, root: RootContext) -> None:
        """Free the kept copies of the units that reshard after backward (at the end of a backward)."""
        for name in [n for n in self._copies if root.knobs(n).reshard_after_backward]:
            del self._copies[name]

    def drop(self, names: set[str] | None = None) -> None:
        """Free the kept copies of ``names`` (of every unit: ``None``)."""
        if names is None:
            self._copies.clear()
        else:
            for name in names & self._copies.keys():
                del self._copies[name]
