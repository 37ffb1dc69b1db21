"""How much of a step's GPU communication-stream work ran alongside compute, read from a profiler trace.

``bench/step.py --trace DIR`` writes one Chrome trace per variant (``torch.profiler``, CPU + CUDA) and
records this summary in its JSON. A GPU kernel event carries the stream it ran on; the stream that ran the
most kernel time is taken as the compute stream, every other stream as a side stream (fsdpfn's ``gather``
and ``reduce`` streams, FSDP2's all-gather / reduce-scatter streams). For each side stream the summary gives
its busy time and how much of it overlapped kernels on the compute stream: an all-gather stream that
overlaps compute is what prefetching buys.

    python bench/trace_overlap.py DIR/trace_functional.json.gz      # print the summary of one trace
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["load_trace", "stream_overlap"]

# Event categories the profiler gives GPU work (kernels, copies, memsets) in its Chrome traces.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_trace(path: str) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace file (gzipped when its name ends in ``.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted, merged span lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_overlap(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Busy time (ms) per GPU stream and each side stream's overlap with the compute stream.

    Returns ``{"compute_stream": id, "compute_ms": t, "side": {id: {"busy_ms", "overlap_ms",
    "overlap_share", "events", "names"}}}`` (``names``: the three most frequent event names, to tell
    which stream is which); ``compute_stream`` is ``None`` when the trace has no GPU events.

    Example:
        >>> ev = [{"cat": "kernel", "ts": 0, "dur": 10, "args": {"stream": 7}, "name": "gemm"},
        ...       {"cat": "kernel", "ts": 5, "dur": 4, "args": {"stream": 20}, "name": "copy"}]
        >>> s = stream_overlap(ev)
        >>> s["compute_stream"], s["side"]["20"]["overlap_ms"]
        ('7', 0.004)
    """
    spans: dict[str, list[tuple[float, float]]] = {}
    names: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES or "dur" not in e:
            continue
        args = e.get("args") or {}
        stream = str(args.get("stream", e.get("tid")))
        start = float(e["ts"])
        spans.setdefault(stream, []).append((start, start + float(e["dur"])))
        counts = names.setdefault(stream, {})
        counts[e.get("name", "?")] = counts.get(e.get("name", "?"), 0) + 1
    if not spans:
        return {"compute_stream": None, "compute_ms": 0.0, "side": {}}
    merged = {s: _merge(v) for s, v in spans.items()}
    compute = max(merged, key=lambda s: _length(merged[s]))
    side = {}
    for s, m in merged.items():
        if s == compute:
            continue
        busy = _length(m)
        both = _intersection(m, merged[compute])
        top = sorted(names[s].items(), key=lambda kv: -kv[1])[:3]
        side[s] = {
            "busy_ms": busy / 1e3,  # trace times are microseconds
            "overlap_ms": both / 1e3,
            "overlap_share": both / busy if busy else 0.0,
            "events": len(spans[s]),
            "names": [n for n, _ in top],
        }
    return {"compute_stream": compute, "compute_ms": _length(merged[compute]) / 1e3, "side": side}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path)
        print(json.dumps(stream_overlap(load_trace(path)), indent=1))
