"""FSDP2's communication hooks and extensions, run on torch's ``fully_shard`` and on ``fsdpfn.compat``'s
(parametrised) in the same worker: ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (torch's
``AllGather`` / ``ReduceScatter`` objects, called with FSDP2's arguments), ``set_all_reduce_hook`` (on the
reduce-scatter output on a 1-D mesh, on the all-reduce output with HSDP, scaled as FSDP2 scales it),
``share_comm_ctx``, ``set_separate_reduce_scatter_group``, the CPU behaviour of the memory knobs, and the
meta-device initialisation with rank 0's weights broadcast into the shards.

Each worker records what the objects and hooks were called with; the test asserts the expected calls
(checked on torch itself by the ``torch`` parametrisation) and, for fsdpfn, that calls, hook inputs,
losses, gradients and parameters equal torch's.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import distribute_tensor

from fsdpfn.core.c10d import all_gather_single, reduce_scatter_single
from fsdpfn.testing import fsdp2_lacks, spmd

TORCH, COMPAT = "torch.distributed.fsdp", "fsdpfn.compat"
LIBS = (TORCH, COMPAT)
TIMEOUT = 90
TOL = dict(rtol=1e-5, atol=1e-6)


class RecordingAllGather(AllGather):
    """The default all-gather, recording each call (offset = where the input view starts in the output)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def allocate(self, size, *, dtype, device):
        self.calls.append(("allocate", tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        offset = (input_tensor.data_ptr() - output_tensor.data_ptr()) // output_tensor.element_size()
        self.calls.append(("call", tuple(output_tensor.shape), tuple(input_tensor.shape), offset, async_op, group.size()))
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(ReduceScatter):
    """The default reduce-scatter, recording each call and the op."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def allocate(self, size, *, dtype, device):
        self.calls.append(("allocate", tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append(("call", tuple(output_tensor.shape), tuple(input_tensor.shape), str(op), async_op, group.size()))
        return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))


def _x(step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))


def _sharded(lib: str, mesh, mp=None) -> nn.Sequential:
    api = importlib.import_module(lib)
    model = _model()
    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": api.MixedPrecisionPolicy(reduce_dtype=mp)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api.fully_shard(model[2], **kw)
        api.fully_shard(model, **kw)
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().full_tensor()
        out[n + ".grad"] = p.grad.full_tensor() if p.grad is not None else None
    return out


def _train_with_hooks(lib: str, shape: tuple[int, ...]) -> dict:
    """Three steps on a 1-D or HSDP mesh with a custom all-gather and reduce-scatter and a recording
    hook on ``model[2]`` (its backward needs its weight, so it is re-gathered), and a hook that doubles
    the root's gradient in place: step 0 plain, step 1 without gradient sync (nothing is reduced),
    step 2 with sync (one reduction of both steps' gradients) and forced sums."""
    names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _sharded(lib, mesh)
    ag, rs, seen, root_seen = RecordingAllGather(), RecordingReduceScatter(), [], []
    model[2].set_custom_all_gather(ag)
    model[2].set_custom_reduce_scatter(rs)
    model[2].set_all_reduce_hook(lambda t: seen.append((tuple(t.shape), t.dtype, t.clone())))

    def double(t: torch.Tensor) -> None:
        root_seen.append((tuple(t.shape), t.dtype))
        t.mul_(2)

    model.set_all_reduce_hook(double)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, per_step, bias_grads = [], [], []
    for step in range(3):
        model.set_requires_gradient_sync(step != 1)
        if step == 2:
            model[2].set_force_sum_reduction_for_comms(True)
        loss = model(_x(step)).pow(2).sum()
        loss.backward()
        losses.append(loss.detach())
        per_step.append((len(ag.calls), len(rs.calls), len(seen), len(root_seen)))
        if step != 1:
            bias_grads.append(model[2].bias.grad.to_local().clone())
            opt.step()
            opt.zero_grad()
    return {
        "ag": ag.calls, "rs": rs.calls, "seen": seen, "root": root_seen, "per_step": per_step, "losses": losses,
        "bias_grads": bias_grads, "state": _state(model),
    }  # fmt: skip


def _check_hooks(lib: str, shape: tuple[int, ...]) -> torch.Tensor:
    got = _train_with_hooks(lib, shape)
    world = shape[-1]
    rank = dist.get_rank() % world
    dp = world * (shape[0] if len(shape) == 2 else 1)
    n = (4 * 6 + 4) // world  # model[2]'s flat shard: weight rows and bias split evenly
    per_gather = [("allocate", (n * world,), torch.float32), ("call", (n * world,), (n,), rank * n, False, world)]
    # forward gathers, backward re-gathers (model[2] reshards after forward); the no-sync step too
    assert got["ag"] == per_gather * 6, (lib, got["ag"])

    def reduction(op: str) -> list[tuple]:
        return [("allocate", (n * world,), torch.float32), ("allocate", (n,), torch.float32), ("call", (n,), (n * world,), op, False, world)]

    assert got["rs"] == reduction("RedOpType.AVG") + reduction("RedOpType.SUM"), (lib, got["rs"])
    assert got["per_step"] == [(4, 3, 1, 1), (8, 3, 1, 1), (12, 6, 2, 2)], (lib, got["per_step"])
    assert [s[:2] for s in got["seen"]] == [((n,), torch.float32)] * 2, lib
    root_shapes = [s for s, _ in got["root"]]
    assert [d for _, d in got["root"]] == [torch.float32] * 2 and root_shapes[0] == root_shapes[1], (lib, got["root"])
    # the flat shard ends with this rank's bias slice: the hook saw the mean over data-parallel ranks
    # (the gradient model[2] got), then, with forced sums, the unscaled sum (dp times the gradient)
    k = 4 // world
    torch.testing.assert_close(got["seen"][0][2][-k:], got["bias_grads"][0], **TOL)
    torch.testing.assert_close(got["seen"][1][2][-k:], dp * got["bias_grads"][1], **TOL)
    if lib == COMPAT:
        ref = _train_with_hooks(TORCH, shape)
        for key in ("ag", "rs", "per_step"):
            assert got[key] == ref[key], (key, got[key], ref[key])
        assert got["root"] == ref["root"]
        assert len(got["seen"]) == len(ref["seen"])
        for (s, d, t), (rs_, rd, rt) in zip(got["seen"], ref["seen"]):
            assert (s, d) == (rs_, rd)
            torch.testing.assert_close(t, rt, **TOL)
        torch.testing.assert_close(got["losses"], ref["losses"], **TOL)
        for k, v in ref["state"].items():
            torch.testing.assert_close(got["state"][k], v, **TOL, msg=lambda m: f"{k}: {m}")
    return got["seen"][0][2]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("world, shape", [(2, (2,)), (4, (2, 2))], ids=["1d", "hsdp"])
def test_custom_collectives_and_all_reduce_hook(lib, world, shape):
    seen = spmd(world, _check_hooks, lib, shape, timeout=TIMEOUT)
    if len(shape) == 2:  # HSDP: the hook runs after the all-reduce, so both replicas saw the same slice
        torch.testing.assert_close(seen[0], seen[2], **TOL)
        torch.testing.assert_close(seen[1], seen[3], **TOL)
        assert not torch.equal(seen[0], seen[1])


def _hook_scaling(lib: str, shape: tuple[int, ...], dtype) -> tuple:
    """What the hook sees for one backward, next to the mean gradient it should be a multiple of."""
    names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _sharded(lib, mesh, mp=dtype)
    seen = []
    model[2].set_all_reduce_hook(lambda t: seen.append(t.clone()))
    model(_x(0)).pow(2).sum().backward()
    bias = model[2].bias.grad.to_local()  # the flat shard ends with this rank's bias slice
    return seen, bias


def _check_scaling(lib: str, shape: tuple[int, ...]) -> list:
    out = []
    for dtype in (None, torch.float16):
        seen, bias = _hook_scaling(lib, shape, dtype)
        assert len(seen) == 1, (lib, dtype, len(seen))
        hook_bias = seen[0][-bias.numel():].float()
        out.append((seen[0].dtype, (hook_bias / bias.float()).mean().item()))
        if lib == COMPAT:
            ref, ref_bias = _hook_scaling(TORCH, shape, dtype)
            torch.testing.assert_close(seen[0], ref[0], rtol=2e-3, atol=1e-3)
            torch.testing.assert_close(bias, ref_bias, rtol=2e-3, atol=1e-3)
    return out


@pytest.mark.parametrize("lib", LIBS)
def test_all_reduce_hook_scaling_follows_fsdp2_hsdp(lib):
    # HSDP over 4 ranks: fp32 reduces with AVG, so the hook sees the mean (ratio 1); an fp16 reduction
    # divides by 2 before and 2 after (FSDP2 keeps fp16 in range), so the hook sees twice the mean
    for r in spmd(4, _check_scaling, lib, (2, 2), timeout=TIMEOUT):
        (d32, k32), (d16, k16) = r
        assert d32 == torch.float32 and abs(k32 - 1) < 1e-4, r
        assert d16 == torch.float16 and abs(k16 - 2) < 1e-2, r


def _stream_on_hsdp(lib: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(lib, mesh)
    try:
        model.set_all_reduce_hook(lambda t: None, stream=object())
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("lib", LIBS)
def test_all_reduce_hook_stream_is_refused_with_hsdp(lib):
    assert spmd(4, _stream_on_hsdp, lib, timeout=TIMEOUT) == ["stream cannot be set when using native HSDP"] * 4


def _meta_init(lib: str) -> dict:
    """Torch's recipe: build on meta, fully_shard, materialise with to_empty, initialise on rank 0 only
    and broadcast into the shards (distribute_tensor scatters rank 0's full tensor)."""
    api = importlib.import_module(lib)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api.fully_shard(model[2], mesh=mesh)
        api.fully_shard(model, mesh=mesh)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    full = _model().state_dict() if dist.get_rank() == 0 else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = full[name] if full is not None else torch.full(p.shape, float("nan"))  # rank 0 wins
            p.copy_(distribute_tensor(src, mesh, p.placements))
    loss = model(_x(0)).pow(2).sum()
    loss.backward()
    return {"loss": loss.detach(), **_state(model)}


def _check_meta_init(lib: str) -> None:
    got = _meta_init(lib)
    ref = _model()  # single process: the same weights, the mean gradient over both ranks' batches
    losses = []
    for r in range(dist.get_world_size()):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(r))
        losses.append(ref(x).pow(2).sum())
    (sum(losses) / len(losses)).backward()
    torch.testing.assert_close(got["loss"], losses[dist.get_rank()].detach(), **TOL)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), **TOL)
        torch.testing.assert_close(got[n + ".grad"], p.grad, **TOL)
    if lib == COMPAT:
        want = _meta_init(TORCH)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, **TOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("lib", LIBS)
def test_meta_init_with_rank0_broadcast(lib):
    spmd(2, _check_meta_init, lib, timeout=TIMEOUT)


def _two_roots(lib: str) -> tuple[dict, dict, bool | None]:
    """Two roots (pipeline chunks) sharing their comm context, trained one after the other."""
    api = importlib.import_module(lib)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a, b = _model(), nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (a, b):
            api.fully_shard(m[2], mesh=mesh)
            api.fully_shard(m, mesh=mesh)
    api.share_comm_ctx([a, b])
    with pytest.raises(ValueError, match="Expects list of FSDPModules"):
        api.share_comm_ctx([a, nn.Linear(2, 2)])
    for step in range(2):
        b(a(_x(step))).pow(2).sum().backward()
    shared = None
    if lib == COMPAT:
        from fsdpfn.compat.state import state_of

        shared = state_of(a).root.comm is state_of(b).root.comm
    return _state(a), _state(b), shared


def _check_share(lib: str) -> bool | None:
    a, b, shared = _two_roots(lib)
    if lib == COMPAT:
        ra, rb, _ = _two_roots(TORCH)
        for got, want in ((a, ra), (b, rb)):
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, **TOL, msg=lambda m: f"{k}: {m}")
    return shared


