"""Who holds the CUDA tensors that stay live under compute-sanitizer (bench/cuda_resident.py's growth).

    python3 bench/cuda_referrers.py plain
    compute-sanitizer --tool memcheck python3 bench/cuda_referrers.py memcheck

The same fake world and model as ``bench/cuda_resident.py`` (``fake_world_model``).
"""
from __future__ import annotations

import gc
import sys
import types

import torch
from cuda_resident import CUDA, DEVICE, allocated, fake_world_model

import fsdpfn


def describe(o) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} {o.f_code.co_filename.split('/')[-2:]}:{o.f_lineno}"
    if isinstance(o, dict):
        return f"dict keys {[str(k)[:40] for k in list(o)[:6]]}"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__} len {len(o)}"
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__} ({o.__module__})"
    if isinstance(o, types.MethodType):
        return f"method {o.__func__.__qualname__}"
    if isinstance(o, types.TracebackType):
        return f"traceback {o.tb_frame.f_code.co_name}:{o.tb_lineno}"
    if isinstance(o, BaseException):
        return f"exception {type(o).__name__}: {str(o)[:120]}"
    if isinstance(o, torch.Tensor):
        return f"tensor {tuple(o.shape)} {o.dtype} {o.device}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def chain(obj, ignore: set, depth: int = 0, seen=None, width: int = 3) -> None:
    seen = seen if seen is not None else set()
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    found = gc.get_referrers(obj)
    ignore.add(id(found))
    refs = [r for r in found if id(r) not in ignore and type(r).__name__ != "list_iterator"
            and not (isinstance(r, types.FrameType) and r.f_code.co_filename == __file__)]
    ignore.add(id(refs))
    del found
    for i in range(min(width, len(refs))):
        r = refs[i]
        print("  " * (depth + 1) + describe(r), flush=True)
        if not isinstance(r, (types.ModuleType, type)):
            chain(r, ignore, depth + 1, seen, width)
    if len(refs) > width:
        print("  " * (depth + 1) + f"... {len(refs) - width} more", flush=True)


def report(tag: str, when: str) -> None:
    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == DEVICE]
    live.sort(key=lambda t: -t.untyped_storage().nbytes())
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}.values())
    print(f"{tag} {when}: allocated {allocated()} live {total} in {len(live)}; exc {sys.exc_info()[0]}", flush=True)
    top = live[:2]
    ignore = {id(live), id(top)}
    for i in range(len(top)):
        t = top[i]
        print(f"{tag} {when}: HOLDERS OF {describe(t)} ptr {t.untyped_storage().data_ptr()}", flush=True)
        chain(t, ignore)
    del live, top, t


def main(tag: str) -> None:
    model, params = fake_world_model()
    report(tag, "after shard")
    x = torch.randn(16, 1024, device=DEVICE)
    apply = fsdpfn.fsdp(model, prefetch=1)
    g = fsdpfn.value_and_grad(lambda p, x: apply(p, x).square().mean())
    opt = fsdpfn.optim.adamw(lr=1e-3)
    state = opt.init(params)
    for step in range(2):
        _, grads = g(params, x)
        params, state = opt.update(grads, state, params)
        del grads
        if CUDA:
            torch.cuda.synchronize()
    report(tag, "after 2 steps")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
