"""CUDA checks of fsdpfn, each run in a fresh process by tests/test_cuda.py (its own default process group):

    python tests/scripts/cuda_checks.py <check> [<check> ...]     # world-1 checks may share a process

World-1 checks run on NCCL (``fsdpfn.init_mesh(device="cuda")``); ``fake_*`` checks make this process rank 0
of torch's fake process group (collectives move nothing), where streams, events, the caching allocator and
the core's buffer lifetimes are still real. The stream checks put a user all-gather / reduce-scatter
(FSDP2's custom-collective protocol, ``fsdpfn.core.custom``) on the core's side stream and delay one of
the two streams with a spinning kernel, so a missing ``wait_stream`` / ``wait_event`` or a buffer freed
before the side stream read it gives wrong numbers instead of a lucky race.
Exit status 0: the check passed; anything else: it failed (the traceback says how).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn
from fsdpfn.testing import strategies as fst

SPIN = 1 << 29  # cycles of torch.cuda._sleep: a few hundred milliseconds, far longer than any copy here
EXAMPLES = int(os.environ.get("FSDPFN_EXAMPLES", "25"))
# The world-1 checks also run on "cpu" (FSDPFN_CHECK_DEVICE=cpu), to try this script's own logic without a GPU.
DEVICE = os.environ.get("FSDPFN_CHECK_DEVICE", "cuda")


def _world1() -> object:
    return fsdpfn.init_mesh(device=DEVICE)


def _fake(world: int) -> object:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return fsdpfn.init_mesh(device="cuda")


def _targets(out: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(out.shape, generator=g).to(out.device)


# --- correctness at world 1 (NCCL) ------------------------------------------------------------------
def step_world1() -> None:
    """Property: fsdpfn's gradients and SGD update on CUDA equal plain autograd + torch.optim.SGD on
    the same CUDA model (fp32), for random models, unit plans, prefetch and reshard settings."""
    mesh = _world1()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
    @given(data=st.data(), seed=st.integers(0, 99), prefetch=st.integers(0, 2), reshard=st.booleans())
    def prop(data, seed, prefetch, reshard):
        recipe = data.draw(fst.model_recipes(("mlp", "transformer", "recurrent"), min_width=4, min_seq=2))
        units = data.draw(fst.unit_plans(recipe))
        model = recipe.build(torch.float32).to(DEVICE)
        ref = copy.deepcopy(model)
        params = fsdpfn.shard(model, mesh, units=units)
        assert all(t.device.type == DEVICE for t in params.values())
        apply = fsdpfn.fsdp(model, reshard_after_forward=reshard, prefetch=prefetch)
        x = recipe.inputs(4, seed).to(DEVICE)
        y = _targets(ref(x), seed)
        loss, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x), y))(params)
        want = F.mse_loss(ref(x), y)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
        # SGD (linear in the gradient: Adam's first step would amplify rounding noise of near-zero gradients)
        opt = fsdpfn.optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.1)
        new, _ = opt.update(grads, opt.init(params), params)
        torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1).step()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(new[n], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{n} after SGD: {m}")

    prop()


def mixed_precision_world1() -> None:
    """bf16 parameters with fp32 reduction on CUDA give the gradients the same policy gives on CPU (the
    CPU path is checked against single-process autograd by the CPU suite), within bf16 rounding."""
    mesh = _world1()
    cpu_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    policy = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
    @given(data=st.data(), seed=st.integers(0, 99))
    def prop(data, seed):
        recipe = data.draw(fst.model_recipes(min_width=4, min_seq=2))
        units = data.draw(fst.unit_plans(recipe))
        out: dict = {}
        for dev, m in ((DEVICE, mesh), ("cpu", cpu_mesh)):
            model = recipe.build(torch.float32).to(dev)
            params = fsdpfn.shard(model, m, units=units, mp_policy=policy)
            apply = fsdpfn.fsdp(model)
            x = recipe.inputs(4, seed).to(dev)
            with torch.no_grad():
                y = _targets(recipe.build(torch.float32)(recipe.inputs(4, seed)), seed).to(dev)
            loss, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x).float(), y))(params)
            assert all(g.dtype == torch.float32 for g in grads.values()), "reduced gradients keep the fp32 shards' dtype"
            out[dev] = (loss.cpu(), {n: g.cpu() for n, g in grads.items()})
        torch.testing.assert_close(out[DEVICE][0], out["cpu"][0], rtol=2e-2, atol=2e-3)
        for n, g in out["cpu"][1].items():
            torch.testing.assert_close(out[DEVICE][1][n], g, rtol=5e-2, atol=5e-3, msg=lambda m: f"{n}: {m}")

    prop()


def checkpoint_world1() -> None:
    """Activation checkpointing inside units (torch.utils.checkpoint) on CUDA: same gradients as without."""
    from torch.utils.checkpoint import checkpoint

    mesh = _world1()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

        def forward(self, x):
            return x + checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(4)]).to(DEVICE)
    ref = copy.deepcopy(model)
    for reshard in (True, False):
        sharded = copy.deepcopy(model)  # shard donates its weights: the copy's go, model's stay
        params = fsdpfn.shard(sharded, mesh, units=["0", "1", "2", "3"])
        apply = fsdpfn.fsdp(sharded, reshard_after_forward=reshard)
        x = torch.randn(8, 32, device=DEVICE)
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
        ref.zero_grad()
        want = ref(x).square().mean()
        want.backward()
        torch.testing.assert_close(loss, want.detach())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"reshard={reshard} {n}: {m}")


def _train_sharded(model: torch.nn.Module, width: int, steps: int = 4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AdamW steps of a ``fully_shard``ed model (fsdpfn's or torch's) on seeded batches of ``width``
    features: its losses and full weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(8, width, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.full_tensor() for n, p in model.named_parameters()}


def _assert_same_training(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict], bf16: bool) -> None:
    """Two ``_train_sharded`` results equal, within bf16 rounding where the parameters were bf16."""
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], **tol)
    for n, p in want[1].items():
        torch.testing.assert_close(got[1][n], p, **tol, msg=lambda m: f"bf16={bf16} {n}: {m}")


def compat_world1() -> None:
    """fsdpfn.compat.fully_shard and torch's fully_shard train the same model to the same losses and
    weights on CUDA (fp32, then bf16 parameters with fp32 reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdpfn.compat import MixedPrecisionPolicy, fully_shard

    from torch.distributed.device_mesh import init_device_mesh

    _world1()
    mesh = init_device_mesh(DEVICE, (1,))
    for bf16 in (False, True):
        torch.manual_seed(0)
        base = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(3)]).to(DEVICE)
        runs = {}
        for name, shard_fn, mp in (("fsdpfn", fully_shard, MixedPrecisionPolicy), ("torch", torch_fully_shard, TorchMP)):
            model = copy.deepcopy(base)
            kw = {"mp_policy": mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
            kw["mesh"] = mesh  # on DEVICE: the default mesh is CUDA's wherever a GPU is visible
            for block in model:
                shard_fn(block, **kw)
            shard_fn(model, **kw)
            runs[name] = _train_sharded(model, 32)
        _assert_same_training(runs["fsdpfn"], runs["torch"], bf16)


def recurrent_world1() -> None:
    """Recurrent layers as compat units (torch's LSTM and GRU; cuDNN's on a GPU, whose
    ``flatten_parameters`` rewrites the weights it is given in place) train as the unsharded model does, and
    between steps their parameter caches (``_flat_weights``) hold the sharded parameters, no gathered copy."""
    from fsdpfn.compat import fully_shard
    from fsdpfn.testing.models import ModelRecipe

    mesh = _world1()
    recipe = ModelRecipe("recurrent", (6, 3, 8, 5, 7), seed=3, seq=4)
    ref = recipe.build().to(DEVICE)
    model = copy.deepcopy(ref)
    for name in recipe.unit_candidates():
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(3):
        x = recipe.inputs(4, seed=step).to(DEVICE)
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        for m in model.modules():
            if isinstance(m, torch.nn.RNNBase):
                for i, n in enumerate(m._flat_weights_names):
                    assert m._flat_weights[i] is getattr(m, n), f"step {step}: {n}'s cache is not the sharded parameter"
    for n, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(n).full_tensor(), p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


class _MoEBlock(torch.nn.Module):
    """torchtitan's MoE block in small: experts on a mesh of their own, gated."""

    def __init__(self, width: int):
        super().__init__()
        self.attn = torch.nn.Linear(width, width)
        self.experts = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Tanh(), torch.nn.Linear(2 * width, width))
        self.gate = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.attn(x))
        return x + self.experts(h) * torch.sigmoid(self.gate(h))


