"""Timing, memory and cross-rank helpers for ``bench/step.py``, plus the result table.

* Step time: wall clock of one step, the device synchronised before and after, the ranks aligned by a
  barrier first (untimed); across ranks the slowest rank's time counts (a step ends for everyone when
  its last collective does).
* Peak memory: one separate, untimed step per variant. CPU: ``torch.distributed._tools.mem_tracker
  .MemTracker`` with the variant's resident tensors (parameters or shards, optimizer state) and the batch
  registered as external, so the peak is resident state + everything the step allocates. CUDA: the same
  resident bytes + ``max_memory_allocated() - memory_allocated()`` around the step (every variant lives
  on the same GPU, so the raw allocator peak would count the other variants too).
* Collective time: the variant's logged collectives replayed with fresh buffers, back to back.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from bench_variants import Coll, Variant

__all__ = ["sync", "barrier", "close_process_group", "write_cases", "timed_step", "thread_cpu", "peak_step", "timed_replay", "storage_bytes", "reduce_max", "reduce_mean", "format_table"]

MiB = 2**20


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(world: int) -> None:
    """Align the ranks (untimed) so that one rank's lag does not land in the next variant's time."""
    if world > 1:
        dist.barrier()


def timed_step(v: Variant, x: torch.Tensor, y: torch.Tensor, world: int) -> tuple[float, float, torch.Tensor, dict[str, float]]:
    """``(seconds, cpu seconds, loss, cpu seconds by thread)`` of one training step of ``v``. The CPU
    time is this process's, every thread included (compute, gloo's, the kernel's socket copies charged
    to them): when it is close to the wall time, the rank's core is the bound and overlap cannot
    shorten the step. By thread (``thread_cpu``): ``main`` (Python: compute, hooks, launching
    collectives), ``gloo`` (gloo's transport threads: moving the bytes), ``other``."""
    barrier(world)
    sync(v.device)
    th0 = thread_cpu()
    c0 = _cpu()
    t0 = time.perf_counter()
    loss = v.step(x, y)
    sync(v.device)
    t1, c1 = time.perf_counter(), _cpu()
    th1 = thread_cpu()
    by: dict[str, float] = {}
    for key, sec in th1.items():
        by[key[0]] = by.get(key[0], 0.0) + sec - th0.get(key, 0.0)
    return t1 - t0, c1 - c0, loss, by


def _cpu() -> float:
    return time.process_time()  # every thread of the process, user + system


def thread_cpu() -> dict[tuple[str, int], float]:
    """CPU seconds each thread of this process has run, keyed ``(kind, tid)`` with kind ``main``,
    ``gloo`` (threads named ``gloo*``/``pt_gloo*``) or ``other`` (Linux ``/proc``; empty elsewhere)."""
    out: dict[tuple[str, int], float] = {}
    main = threading.main_thread().native_id
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended, or no schedstat
        kind = "main" if int(tid) == main else "gloo" if name.startswith(("gloo", "pt_gloo")) else "other"
        out[(kind, int(tid))] = ns / 1e9
    return out


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a ``DTensor`` counts its local shard)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        st = local.untyped_storage()
        if st.nbytes():
            seen[(str(local.device), st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def peak_step(v: Variant, x: torch.Tensor, y: torch.Tensor, world: int) -> tuple[torch.Tensor, list[Coll], float, dict[str, float]]:
    """One recorded training step of ``v``: ``(loss, collective log, peak MiB, breakdown)``.

    ``breakdown`` (CPU only) is ``MemTracker``'s peak snapshot by category, in MiB."""
    barrier(world)
    if v.device.type == "cuda":
        sync(v.device)
        resident = storage_bytes(v.resident())
        before = torch.cuda.memory_allocated(v.device)
        torch.cuda.reset_peak_memory_stats(v.device)
        loss, log = v.record(x, y)
        sync(v.device)
        peak = resident + torch.cuda.max_memory_allocated(v.device) - before
        return loss, log, peak / MiB, {}
    if v.compiled or v.profile_peak:  # compiled code allocates below the dispatcher
        return profiled_peak(v, x, y)
    mt = _tracker()
    mt.track_external(*v.resident(), x, y)
    with mt, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        loss, log = v.record(x, y)
    snap = mt.get_tracker_snapshot("peak")
    dev = max(snap.values(), key=lambda d: d.get("Total", 0), default={})
    breakdown = {str(getattr(k, "value", k)): b / MiB for k, b in dev.items() if b}
    return loss, log, dev.get("Total", 0) / MiB, breakdown


def profiled_peak(v: Variant, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[Coll], float, dict[str, float]]:
    """A recorded step whose peak is read from the CPU allocator's own events (``torch.profiler`` with
    ``profile_memory``): compiled kernels' buffers included, which ``MemTracker`` (a dispatch mode, which
    ``torch.compile`` also refuses to trace under) cannot see. Peak = the bytes resident before the step
    (``resident()``, the batch) + the highest running total of the step's allocations and frees.

    The profiler records only the main thread: a buffer freed on gloo's thread (when a collective that
    held it completes) has no free event. Such a block is taken as freed when its address is handed
    out again; until then it counts as live, so the peak is an upper bound (most for fsdpfn's eager
    core, which frees send buffers on gloo's thread; torch's CPU FSDP2 frees on the main thread)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    base = storage_bytes([*v.resident(), x, y])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, log = v.record(x, y)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size))
        stack.extend(e.children)
    live: dict[int, int] = {}
    total = high = 0
    for _, ptr, n in sorted(events):
        if n > 0:
            total += n - live.pop(ptr, 0)  # an address handed out again was freed unseen
            live[ptr] = n
        else:
            live.pop(ptr, None)
            total += n
        high = max(high, total)
    return loss, log, (base + high) / MiB, {}


def _tracker() -> Any:
    """``MemTracker`` without gradient hooks (see ``fsdpfn.testing.memory.memory_tracker``), every variant alike."""
    from fsdpfn.testing.memory import memory_tracker

    return memory_tracker()


def timed_replay(v: Variant, log: list[Coll], world: int) -> tuple[float, float]:
    """Wall seconds and process CPU seconds (every thread: gloo's, the kernel's socket copies) to issue
    and finish ``log`` once (fresh buffers, back to back, no compute)."""
    barrier(world)
    sync(v.device)
    t0, c0 = time.perf_counter(), _cpu()
    v.replay(log)
    sync(v.device)
    return time.perf_counter() - t0, _cpu() - c0


def _all_reduce(values: list[float], op: Any, world: int) -> list[float]:
    if world == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def reduce_max(values: list[float], world: int) -> list[float]:
    """Element-wise maximum over the ranks (CPU tensor: gloo, also under ``cpu:gloo,cuda:nccl``)."""
    return _all_reduce(values, dist.ReduceOp.MAX, world)


def reduce_mean(values: list[float], world: int) -> list[float]:
    """Element-wise mean over the ranks."""
    return [v / world for v in _all_reduce(values, dist.ReduceOp.SUM, world)]


def summarize(times: list[float]) -> dict[str, Any]:
    """Median, min, max (and every sample) of a list of seconds."""
    return {"step_s": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times), "step_s_all": times}


def add_ratios(variants: dict[str, dict[str, Any]], sharded: tuple[str, ...], cores_per_rank: float = 0.0) -> None:
    """``step_vs_torch``, ``peak_vs_torch``, ``step_vs_floor`` and (CPU, given ``cores_per_rank``)
    ``step_vs_cpu_floor`` for every measured sharded variant.
    Compiled variants (``*_compiled``, ``*_traced*``) are compared with ``torch_compiled``: torch's
    ``fully_shard`` with compiled blocks, measured the same way."""
    local = variants.get("local", {})
    for name in sharded:
        r = variants.get(name)
        if not r or "skipped" in r:
            continue
        compiled = name.endswith(("_compiled", "_traced")) or "_traced_" in name
        torch_v = variants.get("torch_compiled" if compiled else "torch", {})
        if "step_s" in torch_v:
            r["step_vs_torch"] = r["step_s"] / torch_v["step_s"]
            r["peak_vs_torch"] = r["peak_mib"] / torch_v["peak_mib"] if torch_v["peak_mib"] else None
        if "step_s" in local:
            floor = max(local["step_s"], r.get("comm_s", 0.0))
            r["step_floor_s"] = floor
            r["step_vs_floor"] = r["step_s"] / floor
            if "cpu_s" in local and "comm_cpu_s" in r and cores_per_rank:
                # The work itself: a rank's compute and its communication both take CPU time (gloo copies
                # bytes on the CPU); on ``cores_per_rank`` cores they can overlap no further than this.
                # Compute is local's forward and backward plus the variant's own optimizer update (on its
                # shards, with its kernel), where both were timed; else local's whole step.
                compute = local["cpu_s"]
                if local.get("opt_cpu_s") is not None and r.get("opt_cpu_s") is not None:
                    compute = local["cpu_s"] - local["opt_cpu_s"] + r["opt_cpu_s"]
                r["cpu_floor_compute_s"] = compute
                cpu_floor = max(floor, (compute + r["comm_cpu_s"]) / cores_per_rank)
                r["cpu_floor_s"] = cpu_floor
                r["step_vs_cpu_floor"] = r["step_s"] / cpu_floor


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _by_thread(r: dict[str, Any]) -> str:
    by = r.get("cpu_by_thread_s")
    return f"{by['main'] * 1e3:.0f} / {by['gloo'] * 1e3:.0f}" if by else "-"


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    head = (f"model {result['model']} ({result['params'] / 1e6:.2f}M params, batch {result['batch_per_rank']}/rank, "
            f"{result['dtype']}), world {result['world']}, {result['device']}, torch {result['torch_version']}, "
            f"{result['steps']} measured steps after {result['warmup']} warm-up")
    cols = f"{'variant':<19} {'step ms median [min-max]':>28} {'cpu ms':>7} {'peak MiB':>9} {'comm ms':>8} {'comm cpu':>8} {'step/torch':>10} {'peak/torch':>10} {'step/floor':>10} {'step/cpufl':>10} {'main/gloo cpu':>13}  final loss"
    lines = [head, cols, "-" * len(cols)]
    for name, r in result["variants"].items():
        if "skipped" in r:
            lines.append(f"{name:<19} skipped: {r['skipped']}")
            continue
        step = f"{r['step_s'] * 1e3:.2f} [{r['step_s_min'] * 1e3:.2f}-{r['step_s_max'] * 1e3:.2f}]"
        comm = r.get("comm_s")
        lines.append(
            f"{name:<19} {step:>28} {_fmt(r['cpu_s'] * 1e3 if 'cpu_s' in r else None, '7.1f'):>7} {r['peak_mib']:>9.1f} "
            f"{_fmt(comm * 1e3 if comm is not None else None, '8.2f'):>8} "
            f"{_fmt(r['comm_cpu_s'] * 1e3 if 'comm_cpu_s' in r else None, '8.2f'):>8} "
            f"{_fmt(r.get('step_vs_torch'), '10.3f'):>10} {_fmt(r.get('peak_vs_torch'), '10.3f'):>10} "
            f"{_fmt(r.get('step_vs_floor'), '10.3f'):>10} {_fmt(r.get('step_vs_cpu_floor'), '10.3f'):>10} {_by_thread(r):>13}  {r['final_loss']:.6g}"
        )
    return "\n".join(lines)


def write_cases(path: str, world: int, args: Any, results: list[dict[str, Any]]) -> None:
    """The JSON record of a benchmark that measures cases (``pipeline_step.py``, ``recipe_step.py``)."""
    with open(path, "w") as f:
        json.dump(dict(world=world, torch_version=torch.__version__, args=vars(args), results=results), f, indent=1)


def close_process_group() -> None:
    """Destroy the default process group once the benchmark's models are gone: a model still alive then,
    in a reference cycle freed only at interpreter exit, can make a rank abort ("terminate called without
    an active exception"; torch's ``fully_shard`` alike), so the cycles are collected first."""
    gc.collect()
    dist.destroy_process_group()
