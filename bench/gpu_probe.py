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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _probes(rank: int) -> dict[str, Any]:
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

    out: dict[str, Any] = {}
    for fn in (all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_gather_list, all_to_all_single, send_recv, broadcast):
        try:
            out[fn.__name__] = "ok" if fn() else "wrong"
        except Exception as e:  # the point of the probe: which ones the backend refuses, and how
            out[fn.__name__] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        dist.barrier()
    return out


def _worker(rank: int, init: str, queue: Any) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        result = _probes(rank)
    finally:
        dist.destroy_process_group()
    queue.put((rank, result))


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
        results = dict(queue.get(timeout=300) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    summary = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backend": "gloo", "world": WORLD,
               "collectives": {k: results[0][k] if results[0][k] == results[1][k] else f"rank0 {results[0][k]} / rank1 {results[1][k]}" for k in results[0]}}
    for name, verdict in summary["collectives"].items():
        print(f"{name:24s} {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
