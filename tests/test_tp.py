"""The functional layer over tensor parallelism: ``fsdpfn.shard(model, mesh["dp"])`` of a module parallelised
with ``parallelize_module(model, mesh["tp"], plan)``. Each check trains, in the same worker and on the same
per-rank batches, (a) the single-process unsharded model (gradients averaged over the dp ranks' batches),
(b) torch's ``fully_shard`` + TP and (c) ``fsdpfn.shard`` + ``fsdp`` + ``value_and_grad`` +
``fsdpfn.optim.adamw`` with ``clip_grad_norm``, and compares losses, reduced gradients, the global norm,
parameters after several steps, ``to_dtensor`` placements (FSDP2's) and ``full_state_dict``.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd

TIMEOUT = 180
STEPS = 3
LR = 1e-2
MAX_NORM = 0.5  # small enough that every step clips: the norm feeds the update

# TP plans over the four linears of ``Net``: a Megatron pair (Colwise then Rowwise), or a single layer
# whose sharded side is gathered back (Colwise to Replicate(), Rowwise from Replicate()).
PLANS = {
    "none": {},
    "pair01": {"l0": ("col", None), "l1": ("row", None)},
    "pair12": {"l1": ("col", None), "l2": ("row", None)},
    "two_pairs": {"l0": ("col", None), "l1": ("row", None), "l2": ("col", None), "l3": ("row", None)},
    "col_replicate": {"l0": ("col", "replicate")},
    "row_replicate": {"l3": ("row", "replicate")},
    "mixed": {"l0": ("col", "replicate"), "l1": ("col", None), "l2": ("row", None)},
}


# Sequence parallelism (Megatron-SP): ``Net(widths, norm=True)`` has a LayerNorm after ``l0`` that runs on
# sequence shards; its batches are (2, SEQ, d), the sequence dim (1) split evenly over tp 2. See _parallelize.
SP = "sequence_parallel"
SEQ = 4


class Net(nn.Module):
    def __init__(self, widths: tuple[int, ...], norm: bool = False):
        super().__init__()
        for i in range(4):
            setattr(self, f"l{i}", nn.Linear(widths[i], widths[i + 1]))
        self.norm = nn.LayerNorm(widths[1]) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(4):
            x = getattr(self, f"l{i}")(x)
            x = self.norm(x) if i == 0 and self.norm is not None else x
            x = torch.tanh(x) if i < 3 else x
        return x


# ---- worker side ------------------------------------------------------------------------------------------
def _parallelize(model: nn.Module, tp_mesh, plan_name: str) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    if plan_name == SP:
        # l0 enters the sequence-parallel region (its partial output is reduce-scattered to sequence shards),
        # the norm runs on those shards (its TP-replicated weight and bias get partial gradients: each TP rank
        # saw its own tokens), l1 / l2 are a Megatron pair that all-gathers the sequence and reduce-scatters it
        # back, and l3 all-gathers it again and returns a replicated output
        return parallelize_module(model, tp_mesh, {
            "l0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "l1": ColwiseParallel(input_layouts=Shard(1)),
            "l2": RowwiseParallel(output_layouts=Shard(1)),
            "l3": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    plan = {}
    for name, (kind, gathered) in PLANS[plan_name].items():
        if kind == "col":
            plan[name] = ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
        else:
            plan[name] = RowwiseParallel(input_layouts=Replicate()) if gathered else RowwiseParallel()
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model


def _batch(dp_rank: int, step: int, d: int, plan_name: str) -> torch.Tensor:
    shape = (2, SEQ, d) if plan_name == SP else (3, d)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * dp_rank + step))


def _fully_shard(model: nn.Module, dp_mesh, units, **kw) -> nn.Module:
    """torch's ``fully_shard`` on each unit, then on the root (as ``fsdpfn.shard(..., units=units)`` groups)."""
    from torch.distributed.fsdp import fully_shard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in units:
            fully_shard(model.get_submodule(n), mesh=dp_mesh, **kw)
        fully_shard(model, mesh=dp_mesh, **kw)
    return model


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _w_train(shape: tuple[int, ...], widths: tuple[int, ...], plan_name: str, bucket: bool, steps: int = STEPS, mp: bool = False) -> dict:
    import fsdpfn
    from torch.distributed.tensor import DTensor

    if len(shape) == 2:
        mesh = fsdpfn.init_mesh(shape, names=("dp", "tp"))
    else:  # fsdpfn.init_mesh makes 1-D and 2-D meshes only
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = mesh["dp"] if len(shape) == 2 else mesh["replicate", "shard"]  # 3-D: HSDP x TP
    coord = dp_mesh.get_coordinate()
    dp, dp_rank = dp_mesh.size(), coord[0] if len(coord) == 1 else coord[0] * shape[1] + coord[1]
    names = [f"l{i}" for i in range(4)]

    torch.manual_seed(0)
    ref = Net(widths, norm=plan_name == SP)
    torch.manual_seed(0)
    fs2 = _parallelize(Net(widths, norm=plan_name == SP), mesh["tp"], plan_name)
    torch.manual_seed(0)
    fn = _parallelize(Net(widths, norm=plan_name == SP), mesh["tp"], plan_name)
    kw, fn_kw = {}, {}
    if mp:  # bf16 gathers and compute, fp32 reductions: compared with FSDP2's, not the fp32 reference
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fn_kw["mp_policy"] = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _fully_shard(fs2, dp_mesh, names, **kw)
    params = fsdpfn.shard(fn, dp_mesh, units=names, min_bucket_bytes="auto" if bucket else None, **fn_kw)
    tol = dict(rtol=2e-2, atol=2e-3) if mp else {}
    apply = fsdpfn.fsdp(fn)
    opt = fsdpfn.optim.adamw(lr=LR)
    state = opt.init(params)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    fs2_opt = torch.optim.AdamW(fs2.parameters(), lr=LR)
    step_fn = fsdpfn.value_and_grad(lambda p, x: _loss(apply(p, x)))

    for step in range(steps):
        # reference: the mean of the dp ranks' losses (fsdpfn and FSDP2 average gradients over dp)
        ref_losses = [_loss(ref(_batch(r, step, widths[0], plan_name))) for r in range(dp)]
        torch.stack(ref_losses).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)

        x = _batch(dp_rank, step, widths[0], plan_name)
        fs2_loss = _loss(fs2(x))
        fs2_loss.backward()
        # torch's clip_grad_norm_ refuses DTensors on different meshes (dp-only and dp x tp): clip by hand
        fs2_norm = torch.stack([p.grad.full_tensor().pow(2).sum() for p in fs2.parameters()]).sum().sqrt()
        for p in fs2.parameters():
            p.grad.mul_(torch.clamp(MAX_NORM / (fs2_norm + 1e-6), max=1.0))

        loss, grads = step_fn(params, x)
        if step == 0:  # the inf-norm too (max_norm too large to clip): a max over dp and tp
            _, inf_norm = fsdpfn.optim.clip_grad_norm(grads, 1e30, norm_type=float("inf"))
            if not mp:
                want_inf = torch.stack([p.grad.abs().max() for p in ref.parameters()]).max() * (ref_norm.clamp(min=MAX_NORM) / MAX_NORM)
                torch.testing.assert_close(inf_norm, want_inf, msg=lambda m: f"inf-norm vs reference: {m}")
        grads, norm = fsdpfn.optim.clip_grad_norm(grads, MAX_NORM)
        torch.testing.assert_close(loss.float(), fs2_loss.float(), **tol, msg=lambda m: f"loss vs FSDP2 at step {step}: {m}")
        if not mp:
            torch.testing.assert_close(loss, ref_losses[dp_rank], msg=lambda m: f"loss vs reference at step {step}: {m}")
            torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"grad norm vs reference at step {step}: {m}")
        torch.testing.assert_close(norm, fs2_norm, **tol, msg=lambda m: f"grad norm vs FSDP2 at step {step}: {m}")
        if step == 0:  # clipped, reduced gradients: global values and FSDP2's placements
            got = fsdpfn.to_dtensor(grads)
            for n, p in fs2.named_parameters():
                assert got[n].placements == p.grad.placements, (n, got[n].placements, p.grad.placements)
                torch.testing.assert_close(got[n].to_local(), p.grad.to_local(), **tol, msg=lambda m, n=n: f"grad {n} vs FSDP2: {m}")
            for n, p in ref.named_parameters() if not mp else ():
                torch.testing.assert_close(got[n].full_tensor(), p.grad, msg=lambda m, n=n: f"grad {n} vs reference: {m}")
        params, state = opt.update(grads, state, params)
        ref_opt.step()
        ref_opt.zero_grad()
        fs2_opt.step()
        fs2_opt.zero_grad()

    sd = fsdpfn.to_dtensor(params)
    for n, p in fs2.named_parameters():
        assert (sd[n].device_mesh, sd[n].placements, sd[n].shape) == (p.device_mesh, p.placements, p.shape), n
        torch.testing.assert_close(sd[n].to_local(), p.to_local().detach(), **tol, msg=lambda m, n=n: f"param {n} vs FSDP2: {m}")
    if mp:
        return {}
    # unshard gathers over dp only: TP parameters come back as the module's DTensors on mesh["tp"]
    gathered = fsdpfn.unshard(params)
    for n, p in ref.named_parameters():
        value, tp = gathered[n], fn.get_parameter(n)  # fn's own parameters were donated: meta, same layout
        if isinstance(tp, DTensor):
            assert (value.device_mesh, value.placements) == (mesh["tp"], tp.placements), n
            value = value.full_tensor()
        torch.testing.assert_close(value, p.detach(), msg=lambda m, n=n: f"unshard {n} vs reference: {m}")
    x = _batch(dp_rank, steps, widths[0], plan_name)
    torch.testing.assert_close(torch.func.functional_call(fn, gathered, (x,)), apply(params, x))
    full = fsdpfn.full_state_dict(params, rank0_only=False)
    want = ref.state_dict()
    assert list(full) == list(want)
    for n, v in want.items():
        torch.testing.assert_close(full[n], v, msg=lambda m, n=n: f"full_state_dict {n} vs reference: {m}")
    return {n: v.shape for n, v in full.items()}