@pytest.mark.parametrize("lib", LIBS)
def test_share_comm_ctx_between_roots(lib):
    shared = spmd(2, _check_share, lib, timeout=TIMEOUT)
    assert shared == ([True, True] if lib == COMPAT else [None, None])


def _unsupported_on_cpu(lib: str) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _sharded(lib, mesh)
    out = {}
    for name, call in (
        ("symm_mem", lambda: model.set_symm_mem_for_comm()),
        ("pg_alloc", lambda: model.set_allocate_memory_from_process_group_for_comm(True)),
    ):
        try:
            call()
            out[name] = "accepted"
        except (RuntimeError, NotImplementedError) as e:
            out[name] = type(e).__name__
    loss = model(_x(0)).pow(2).sum()
    loss.backward()
    out["state"] = _state(model)
    return out


@pytest.mark.parametrize("lib", LIBS)
def test_comm_memory_knobs_on_cpu(lib):
    if lib == TORCH and fsdp2_lacks("set_symm_mem_for_comm"):
        pytest.skip(fsdp2_lacks("set_symm_mem_for_comm"))
    # torch's symmetric memory needs NCCL (RuntimeError on gloo; fsdpfn: NotImplementedError anywhere);
    # process-group allocation falls back to plain allocation on gloo in both, and training is unchanged
    r = spmd(2, _unsupported_on_cpu, lib, timeout=TIMEOUT)[0]
    assert r["symm_mem"] == ("RuntimeError" if lib == TORCH else "NotImplementedError")
    assert r["pg_alloc"] == "accepted"


