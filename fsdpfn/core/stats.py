"""``CommStats``: what one ``Comm`` issued and how many gathered bytes are alive (tests, benchmarks)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Counters of one ``Comm``: collectives issued and bytes of gathered buffers alive.

    A buffer counts as alive until its memory is freed: until no tensor shares its storage any more (a
    view, a detached alias, a tensor autograd saved, or gloo's own hold on a finished collective's buffer,
    which its worker thread drops a moment after the wait returned).

    ``log`` records ``(kind, label, nbytes)`` for every collective while ``recording`` is true.

    Example:
        >>> stats = params.plan.comm.stats; stats.reset()     # doctest: +SKIP
        >>> fsdpfn.unshard(params); stats.all_gathers          # doctest: +SKIP
    """

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    live_gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    recording: bool = False
    log: list[tuple[str, str, int]] = field(default_factory=list)

    def reset(self) -> None:
        """Zero the counters and the log (live bytes stay: they describe buffers still alive)."""
        self.all_gathers = self.reduce_scatters = self.all_reduces = 0
        self.peak_gathered_bytes = self.live_gathered_bytes
        self.log.clear()

    def _note(self, kind: str, label: str, nbytes: int) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if self.recording:
            self.log.append((kind, label, nbytes))

    def _alloc(self, nbytes: int) -> None:
        self.live_gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.live_gathered_bytes)

    def _free(self, nbytes: int) -> None:
        self.live_gathered_bytes -= nbytes

    def track(self, t: torch.Tensor) -> None:
        """Count ``t`` (a buffer holding gathered parameters, e.g. a copy-out) as live until it is freed:
        until its storage goes, which a detached alias (what a call keeps for backward, what autograd
        saves) keeps alive after the tensor object itself is gone."""
        nbytes = t.numel() * t.element_size()
        self._alloc(nbytes)
        try:
            owner: object = t.untyped_storage()  # torch keeps one Python object per storage while it lives
        except (NotImplementedError, RuntimeError):  # torch.func's wrappers (jvp, vmap) have no storage of their own
            owner = t
        weakref.finalize(owner, self._free, nbytes)
