"""One unit mixing fp32, bf16 and complex64 parameters and an int buffer: one bucket per dtype, and it
trains to the single-process result (FSDP2 rejects such a unit)."""

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd

STEPS = 4
# The bf16 weight's gradient is summed over ranks in bf16 (its own dtype), so it may differ from the
# single-process one by a bf16 rounding step; the fp32 and complex parameters train through that weight,
# so after a few steps they inherit a bf16-sized relative difference, well above fp32 rounding (up to
# half a bf16 ulp, 4e-3: world 3, seed 125 reaches 3.5e-3), and on an element far smaller than the others
# a bf16-sized difference of theirs (world 3, seed 104: 5.4e-4 on 0.037)
TOL = {
    torch.float32: dict(rtol=8e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.complex64: dict(rtol=8e-3, atol=1e-3),
}


class Mixed(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Parameter(torch.randn(4, 3, generator=g))  # fp32 "router"
        self.w = nn.Parameter(torch.randn(3, 5, generator=g).bfloat16())  # bf16 matmul weight
        self.c = nn.Parameter(torch.randn(5, generator=g, dtype=torch.complex64))  # complex
        self.register_buffer("steps", torch.tensor(0))  # int buffer

    def forward(self, x):
        h = (x @ self.router).bfloat16() @ self.w
        z = h.float() * self.c
        return (z.real + z.imag).sum(-1) + self.steps


def _batch(world, step):
    g = torch.Generator().manual_seed(step)
    return 0.3 * torch.randn(2 * world, 4, generator=g), torch.randn(2 * world, generator=g)


def _worker(seed):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = Mixed(seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh())
    apply = fsdpfn.fsdp(model)
    opt = fsdpfn.optim.sgd(lr=0.002, momentum=0.9)
    state = opt.init(params)
    for step in range(STEPS):
        x, y = _batch(world, step)
        loss, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]))(params)
        params, state = opt.update(grads, state, params)
    (unit,) = params.plan.units
    return dict(params.params()), sorted(str(b.dtype) for b in unit.gather), sorted(str(b.dtype) for b in unit.reduce)


@settings(max_examples=12)
@given(world=st.integers(1, 4), seed=st.integers(0, 1000))
@example(world=3, seed=104)  # (see TOL)
def test_mixed_dtype_unit_trains_to_the_single_process_result(world, seed):
    ref = Mixed(seed)
    opt = torch.optim.SGD(ref.parameters(), lr=0.002, momentum=0.9, foreach=True)
    for step in range(STEPS):
        x, y = _batch(world, step)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    out = spmd(world, _worker, seed)
    for shards, gathers, reduces in out:
        assert gathers == ["torch.bfloat16", "torch.complex64", "torch.float32"]  # one bucket per dtype
        assert reduces == gathers
    for name, p in ref.named_parameters():
        spec = fsdpfn.ShardSpec(tuple(p.shape), world)
        got = fsdpfn.unshard_tensors([o[0][name] for o in out], spec)
        assert got.dtype == p.dtype
        torch.testing.assert_close(got, p.detach(), **TOL[p.dtype])