class GroupOfReduceScatter(RecordingReduceScatter):
    """Records whether each reduce-scatter ran on the all-gather's (the mesh's) group, and its ranks."""

    def __init__(self, mesh_group) -> None:
        super().__init__()
        self.mesh_group = mesh_group

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append((group is self.mesh_group, dist.get_process_group_ranks(group)))
        return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _separate_group(lib: str) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _sharded(lib, mesh)
    rs = GroupOfReduceScatter(mesh.get_group())
    model[2].set_custom_reduce_scatter(rs)
    for step, enable in enumerate((False, True, True, False)):
        model.set_separate_reduce_scatter_group(enable)
        model(_x(step)).pow(2).sum().backward()
    return {"calls": [c for c in rs.calls if c[0] != "allocate"], **_state(model)}


def _check_separate_group(lib: str) -> list:
    got = _separate_group(lib)
    if lib == COMPAT:
        want = _separate_group(TORCH)
        for k, v in want.items():
            if k != "calls":
                torch.testing.assert_close(got[k], v, **TOL, msg=lambda m: f"{k}: {m}")
    return got["calls"]


@pytest.mark.parametrize("lib", LIBS)
def test_separate_reduce_scatter_group(lib):
    if fsdp2_lacks("set_separate_reduce_scatter_group"):  # torch's run is the reference for both
        pytest.skip(fsdp2_lacks("set_separate_reduce_scatter_group"))
    # off, on, on (the same group again), off: the reduce-scatter's group is the mesh's or a new one
    # over the same ranks; gradients are the same either way
    for calls in spmd(2, _check_separate_group, lib, timeout=TIMEOUT):
        assert calls == [(True, [0, 1]), (False, [0, 1]), (False, [0, 1]), (True, [0, 1])], calls