def nested_root_world1() -> None:
    """Experts ``fully_shard``ed on another mesh than their blocks (a nested root, whose gather the enclosing
    block starts by explicit forward prefetch) train on CUDA to torch's ``fully_shard``'s losses and weights
    (fp32, then bf16 parameters with fp32 reduction): the nested root's gather, reduction and reshard on
    the core's side streams."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdpfn.compat import MixedPrecisionPolicy, fully_shard
    from fsdpfn.compat.state import state_of

    _world1()
    blocks_mesh = init_device_mesh(DEVICE, (1,), mesh_dim_names=("dp",))
    experts_mesh = init_device_mesh(DEVICE, (1, 1), mesh_dim_names=("rep", "shard"))
    for bf16 in (False, True):
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(16, 32), *[_MoEBlock(32) for _ in range(3)], torch.nn.Linear(32, 4)).to(DEVICE)
        runs = {}
        for name, shard_fn, mp in (("fsdpfn", fully_shard, MixedPrecisionPolicy), ("torch", torch_fully_shard, TorchMP)):
            model = copy.deepcopy(base)
            kw = {"mp_policy": mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
            blocks = list(model)[1:-1]
            for block in blocks:
                shard_fn(block.experts, mesh=experts_mesh, **kw)
                shard_fn(block, mesh=blocks_mesh, **kw)
            shard_fn(model, mesh=blocks_mesh, **kw)
            for block, nxt in zip(blocks, blocks[1:]):  # torchtitan's lists under EP: the next block and its experts
                block.set_modules_to_forward_prefetch([nxt, nxt.experts])
            runs[name] = _train_sharded(model, 16)
            if name == "fsdpfn":
                assert state_of(blocks[0].experts).root is not state_of(model).root, "the experts root no plan"
        _assert_same_training(runs["fsdpfn"], runs["torch"], bf16)


def compiled_blocks_world1() -> None:
    """Blocks compiled with ``fullgraph=True`` before sharding (torchtitan's recipe; inductor's kernels on CUDA)
    train in both layers to the losses and weights of the same layer uncompiled."""
    from fsdpfn.compat import fully_shard

    mesh = _world1()
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # the CPU run checks this script, quickly
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[_MoEBlock(32) for _ in range(3)]).to(DEVICE)

    def functional(compiled: bool) -> tuple[torch.Tensor, dict]:
        model = copy.deepcopy(base)
        if compiled:
            for block in model:
                block.compile(backend=backend, fullgraph=True)
        params = fsdpfn.shard(model, mesh, units=["0", "1", "2"])
        apply = fsdpfn.fsdp(model)
        opt = fsdpfn.optim.adamw(lr=1e-2)
        state = opt.init(params)
        losses = []
        for step in range(3):
            x = torch.randn(8, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
            loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
            params, state = opt.update(grads, state, params)
            losses.append(loss.detach())
        return torch.stack(losses), {k: v.clone() for k, v in params.params().items()}

    def compat(compiled: bool) -> tuple[torch.Tensor, dict]:
        model = copy.deepcopy(base)
        for block in model:
            if compiled:
                block.compile(backend=backend, fullgraph=True)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _train_sharded(model, 32, steps=3)

    for name, train in (("functional", functional), ("compat", compat)):
        torch._dynamo.reset()
        got, want = train(True), train(False)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} losses: {m}")
        for k, v in want[1].items():
            torch.testing.assert_close(got[1][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")


def loss_scale_fp16_world1() -> None:
    """float16 parameters (fp32 reduction) with ``fsdpfn.optim.loss_scale`` on CUDA: while the scaled gradients
    overflow float16 every step is skipped and the scale backs off; the first finite step's unscaled
    gradients equal float32's, within float16 rounding, and its update moves the shards."""
    mesh = _world1()
    policy = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(3)]).to(DEVICE)
    x = torch.randn(16, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    fp32 = copy.deepcopy(base)
    fp32_apply = fsdpfn.fsdp(fp32)
    _, want = fsdpfn.value_and_grad(lambda p: fp32_apply(p, x).square().mean())(fsdpfn.shard(fp32, mesh, units=["0", "1", "2"]))
    want = {k: v.clone() for k, v in want.params().items()}
    model = copy.deepcopy(base)
    params = fsdpfn.shard(model, mesh, units=["0", "1", "2"], mp_policy=policy)
    apply = fsdpfn.fsdp(model)
    loss_fn = lambda p: apply(p, x).float().square().mean()  # noqa: E731
    ls = fsdpfn.optim.loss_scale(2.0**40, growth_interval=1000)  # far past float16's 65504
    ls_state = ls.init()
    opt = fsdpfn.optim.sgd(lr=1e-2)
    opt_state = opt.init(params)
    before = {k: v.clone() for k, v in params.params().items()}
    skipped = 0
    for _ in range(60):
        _, grads = fsdpfn.value_and_grad(lambda p: ls.scale(loss_fn(p), ls_state))(params)
        scale = ls_state.scale
        grads, finite, ls_state = ls.unscale(grads, ls_state)
        if finite:
            break
        skipped += 1
        assert ls_state.scale == scale / 2, (scale, ls_state.scale)
    assert finite and skipped > 0, f"finite={finite} after {skipped} skipped steps (scale {ls_state.scale})"
    for k, g in grads.params().items():
        assert torch.isfinite(g).all(), k
        torch.testing.assert_close(g, want[k], rtol=2e-2, atol=1e-2 * float(want[k].abs().max()), msg=lambda m: f"{k}: {m}")
    params, opt_state = opt.update(grads, opt_state, params)
    still = [k for k, v in params.params().items() if torch.equal(v, before[k])]
    assert not still, f"the finite step left {still} unchanged"
    print(f"loss_scale_fp16_world1: {skipped} overflowing steps skipped, then finite at scale {scale:.3g}")


def _gloo_step_worker(recipe, units, seed, reshard, prefetch):
    """One rank of ``gloo_world2_step``: the functional step on CUDA tensors over a gloo group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    try:  # what the core needs from gloo on CUDA tensors
        probe = torch.ones(2 * world, device=DEVICE)
        dist.all_gather_into_tensor(torch.empty(2 * world, device=DEVICE), probe[:2])
        dist.reduce_scatter_tensor(torch.empty(2, device=DEVICE), probe)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return ("unsupported", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    mesh = torch.distributed.device_mesh.init_device_mesh(DEVICE, (world,))
    model = recipe.build(torch.float32).to(DEVICE)
    params = fsdpfn.shard(model, mesh, units=units)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard, prefetch=prefetch)
    x = recipe.inputs(2 * world, seed).to(DEVICE)
    with torch.no_grad():
        y = _targets(recipe.build(torch.float32)(recipe.inputs(2 * world, seed)), seed).to(DEVICE)
    mine = slice(2 * rank, 2 * rank + 2)
    loss, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x[mine]), y[mine]))(params)
    return ("ran", float(loss), {n: g.cpu() for n, g in grads.items()})


def gloo_world2_step() -> None:
    """Property, real data on two ranks sharing the GPU: gloo on CUDA tensors (NCCL refuses two ranks on
    one device) carries the functional step; each rank's shard gradients equal single-process autograd's
    on the whole batch. Prints ``unsupported`` and exits 3 when this torch's gloo lacks a collective the
    core needs on CUDA tensors (bench/gpu_probe.py lists them)."""
    import cuda_checks  # the workers import the worker by module name, not as __main__

    from fsdpfn.testing import spmd

    @settings(max_examples=max(1, EXAMPLES // 2), deadline=None, derandomize=True)
    @given(data=st.data(), seed=st.integers(0, 99), prefetch=st.integers(0, 2), reshard=st.booleans())
    def prop(data, seed, prefetch, reshard):
        recipe = data.draw(fst.model_recipes(min_width=4, min_seq=2))
        units = data.draw(fst.unit_plans(recipe))
        out = spmd(2, cuda_checks._gloo_step_worker, recipe, units, seed, reshard, prefetch)
        if out[0][0] == "unsupported":
            print(f"gloo_world2_step: unsupported ({out[0][1]})", flush=True)
            sys.exit(3)
        ref = recipe.build(torch.float32)
        x = recipe.inputs(4, seed)
        with torch.no_grad():
            y = _targets(recipe.build(torch.float32)(x), seed)
        F.mse_loss(ref(x), y).backward()
        for rank, (_, _, grads) in enumerate(out):
            for n, p in ref.named_parameters():
                want = fsdpfn.shard_tensor(p.grad, fsdpfn.ShardSpec(tuple(p.shape), 2), rank)
                torch.testing.assert_close(grads[n], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {n}: {m}")

    prop()


# --- stream ordering and buffer lifetimes (fake world: the side streams are real) ---------------------
class _SlowGather:
    """FSDP2's all-gather protocol: every rank's rows become this rank's input (the fake group moves
    nothing), after ``spin`` cycles on the stream it runs on (the core's side stream)."""

    def __init__(self, world: int, spin: int):
        self.world, self.spin = world, spin

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, async_op=False):
        if self.spin:
            torch.cuda._sleep(self.spin)
        output_tensor.view(self.world, -1).copy_(input_tensor.view(1, -1).expand(self.world, -1))


