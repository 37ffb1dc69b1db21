"""Does torch alone keep Python frames (and the tensors in them) alive under compute-sanitizer?

    python3 bench/cuda_frames.py plain; compute-sanitizer --tool memcheck python3 bench/cuda_frames.py memcheck
"""
import gc
import sys
import types

import torch


def init(n):
    w = torch.empty(n, device="cuda")
    torch.nn.init.uniform_(w)
    return float(w.sum())


def copy(n):
    a = torch.ones(8, n, device="cuda")
    b = torch.empty(8, n, device="cuda")
    b.copy_(a)
    return float(b[0, 0])


for name, fn in (("init", init), ("copy", copy)):
    for _ in range(4):
        fn(1 << 20)
    torch.cuda.synchronize()
    gc.collect()
    frames = [o for o in gc.get_objects() if isinstance(o, types.FrameType) and o.f_code.co_name in ("init", "copy", "uniform_", "_no_grad_uniform_")]
    print(sys.argv[1], name, "allocated", torch.cuda.memory_allocated(), "dead frames alive", len(frames), [f.f_code.co_name for f in frames][:6], flush=True)