def _fused(lib: str) -> dict:
    """Five units; fsdpfn fuses its neighbours into groups (set_min_bucket_bytes), except the unit with
    a hook, which must still see its own reduction once per backward."""
    api = importlib.import_module(lib)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(5)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in model:
            api.fully_shard(block, mesh=mesh)
        api.fully_shard(model, mesh=mesh)
    if lib == COMPAT:
        model.set_min_bucket_bytes(1 << 20)
    seen = []
    model[2].set_all_reduce_hook(lambda t: seen.append(tuple(t.shape)))
    for step in range(2):
        model(_x(step)).pow(2).sum().backward()
    if lib == COMPAT:  # the neighbours did fuse; the hooked unit stayed alone
        from fsdpfn.compat.state import state_of

        group_of = state_of(model).root.plan.group_of
        assert group_of["2"] == "2" and group_of["0"] == group_of["1"] != "0", dict(group_of)
    return {"seen": seen, **_state(model)}


def _check_fused() -> list:
    got, want = _fused(COMPAT), _fused(TORCH)
    for k, v in want.items():
        if k != "seen":
            torch.testing.assert_close(got[k], v, **TOL, msg=lambda m: f"{k}: {m}")
    return [got["seen"], want["seen"]]


def test_a_unit_with_a_hook_is_not_fused_with_its_neighbours():
    for got, want in spmd(2, _check_fused, timeout=TIMEOUT):
        assert got == want == [((4 * 4 + 4) // 2,)] * 2, (got, want)
