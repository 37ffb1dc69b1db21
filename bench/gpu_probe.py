"""Which real multi-rank collectives one GPU can run: gloo on CUDA tensors, two processes, one device.

NCCL refuses two ranks on one GPU, so a one-GPU machine checks multi-rank data correctness on CUDA tensors
only through whatever gloo implements for them. This probe tries every collective fsdpfn's core uses, at
world 2 on device 0, and prints one line each (``ok``, ``wrong`` or the error), plus a JSON summary.

    python3 bench/gpu_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
PROBES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather_list", "all_to_all_single", "send_recv", "broadcast")


def _probes(rank: int, queue: Any) -> None:
    dev = torch.device("cuda", 0)
    mine = torch.full((4,), float(rank + 1), device=dev)

    def all_gather_into_tensor():
        out = torch.empty(WORLD * 4, device=dev)
        dist.all_gather_into_tensor(out, mine)
        return torch.equal(out.cpu(), torch.tensor([1.0] * 4 + [2.0] * 4))

    def reduce_scatter_tensor():
        out = torch.empty(2, device=dev)
        dist.reduce_scatter_tensor(out, mine)
        return torch.equal(out.cpu(), torch.full((2,), 3.0))

    def all_reduce():
        t = mine.clone()
        dist.all_reduce(t)
        return torch.equal(t.cpu(), torch.full((4,), 3.0))

    def all_gather_list():
        outs = [torch.empty(4, device=dev) for _ in range(WORLD)]
        dist.all_gather(outs, mine)
        return all(torch.equal(o.cpu(), torch.full((4,), float(i + 1))) for i, o in enumerate(outs))

    def all_to_all_single():
        out = torch.empty(4, device=dev)
        dist.all_to_all_single(out, mine)
        return torch.equal(out.cpu(), torch.tensor([1.0, 1.0, 2.0, 2.0]))

    def send_recv():
        peer = 1 - rank
        got = torch.empty(4, device=dev)
        works = [dist.irecv(got, peer), dist.isend(mine, peer)]
        for w in works:
            w.wait()
        return torch.equal(got.cpu(), torch.full((4,), float(peer + 1)))

    def broadcast():
        t = mine.clone()
        dist.broadcast(t, 0)
        return torch.equal(t.cpu(), torch.full((4,), 1.0))

    # each verdict is sent as soon as it is known: a collective that breaks the gloo pair (torch 2.11 on an
    # H200: a 'Bad address' writev) leaves the verdicts before it, and later ones name the broken pair
    probes = (all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_gather_list, all_to_all_single, send_recv, broadcast)
    assert [fn.__name__ for fn in probes] == list(PROBES)
    for fn in probes:
        try:
            verdict = "ok" if fn() else "wrong"
        except Exception as e:  # the point of the probe: which ones the backend refuses, and how
            verdict = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        queue.put((rank, fn.__name__, verdict))


def _worker(rank: int, init: str, queue: Any) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        _probes(rank, queue)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_probe.py: no GPU is visible", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, init, queue)) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        results: dict[int, dict[str, str]] = {0: {}, 1: {}}
        # A collective can kill a rank's process (torch 2.11: gloo's 'Bad address' writev aborts it): stop
        # waiting once a rank is dead and the queue is quiet, instead of waiting out every missing verdict.
        deadline = time.monotonic() + 45
        while sum(map(len, results.values())) < WORLD * len(PROBES) and time.monotonic() < deadline:
            try:
                rank, name, verdict = queue.get(timeout=1)
                results[rank][name] = verdict
            except Exception:  # queue.Empty
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    break
        killed = set()
        for rank, proc in enumerate(procs):
            proc.join(timeout=10)
            if proc.is_alive():  # blocked in a collective with a dead peer
                proc.kill()
                proc.join()
                killed.add(rank)
    for rank, proc in enumerate(procs):
        missing = [name for name in PROBES if name not in results[rank]]
        if missing and proc.exitcode not in (None, 0):  # verdicts come in order: the first missing one stopped it
            why = "hung (killed)" if rank in killed else f"crashed the process (exit code {proc.exitcode})"
            results[rank][missing[0]] = why
    names = [name for name in PROBES if name in results[0] or name in results[1]]
    verdicts = {k: (results[0].get(k, "not run"), results[1].get(k, "not run")) for k in names}
    summary = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backend": "gloo", "world": WORLD,
               "collectives": {k: a if a == b else f"rank0 {a} / rank1 {b}" for k, (a, b) in verdicts.items()}}
    for name, verdict in summary["collectives"].items():
        print(f"{name:24s} {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
