"""The bytes of the tensors ops make, counted while they are alive: a dispatch mode for the planner's runs on
fake tensors (``fsdpfn.memory.activations``), which cost no memory and so are measured by their storages'
sizes, from the op that makes each until it is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops make (not ``known``'s: parameters, buffers, inputs) while they
    are alive (``now``), and the most alive at once while each unit ``enter``ed and not yet ``leave``d ran
    (``peaks``); once ``record``ing, a timeline of them too, from which ``peaks_between`` reads stretches.

    Example:
        >>> with FakeTensorMode(), LiveBytes(set()) as live:          # doctest: +SKIP
        ...     y = torch.empty(4) * 2                               # two storages of 16 bytes, one alive
        >>> live.now                                                 # doctest: +SKIP
        16
    """

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.now = known, 0
        self.peaks: dict[str, int] = {}
        self.running: dict[str, int] = {}  # (a unit may run inside itself: counted per entry)
        self.timeline: list[int] | None = None  # once recording: the bytes alive after each op
        self._born: dict[int, int] = {}  # storages made while recording: where on the timeline
        self._uncounted: list[tuple[int, int, int]] = []  # (first, last moment, bytes) to take off the timeline
        self._leaving: dict[int, tuple[int, int]] = {}  # storages uncounted until freed: (first moment, bytes)
        self._made: list[tuple[int, int]] = []  # (moment, bytes) of each parameter gradient made

    def record(self) -> None:
        """Keep a timeline of the bytes alive from now on (``mark``, ``peaks_between``)."""
        self.timeline = [self.now]

    def mark(self, name: str, marks: list[tuple[str, int]]) -> None:
        """Append ``(name, the timeline's index for now)`` to ``marks``, if recording (the loss's own
        backward, to the model's output, is not)."""
        if self.timeline is not None:
            self.timeline.append(self.now)
            marks.append((name, len(self.timeline) - 1))

    def uncount(self, t: torch.Tensor | None, *, made: bool = False) -> None:
        """Leave ``t``'s storage out of the timeline from when it was made until it is freed; ``made``: it
        is a parameter's gradient (not a copy autograd made of one), noted for ``peaks_between``."""
        if t is None or self.timeline is None:
            return
        key = t.untyped_storage()._cdata
        first = self._born.pop(key, None)  # (once: a storage comes back as its own .grad)
        if first is not None:
            self._leaving[key] = (first, t.untyped_storage().nbytes())
            if made:
                self._made.append((first, t.untyped_storage().nbytes()))

    def peaks_between(self, marks: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
        """For each ``(name, moment)``, over the moments from it until the next one (the last: until now):
        the most bytes alive besides parameter gradients, each parameter gradient made in that stretch
        counted from where it was made, less all of those (so that adding them back bounds every moment
        of the stretch, made or not yet)."""
        for key in list(self._leaving):  # still alive: uncounted to the end
            self._close(key)
        alive = list(self.timeline or [self.now])
        change = [0] * (len(alive) + 1)
        for first, last, nbytes in self._uncounted:
            change[first] -= nbytes
            change[last + 1] += nbytes
        taken = 0
        for i in range(len(alive)):
            taken += change[i]
            alive[i] += taken
        ends = [m for _, m in marks[1:]] + [len(alive) - 1]
        out = []
        for (name, m), end in zip(marks, ends):
            made = [0] * (end + 1 - m)  # parameter gradients made at each moment of the stretch
            for at, nbytes in self._made:
                if m <= at <= end:
                    made[at - m] += nbytes
            most = so_far = 0
            for i, a in enumerate(alive[m : end + 1]):
                so_far += made[i]
                most = max(most, a + so_far)
            out.append((name, most - so_far))
        return tuple(out)

    def enter(self, unit: str) -> None:
        self.running[unit] = self.running.get(unit, 0) + 1
        self.peaks[unit] = max(self.peaks.get(unit, 0), self.now)

    def leave(self, unit: str) -> None:
        self.running[unit] -= 1
        if not self.running[unit]:
            del self.running[unit]

    def _freed(self, key: int, nbytes: int) -> None:
        self.known.discard(key)
        self.now -= nbytes
        if key in self._leaving:
            self._close(key)

    def _close(self, key: int) -> None:
        first, nbytes = self._leaving.pop(key)
        self._uncounted.append((first, len(self.timeline or ()) - 1, nbytes))  # the last moment it was alive in

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage._cdata in self.known:
                continue
            self.known.add(storage._cdata)
            self.now += storage.nbytes()
            weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
            if self.timeline is not None:
                self._born[storage._cdata] = len(self.timeline)
        if self.timeline is not None:
            self.timeline.append(self.now)
        for unit in self.running:
            self.peaks[unit] = max(self.peaks.get(unit, 0), self.now)
        return out
