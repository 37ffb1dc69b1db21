"""A link of given bandwidth and latency for a fake world's collectives (``bench/step.py --emulate-link``).

In torch's fake process group every collective returns at once, so a fake world of 8 on one GPU shows the
memory and host overhead of sharding but nothing of how well communication overlaps compute. This module
wraps the collectives fsdpfn's core and FSDP2 issue (``torch.distributed``'s ``all_gather_single`` /
``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``, ``all_reduce``, and
the names fsdpfn's core bound at import) so that each first occupies the stream it is issued on for as
long as a ring over the emulated link would take: ``latency + (world - 1) / world * bytes / bandwidth``
(twice that for an all-reduce). On CUDA that is a spinning kernel (``torch.cuda._sleep``, calibrated
once), so the time is real stream time that prefetching can hide or not; on CPU it is ``time.sleep`` in
the calling thread (the fake group runs collectives inline, so there it blocks).

    python3 bench/step.py --model gpt1b --fake-world 8 --emulate-link 50,20   # 50 GB/s, 20 us per collective
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LinkEmulator", "parse_link"]

# (where, name, kind): every collective entry point the two libraries reach, on any supported torch
_TARGETS = (
    ("torch.distributed", "all_gather_single", "gather"),
    ("torch.distributed", "all_gather_into_tensor", "gather"),
    ("torch.distributed", "reduce_scatter_single", "reduce"),
    ("torch.distributed", "reduce_scatter_tensor", "reduce"),
    ("torch.distributed", "all_reduce", "all_reduce"),
    ("fsdpfn.core.comm", "all_gather_single", "gather"),
    ("fsdpfn.core.comm", "reduce_scatter_single", "reduce"),
)


def parse_link(text: str) -> tuple[float, float]:
    """``"GBPS"`` or ``"GBPS,LATENCY_US"`` -> ``(bytes per second, latency in seconds)``."""
    parts = text.split(",")
    try:
        gbps = float(parts[0])
        latency_us = float(parts[1]) if len(parts) > 1 else 0.0
    except ValueError:
        raise ValueError(f"--emulate-link takes GBPS[,LATENCY_US] (e.g. 50,20), got {text!r}") from None
    if len(parts) > 2 or gbps <= 0 or latency_us < 0:
        raise ValueError(f"--emulate-link takes GBPS[,LATENCY_US] with GBPS > 0 and LATENCY_US >= 0, got {text!r}")
    return gbps * 1e9, latency_us * 1e-6


@dataclass
class LinkEmulator:
    """Installed by ``install()``; ``calls`` counts the emulated collectives by kind, ``seconds`` their
    emulated time (what the link would have taken, summed)."""

    bandwidth: float  # bytes per second
    latency: float  # seconds per collective
    world: int
    device: torch.device
    calls: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    _cycles_per_s: float = 0.0
    _undo: list[tuple[Any, str, Any]] = field(default_factory=list)

    def install(self) -> LinkEmulator:
        """Wrap every collective entry point found (see the module docstring); ``uninstall`` undoes it."""
        import importlib

        if self.device.type == "cuda":
            self._cycles_per_s = _calibrate(self.device)
        for where, name, kind in _TARGETS:
            module = importlib.import_module(where)
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "_emulated", False):
                continue
            self._undo.append((module, name, fn))
            setattr(module, name, self._wrap(fn, kind))
        return self

    def uninstall(self) -> None:
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)
        self._undo.clear()

    def cost(self, kind: str, nbytes: int) -> float:
        """Seconds a ring collective of ``nbytes`` (the larger of input and output) takes on this link."""
        share = (self.world - 1) / self.world * nbytes / self.bandwidth
        return self.latency + (2 * share if kind == "all_reduce" else share)

    def _wrap(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def emulated(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            self._occupy(self.cost(kind, nbytes))
            self.calls[kind] = self.calls.get(kind, 0) + 1
            return fn(*args, **kwargs)

        emulated._emulated = True  # type: ignore[attr-defined]
        return emulated

    def _occupy(self, seconds: float) -> None:
        self.seconds += seconds
        if self.device.type == "cuda":
            torch.cuda._sleep(max(1, int(seconds * self._cycles_per_s)))  # on the stream the collective is issued on
        else:
            time.sleep(seconds)

    def summary(self) -> dict[str, Any]:
        """What the JSON records: the link and what was emulated on it."""
        return {"gbps": self.bandwidth / 1e9, "latency_us": self.latency * 1e6, "calls": dict(self.calls),
                "emulated_s": self.seconds}


def _calibrate(device: torch.device) -> float:
    """Cycles of ``torch.cuda._sleep`` per second on ``device`` (timed with CUDA events)."""
    cycles = 50_000_000
    torch.cuda._sleep(1000)  # load the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)