# widths: the input and output features are any size (never TP-sharded: uneven over dp); hidden widths are
# tp * k (TP itself splits evenly), odd k splitting the TP-local rows unevenly over dp 2
_edge = st.integers(1, 5)
_hidden = st.integers(1, 3).map(lambda k: 2 * k)


@settings(max_examples=max(2, settings().max_examples // 34))  # ~5 s per example at world 4 (3 at the default 100)
@given(
    widths=st.tuples(_edge, _hidden, _hidden, _hidden, _edge),
    plan=st.sampled_from(sorted(PLANS)),
    bucket=st.booleans(),
)
def test_training_matches_fsdp2_tp_and_the_unsharded_model(widths, plan, bucket):
    spmd(4, _w_train, (2, 2), widths, plan, bucket, timeout=TIMEOUT)


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)], ids=["dp1_x_tp2", "dp2_x_tp1"])
def test_degenerate_meshes_at_world_2(shape):
    spmd(2, _w_train, shape, (3, 4, 6, 2, 5), "two_pairs", False, timeout=TIMEOUT)


def test_bf16_mixed_precision_matches_fsdp2_tp():
    spmd(4, _w_train, (2, 2), (3, 4, 6, 2, 5), "mixed", False, 2, True, timeout=TIMEOUT)


def test_hsdp_times_tp_3d_matches_fsdp2_and_the_unsharded_model():
    # world 8 = replicate 2 x shard 2 x tp 2: placements (Replicate(), _StridedShard(0, sf=2), Shard(0)) & co.
    spmd(8, _w_train, (2, 2, 2), (3, 2, 6, 4, 5), "mixed", False, 2, timeout=TIMEOUT)  # 8 processes on few cores: 2 steps


