"""Resident device bytes per step of ``tests/scripts/cuda_checks.py``'s ``fake_step_memory`` loop, with a census.

Why it exists: on the H100 (2026-11-26) that check passed plainly but, under ``compute-sanitizer --tool
memcheck`` (0 errors reported), the resident bytes after each step grew by ~189 MiB
(278701056, 476551168, 674401280, 872251392). This probe says where such bytes sit: held by Python objects
(``py-live``, a census of live tensors' storages) or only by the caching allocator (block states of
``torch.cuda.memory_snapshot()``: ``active_pending_free`` means freed but waiting for a stream's event), and
which groups the plan chose. Rank 0 of torch's fake process group (world 8), as the check runs.

    python3 bench/cuda_resident.py plain auto                                  # on the GPU machine
    compute-sanitizer --tool memcheck python3 bench/cuda_resident.py memcheck auto
    python bench/cuda_resident.py cpu none                                     # CPU: the census only

Arguments: a tag for the printed lines, and ``auto`` or ``none`` (``shard``'s ``min_bucket_bytes``).

Found (H200, 2026-11-27, bench/RESULTS.md): the bytes are held by live Python tensors (``py-live`` grows
with ``allocated``, plainly both stay flat), and those tensors are locals of *finished* Python frames that
torch keeps alive under compute-sanitizer: ``bench/cuda_frames.py`` shows it with torch alone (a function
that calls ``nn.init.uniform_`` on a CUDA tensor leaves its frame and tensor alive after returning, only
under memcheck), and ``bench/cuda_referrers.py`` traces fsdpfn's held tensors to such frames. Not a
lifetime of fsdpfn's.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdpfn
from fsdpfn.layout.plan import FORWARD_SPANS_MEMO, FUSED

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def census() -> str:
    """Bytes of the storages live Python tensors hold, and the caching allocator's bytes per block state."""
    live: dict[int, tuple[int, tuple[int, ...], str]] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == DEVICE:
            s = o.untyped_storage()
            live[s.data_ptr()] = (s.nbytes(), tuple(o.shape), str(o.dtype).replace("torch.", ""))
    states: dict[str, int] = {}
    for segment in torch.cuda.memory_snapshot() if CUDA else ():
        for block in segment["blocks"]:
            states[block["state"]] = states.get(block["state"], 0) + block["size"]
    top = sorted(live.values(), key=lambda v: -v[0])[:3]
    return f"py-live {sum(v[0] for v in live.values())} in {len(live)} | blocks {states} | largest {top}"


def fake_world_model(bucket: str = "auto") -> tuple[torch.nn.Module, fsdpfn.Sharded]:
    """Rank 0 of torch's fake process group (world 8) and ``fake_step_memory``'s model, sharded one
    ``Linear`` a unit (``bucket``: ``"auto"`` or ``"none"``, ``shard``'s ``min_bucket_bytes``)."""
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = fsdpfn.init_mesh(device=DEVICE)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    return model, fsdpfn.shard(model, mesh, units=[str(i) for i in range(8)], min_bucket_bytes=None if bucket == "none" else "auto")


def main(tag: str, bucket: str) -> None:
    model, params = fake_world_model(bucket)
    x = torch.randn(16, 1024, device=DEVICE)
    print(tag, "after shard", allocated(), flush=True)
    for prefetch in (1, 2):
        apply = fsdpfn.fsdp(model, prefetch=prefetch)
        g = fsdpfn.value_and_grad(lambda p, x: apply(p, x).square().mean())
        opt = fsdpfn.optim.adamw(lr=1e-3)
        state = opt.init(params)
        for step in range(4):
            _, grads = g(params, x)
            params, state = opt.update(grads, state, params)
            del grads
            if CUDA:
                torch.cuda.synchronize()
            print(tag, f"prefetch {prefetch} step {step}: allocated {allocated()}", census(), flush=True)
        plan = params.plan
        groups = [len(g.name.split(FUSED)) for g in plan.groups if g.name]
        print(tag, "link", plan.comm._link_cost, "groups", groups, "spans", plan.memo.get(FORWARD_SPANS_MEMO), flush=True)
    gc.collect()
    print(tag, "after gc.collect", allocated(), census(), flush=True)


if __name__ == "__main__":
    main(*(sys.argv[1:3] if len(sys.argv) >= 3 else ("cpu", "auto")))