class _SlowReduce:
    """FSDP2's reduce-scatter protocol: this rank's output is the sum of every rank's chunk of the input
    (the whole input is here), after ``spin`` cycles on the side stream."""

    def __init__(self, world: int, spin: int):
        self.world, self.spin = world, spin

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op=False):
        torch.cuda._sleep(self.spin)
        total = input_tensor.view(self.world, -1).sum(0)
        if op == dist.ReduceOp.AVG:
            total /= self.world
        elif op not in (None, dist.ReduceOp.SUM):
            raise NotImplementedError(f"_SlowReduce: reduce op {op}")
        output_tensor.copy_(total)


def _twice(check):
    """Run ``check(comm, spin, value)`` in a fake world of 4, first without the spin, then with it. The first pass
    loads every kernel the check uses: CUDA loads kernels lazily, and loading one waits for the whole
    device, which would order the streams by itself and hide the very race the second pass looks for."""
    from fsdpfn.core.comm import Comm

    comm = Comm(_fake(4))
    for spin, value in ((0, 2.0), (SPIN, 3.0)):  # other values: a block reused from the first pass holds stale 2s
        check(comm, spin, value)


def _gather_waits_for_inputs(comm, spin: int, value: float) -> None:
    from fsdpfn.core.custom import CustomComms

    x = torch.zeros(1 << 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(spin)  # the current stream is busy ...
    x.fill_(value)  # ... so this write is still pending when the gather launches
    out = comm.all_gather(x, custom=CustomComms(all_gather=_SlowGather(comm.groups.world, 0))).wait()
    torch.cuda.synchronize()
    assert torch.all(out == value), f"the gather read its input before the write ordered before it: {out.unique()[:8]}"


def fake_gather_waits_for_inputs() -> None:
    """The side stream starts the all-gather only after the current stream's pending writes to its input."""
    _twice(_gather_waits_for_inputs)


def _result_waits_for_gather(comm, spin: int, value: float) -> None:
    from fsdpfn.core.custom import CustomComms

    x = torch.full((1 << 16,), value, device="cuda")
    torch.cuda.synchronize()
    handle = comm.all_gather(x, custom=CustomComms(all_gather=_SlowGather(comm.groups.world, spin)))
    seen = handle.wait().clone()  # queued on the current stream
    torch.cuda.synchronize()
    assert torch.all(seen == value), f"the current stream read the result before the gather wrote it: {seen.unique()[:8]}"


def fake_result_waits_for_gather() -> None:
    """``Handle.wait()`` orders the current stream after the side stream's collective: a read right after
    it sees the gathered values although the side stream is still spinning when the read is queued."""
    _twice(_result_waits_for_gather)


def _reduce_keeps_its_input(comm, spin: int, value: float) -> None:
    from fsdpfn.core.custom import CustomComms

    world, n = comm.groups.world, 1 << 16
    full = torch.full((world, n), value, device="cuda")
    torch.cuda.synchronize()
    handle = comm.reduce_scatter(full, custom=CustomComms(reduce_scatter=_SlowReduce(world, spin)), scale=1.0)
    del full
    junk = [torch.full((world * n,), 1e6, device="cuda") for _ in range(4)]  # would take a freed block
    out = handle.wait().clone()
    torch.cuda.synchronize()
    del junk
    assert torch.all(out == world * value), f"the reduction read a buffer reused before it was done: {out.unique()[:8]}"


def fake_reduce_keeps_its_input() -> None:
    """The reduction's input lives until the side stream has read it: freeing it at launch would let the
    caching allocator hand its block to the current stream, which overwrites it while the side stream
    still spins (no ``record_stream`` is used; the handle keeps the buffer until ``wait``)."""
    _twice(_reduce_keeps_its_input)


def _bucket(world: int, n: int):
    """A bucket of two fp32 shards gathered in bf16 (the copy-in casts), and those shards on rank 0."""
    from fsdpfn.layout.bucket import BucketLayout

    specs = (fsdpfn.ShardSpec((world * n, 64), world), fsdpfn.ShardSpec((world * n,), world))
    layout = BucketLayout.build(("w", "b"), specs, torch.bfloat16)
    return layout, [torch.zeros(n, 64, device="cuda"), torch.zeros(n, device="cuda")]


def _bucket_pack_waits_for_shards(comm, spin: int, value: float) -> None:
    from fsdpfn.core.custom import CustomComms

    layout, shards = _bucket(comm.groups.world, 1 << 12)
    torch.cuda.synchronize()
    torch.cuda._sleep(spin)  # the current stream is busy ...
    for s in shards:
        s.fill_(value)  # ... so these writes are still pending when the copy-in is queued
    out = comm.gather_bucket(layout, shards, custom=CustomComms(all_gather=_SlowGather(comm.groups.world, 0))).wait()
    torch.cuda.synchronize()
    assert torch.all(out == value), f"the copy-in read the shards before the writes ordered before it: {out.unique()[:8]}"


def fake_bucket_pack_waits_for_shards() -> None:
    """A bucket's copy-in runs on the gather stream (off the compute stream): it starts only after the
    current stream's pending writes to the shards."""
    _twice(_bucket_pack_waits_for_shards)


def _bucket_pack_keeps_its_shards(comm, spin: int, value: float) -> None:
    from fsdpfn.core.custom import CustomComms

    layout, shards = _bucket(comm.groups.world, 1 << 12)
    for s in shards:
        s.fill_(value)
    torch.cuda.synchronize()
    with torch.cuda.stream(comm._stream("gather")):
        torch.cuda._sleep(spin)  # the gather stream is busy, so the copy-in waits behind this
    handle = comm.gather_bucket(layout, shards, custom=CustomComms(all_gather=_SlowGather(comm.groups.world, 0)))
    del shards
    junk = [torch.full((1 << 18,), 1e6, device="cuda") for _ in range(8)]  # would take the freed blocks
    out = handle.wait().clone()
    torch.cuda.synchronize()
    del junk
    assert torch.all(out == value), f"the copy-in read shards freed before it was done: {out.unique()[:8]}"


def fake_bucket_pack_keeps_its_shards() -> None:
    """The shards a bucket's copy-in reads on the gather stream live until it has read them: dropped at
    launch, their blocks go back to the caching allocator, and the current stream overwrites them while
    the gather stream is still busy."""
    _twice(_bucket_pack_keeps_its_shards)


def _flat_gather_waits_for_shards(comm, spin: int, value: float) -> None:
    layout, shards = _bucket(comm.groups.world, 1 << 12)
    want = layout.pack_shards([torch.full_like(s, value) for s in shards], 0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(spin)  # the current stream is busy ...
    for s in shards:
        s.fill_(value)  # ... so these writes are still pending when the copy-in is queued
    out = comm.gather_bucket(layout, shards).wait()  # flat and in place: packed into our row of the result
    torch.cuda.synchronize()
    assert torch.equal(out[0], want), f"the in-place copy-in read the shards before the writes ordered before it: {out[0].unique()[:8]}"


def fake_flat_gather_waits_for_shards() -> None:
    """A flat bucket gather packs the shards straight into our row of its result (in place), on the gather
    stream: it starts only after the current stream's pending writes to the shards (the fake group moves
    nothing, so our row is exactly what was packed)."""
    _twice(_flat_gather_waits_for_shards)


def _span_gather_keeps_its_shards(comm, spin: int, value: float) -> None:
    (lay_a, shards_a), (lay_b, shards_b) = _bucket(comm.groups.world, 1 << 12), _bucket(comm.groups.world, 1 << 11)
    [t.fill_(value) for t in (*shards_a, *shards_b)]  # no loop variable left holding a shard
    want = [lay.pack_shards(ts, 0, device="cuda") for lay, ts in ((lay_a, shards_a), (lay_b, shards_b))]
    torch.cuda.synchronize()
    with torch.cuda.stream(comm._stream("gather")):
        torch.cuda._sleep(spin)  # the gather stream is busy, so the copy-in waits behind this
    parts = comm.gather_buckets([lay_a, lay_b], [shards_a, shards_b])
    del shards_a, shards_b
    junk = [torch.full((1 << 18,), 1e6, device="cuda") for _ in range(8)]  # would take the freed blocks
    got = [p.wait()[0].clone() for p in parts]
    torch.cuda.synchronize()
    del junk
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"a forward span's copy-in read shards freed before it was done: {g.unique()[:8]}"


def fake_span_gather_keeps_its_shards() -> None:
    """A forward span (``Comm.gather_buckets``: several buckets in one in-place gather) keeps every shard
    its copy-in reads on the gather stream until that copy is done."""
    _twice(_span_gather_keeps_its_shards)


def fake_step_memory() -> None:
    """A fake world of 8 on one GPU: after ``shard`` a rank holds an eighth of the parameters; steps with
    prefetch 1 and 2 leave no growing residue (every gathered buffer and reduction input is released)."""
    world = 8
    mesh = _fake(world)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    full = sum(p.numel() * 4 for p in model.parameters())
    before = torch.cuda.memory_allocated()
    params = fsdpfn.shard(model, mesh, units=[str(i) for i in range(8)])
    held = torch.cuda.memory_allocated() - before
    assert held <= full / world * 1.05 + (1 << 20), f"{held} bytes resident after shard; an eighth of the model is {full // world}"
    x = torch.randn(16, 1024, device="cuda")
    for prefetch in (1, 2):
        apply = fsdpfn.fsdp(model, prefetch=prefetch)
        g = fsdpfn.value_and_grad(lambda p, x: apply(p, x).square().mean())
        opt = fsdpfn.optim.adamw(lr=1e-3)
        state = opt.init(params)
        resident = []
        for _ in range(4):
            _, grads = g(params, x)
            params, state = opt.update(grads, state, params)
            del grads
            torch.cuda.synchronize()
            resident.append(torch.cuda.memory_allocated())
        assert resident[-1] == resident[1], f"prefetch={prefetch}: resident bytes grow step to step: {resident}"
        print(f"fake_step_memory: prefetch={prefetch} resident bytes after each step {resident}")


def _every_op(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE


def fake_parked_memory() -> None:
    """A fake world of 4 on one GPU, compat, blocks under a selective checkpoint that saves every op (its
    cache holds views of each unit's gathered weights until the recompute): after the forward the gathered
    buffers are parked (``fsdpfn/transform/parked.py``: storage resized to zero bytes on CUDA), so the
    forward leaves what an unchecked forward leaves, not a unit's buffer more; the backward refills them
    (a copy on the current stream) and steps leave no growing residue."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import fsdpfn.compat as compat

    mesh = _fake(4)
    width, count = 1024, 4
    unit = 2 * (width * width + width) * 4  # one block's gathered bytes (two Linears, fp32)

    def build(checkpointed: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)) for _ in range(count)]
        if checkpointed:
            context = functools.partial(create_selective_checkpoint_contexts, _every_op)
            blocks = [checkpoint_wrapper(b, context_fn=context) for b in blocks]
        model = torch.nn.Sequential(*blocks).cuda()
        for b in model:
            compat.fully_shard(b, mesh=mesh)
        compat.fully_shard(model, mesh=mesh)
        model.set_min_bucket_bytes(None)  # one group per block, none kept gathered
        return model

    x = torch.randn(2, width, device="cuda")  # activations are bytes; the blocks are MiB
    after_forward, resident = {}, {}
    for checkpointed in (False, True):
        model = build(checkpointed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps = []
        for _ in range(3):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = model(x).square().mean()
            torch.cuda.synchronize()
            after_forward[checkpointed] = torch.cuda.memory_allocated() - before
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            steps.append(torch.cuda.memory_allocated())
        assert steps[-1] == steps[1], f"checkpointed={checkpointed}: resident bytes grow step to step: {steps}"
        resident[checkpointed] = steps[-1]
        del model, opt
    extra = after_forward[True] - after_forward[False]
    assert extra < unit, f"the checkpointed forward holds {extra} bytes more than the plain one: gathered buffers not parked (a unit is {unit})"
    print(f"fake_parked_memory: after forward {after_forward}, resident after steps {resident}")


CHECKS = {f.__name__: f for f in (
    step_world1, mixed_precision_world1, checkpoint_world1, compat_world1, gloo_world2_step,
    nested_root_world1, compiled_blocks_world1, loss_scale_fp16_world1, recurrent_world1,
    fake_gather_waits_for_inputs, fake_result_waits_for_gather, fake_reduce_keeps_its_input,
    fake_bucket_pack_waits_for_shards, fake_bucket_pack_keeps_its_shards, fake_flat_gather_waits_for_shards,
    fake_span_gather_keeps_its_shards, fake_step_memory, fake_parked_memory,
)}  # fmt: skip


# --- mutants: each stream check must fail when the ordering it checks is taken out of the core ---------
def _no_wait_stream() -> None:
    """The side stream no longer waits for the current stream before a collective."""
    torch.cuda.Stream.wait_stream = lambda self, other: None


def _no_wait_event() -> None:
    """``Handle.wait()`` no longer orders the current stream after the collective's event."""
    torch.cuda.Stream.wait_event = lambda self, event: None


def _inputs_dropped_at_launch() -> None:
    """A handle no longer keeps the collective's input alive until ``wait()``."""
    from fsdpfn.core import handle

    init = handle.Handle.__init__

    def without_keep(self, result, **kw):
        kw["keep"] = ()
        init(self, result, **kw)

    handle.Handle.__init__ = without_keep


def _shards_dropped_at_launch() -> None:
    """A bucket's handle no longer keeps the shards its copy-in reads on the gather stream."""
    from fsdpfn.core import handle

    handle.Handle.keep_also = lambda self, tensors: None


# check -> the mutation it must catch (run by tests/test_cuda.py with FSDPFN_MUTANT=<check>)
MUTANTS = {
    "fake_gather_waits_for_inputs": _no_wait_stream,
    "fake_result_waits_for_gather": _no_wait_event,
    "fake_reduce_keeps_its_input": _inputs_dropped_at_launch,
    "fake_bucket_pack_waits_for_shards": _no_wait_stream,
    "fake_bucket_pack_keeps_its_shards": _shards_dropped_at_launch,
    "fake_flat_gather_waits_for_shards": _no_wait_stream,
    "fake_span_gather_keeps_its_shards": _inputs_dropped_at_launch,
}


def main(names: list[str]) -> None:
    """Run the checks called ``names`` in order (``SystemExit`` with the usage for a bad list). With
    ``FSDPFN_MUTANT=<check>`` the core first loses the ordering that check guards (``MUTANTS``): the check
    must then fail, which is what shows it would catch the bug."""
    if not names or any(n not in CHECKS for n in names):
        sys.exit(f"usage: cuda_checks.py <check> [<check> ...]; checks: {', '.join(CHECKS)}")
    mutant = os.environ.get("FSDPFN_MUTANT")
    if mutant:
        if mutant not in MUTANTS or names != [mutant]:
            sys.exit(f"cuda_checks.py: FSDPFN_MUTANT names one of {', '.join(MUTANTS)} and runs that check alone")
        MUTANTS[mutant]()
    fake = [n for n in names if n.startswith("fake_")]
    if fake and len(names) > 1:
        sys.exit(f"cuda_checks.py: {fake[0]} starts a fake process group of its own: run it alone")
    if not torch.cuda.is_available() and (DEVICE == "cuda" or fake):
        sys.exit("cuda_checks.py: no GPU is visible")
    try:
        for name in names:
            CHECKS[name]()
            print(f"{name}: ok", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