def test_sequence_parallel_matches_fsdp2_tp_and_the_unsharded_model():
    # widths: l0's input and l3's output are TP-split (Rowwise in, Colwise out: even), the rest split unevenly
    # over dp 2 (the norm's 5, l1's 3 TP-local rows, l2's 3 columns, l3's 1 TP-local row leaves dp rank 1 empty)
    spmd(4, _w_train, (2, 2), (4, 5, 6, 3, 2), SP, False, timeout=TIMEOUT)


def _w_non_finite(widths, plan_name, leaf, bad_rank, value):
    """value_and_grad(check_finite=True)'s check and loss_scale's over a dp 2 x tp 2 tree, one rank's gradient
    poisoned."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdpfn
    from fsdpfn.transform.grad import check_grads_finite

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    params = fsdpfn.shard(_parallelize(Net(widths), mesh["tp"], plan_name), mesh["dp"], units=["l1", "l2"])
    grads = torch.utils._pytree.tree_map(torch.zeros_like, params)
    name = params.plan.params[leaf % len(params.plan.params)]
    poisoned = dist.get_rank() == bad_rank and grads[name].numel() > 0
    if poisoned:
        grads[name].view(-1)[-1] = value
    ls = fsdpfn.optim.loss_scale()
    _, finite, _ = ls.unscale(torch.utils._pytree.tree_map(torch.clone, grads), ls.init())  # the same decision
    try:
        check_grads_finite(grads, params.plan)
    except FloatingPointError as e:
        return name, poisoned, str(e), finite
    return name, poisoned, None, finite


@settings(max_examples=4, deadline=None)
@given(
    widths=st.tuples(_edge, _hidden, _hidden, _hidden, _edge),
    plan=st.sampled_from(sorted(PLANS)),
    leaf=st.integers(0, 7),
    bad_rank=st.integers(0, 3),
    value=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
)
def test_non_finite_gradient_on_one_tp_rank_is_seen_by_every_rank(widths, plan, leaf, bad_rank, value):
    # each dp group holds other TP slices: a check over the dp group alone raised on that rank's tp slice only.
    # Without TP parameters the dp groups ({0, 2}, {1, 3}) train apart (as pipeline stages): only the bad one raises
    out = spmd(4, _w_non_finite, widths, plan, leaf, bad_rank, value, timeout=TIMEOUT)
    name = out[0][0]
    poisoned = any(p for _, p, _, _ in out)
    for rank, (_, _, message, finite) in enumerate(out):
        if poisoned and (PLANS[plan] or rank % 2 == bad_rank % 2):
            assert message is not None and message.endswith(f"non-finite gradient in {name!r} on rank {bad_rank}"), (rank, message)
            assert not finite, rank  # fsdpfn.optim.loss_scale skips the step there too
        else:
            assert message is None and finite, (rank, message)


# ---- checkpoints: save / load round trip, and reload at another dp size ----------------------------------
CKPT_WIDTHS = (3, 4, 6, 2, 5)


def _scaled(params):
    return params.replace({k: v * -2.0 + 0.5 for k, v in params.params().items()})


def _w_save(path: str) -> None:
    import fsdpfn

    mesh = fsdpfn.init_mesh((2, 2), names=("dp", "tp"))
    torch.manual_seed(0)
    params = _scaled(fsdpfn.shard(_parallelize(Net(CKPT_WIDTHS), mesh["tp"], "mixed"), mesh["dp"], units=["l1", "l2"]))
    fsdpfn.save(path, params)
    torch.manual_seed(1)  # other values, so a load that does nothing shows
    like = fsdpfn.shard(_parallelize(Net(CKPT_WIDTHS), mesh["tp"], "mixed"), mesh["dp"], units=["l1", "l2"])
    got = fsdpfn.load(path, like)
    for k, v in params.items():
        torch.testing.assert_close(got[k], v, msg=lambda m, k=k: f"{k}: {m}")
    # the checkpoint is FSDP2 + TP's layout: torch's fully_shard model loads it with DCP as it is
    from torch.distributed import checkpoint as dcp

    torch.manual_seed(1)
    fs2 = _fully_shard(_parallelize(Net(CKPT_WIDTHS), mesh["tp"], "mixed"), mesh["dp"], ("l1", "l2"))
    state = fs2.state_dict()
    dcp.load(state, checkpoint_id=path)
    fs2.load_state_dict(state)
    want = fsdpfn.to_dtensor(params)
    for n, p in fs2.named_parameters():
        assert (p.placements, p.shape) == (want[n].placements, want[n].shape), n
        torch.testing.assert_close(p.to_local(), want[n].to_local(), msg=lambda m, n=n: f"FSDP2 loaded {n}: {m}")
    # and back: from_dtensor of FSDP2's state dict (same layout), and of full plain tensors (sliced: tp, then dp)
    full = {k: v.full_tensor() for k, v in fs2.state_dict().items()}
    for source in (fs2.state_dict(), full):
        back = fsdpfn.from_dtensor(source, like)
        for k, v in params.items():
            torch.testing.assert_close(back[k], v, msg=lambda m, k=k: f"from_dtensor {k}: {m}")


def _w_load_elsewhere(path: str, shape: tuple[int, int]) -> None:
    import fsdpfn

    mesh = fsdpfn.init_mesh(shape, names=("dp", "tp"))
    torch.manual_seed(1)
    like = fsdpfn.shard(_parallelize(Net(CKPT_WIDTHS), mesh["tp"], "mixed"), mesh["dp"], units=["l1"])
    loaded = fsdpfn.load(path, like)
    got = fsdpfn.full_state_dict(loaded, rank0_only=False)
    torch.manual_seed(0)
    want = {k: v * -2.0 + 0.5 for k, v in Net(CKPT_WIDTHS).state_dict().items()}
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, msg=lambda m, k=k: f"{k}: {m}")
    # and back: the full state dict, read on rank 0 only, sharded into like's layout
    again = fsdpfn.load_full_state_dict(like, want if torch.distributed.get_rank() == 0 else None)
    for k, v in loaded.items():
        torch.testing.assert_close(again[k], v, msg=lambda m, k=k: f"load_full_state_dict {k}: {m}")


def test_save_load_round_trips_and_reloads_at_another_dp_size(tmp_path):
    path = str(tmp_path / "ckpt")
    spmd(4, _w_save, path, timeout=TIMEOUT)
    spmd(2, _w_load_elsewhere, path, (1, 2), timeout=TIMEOUT)  # dp 1 x tp 2
    spmd(2, _w_load_elsewhere, path, (2, 1), timeout=TIMEOUT)  # dp 2 x tp 1: the TP layout itself changes


def _w_load_fsdp2s(path: str) -> None:
    # the other direction: torch's fully_shard + TP model saves with DCP (its state_dict() and
    # get_model_state_dict: both DTensors on the dp + tp mesh, keyed by FQN), fsdpfn.load reads it
    import fsdpfn
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mesh = fsdpfn.init_mesh((2, 2), names=("dp", "tp"))
    torch.manual_seed(0)
    fs2 = _fully_shard(_parallelize(Net(CKPT_WIDTHS), mesh["tp"], "mixed"), mesh["dp"], ("l1", "l2"))
    with torch.no_grad():
        for p in fs2.parameters():
            p.mul_(-2.0).add_(0.5)  # not what a fresh model holds, so a load that does nothing shows
    for how, state in (("state_dict", fs2.state_dict()), ("get_model_state_dict", get_model_state_dict(fs2))):
        dcp.save(state, checkpoint_id=f"{path}/{how}")
        torch.manual_seed(1)  # other values in like
        like = fsdpfn.shard(_parallelize(Net(CKPT_WIDTHS), mesh["tp"], "mixed"), mesh["dp"], units=["l1", "l2"])
        got = fsdpfn.load(f"{path}/{how}", like)
        full, mine = fsdpfn.full_state_dict(got, rank0_only=False), fsdpfn.to_dtensor(got)
        assert list(full) == [n for n, _ in fs2.named_parameters()], (how, list(full))
        for n, p in fs2.named_parameters():
            assert (mine[n].device_mesh, mine[n].placements) == (p.device_mesh, p.placements), (how, n)
            torch.testing.assert_close(full[n], p.full_tensor().detach(), msg=lambda m, n=n: f"{how}: {n}: {m}")


def test_load_reads_a_checkpoint_fsdp2_tp_saved_with_dcp(tmp_path):
    spmd(4, _w_load_fsdp2s, str(tmp_path), timeout=TIMEOUT)


# ---- refusals: the same errors as fsdpfn.compat's (docs/errors.md compat-tp-*) ------------------------------
def _w_refusals() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    import fsdpfn

    def model(tp_mesh, placement):
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        m[0].weight = nn.Parameter(DTensor.from_local(m[0].weight.detach(), tp_mesh, [placement], run_check=False))
        return m

    two_d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    one_d = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    cases = {
        "other_root": lambda: fsdpfn.shard(model(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), Shard(0)), init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["dp"]),
        "shared_dims": lambda: fsdpfn.shard(model(one_d, Shard(0)), one_d),  # TP on the dp mesh itself
        "placements": lambda: fsdpfn.shard(model(two_d["tp"], Partial()), two_d["dp"]),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - we report what was raised
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = (None, "no error")
    return out


def test_bad_tensor_parallel_input_is_refused_with_compats_errors():
    got = spmd(2, _w_refusals, timeout=TIMEOUT)[0]
    assert got["other_root"][0] == "ValueError" and "shard: parameter '0.weight' of Sequential is a DTensor on" in got["other_root"][1]
    assert "not a sub-mesh of the same device mesh as the data-parallel mesh" in got["other_root"][1]
    assert got["shared_dims"][0] == "ValueError" and "shares mesh dims with the data-parallel mesh" in got["shared_dims"][1]
    assert got["placements"][0] == "NotImplementedError"
    assert "shard: parameter '0.weight' of Sequential has tensor-parallel placements (Partial(sum),)" in got["placements"][1]
