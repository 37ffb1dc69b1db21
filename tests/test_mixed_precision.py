"""Mixed precision: bf16 gathers and compute, fp32 reduction and master shards; bf16 training tracks fp32."""

import torch
import torch.nn.functional as F

import fsdpfn
import fsdpfn.optim as optim
from fsdpfn.testing import spmd
from fsdpfn.testing.models import ModelRecipe

RECIPE = ModelRecipe("transformer", (6, 16, 5, 32, 32), seed=3, seq=4)
STEPS = 20


def _train(policy_dtypes):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = RECIPE.build()
    mp = fsdpfn.MixedPrecisionPolicy(param_dtype=policy_dtypes[0], reduce_dtype=policy_dtypes[1]) if policy_dtypes else None
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.0", "blocks.1"], mp_policy=mp)
    apply = fsdpfn.fsdp(model)
    opt = optim.adamw(lr=1e-2)
    state = opt.init(params)
    step_fn = fsdpfn.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x).float(), y))
    stats = params.plan.comm.stats
    losses, logs = [], None
    for step in range(STEPS):
        x = RECIPE.inputs(4 * world, seed=0)[rank * 4 : rank * 4 + 4]  # one fixed batch: the loss must fall
        y = torch.sin(x[..., :5] * 3)
        stats.recording = step == 0
        loss, grads = step_fn(params, x, y)
        if step == 0:
            logs = list(stats.log)
            grad_dtypes = {str(g.dtype) for g in grads.params().values()}
        params, state = opt.update(grads, state, params)
        losses.append(loss.item())
    leaf_dtypes = {str(v.dtype) for v in params.params().values()}
    return losses, logs, grad_dtypes, leaf_dtypes


def test_bf16_training_tracks_fp32():
    fp32 = spmd(2, _train, None)
    bf16 = spmd(2, _train, (torch.bfloat16, torch.float32))
    for (l32, _, _, _), (l16, logs, grad_dtypes, leaf_dtypes) in zip(fp32, bf16):
        assert l32[-1] < 0.7 * l32[0]  # it trains
        # stated tolerance: every step's bf16 loss within 5% (relative) of the fp32 loss
        for a, b in zip(l32, l16):
            assert abs(a - b) <= 0.05 * a, (a, b)
        assert grad_dtypes == {"torch.float32"} and leaf_dtypes == {"torch.float32"}  # fp32 master shards
        assert any(kind == "all_gathers" for kind, _, _ in logs) and any(kind == "reduce_scatters" for kind, _, _ in logs)


def _bytes_worker():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    mp = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), mp_policy=mp)
    stats = params.plan.comm.stats
    stats.recording = True
    apply = fsdpfn.fsdp(model, reshard_after_forward=False)
    out_dtype = []
    loss, grads = fsdpfn.value_and_grad(lambda p: (out_dtype.append(apply(p, torch.randn(3, 8)).dtype), apply(p, torch.randn(3, 8)).float().sum())[1])(params)
    (unit,) = params.plan.units
    return list(stats.log), unit.gather[0].numel, out_dtype, {n: g.dtype for n, g in grads.params().items()}


def test_collectives_move_low_precision_bytes():
    for log, numel, out_dtype, grad_dtypes in spmd(2, _bytes_worker):
        gathers = [n for kind, _, n in log if kind == "all_gathers"]
        reduces = [n for kind, _, n in log if kind == "reduce_scatters"]
        assert gathers[0] == 2 * numel * 2  # world 2 x numel x 2 bytes (bf16)
        assert reduces[0] == 2 * numel * 4  # reduced in fp32
        assert out_dtype == [torch.bfloat16]
        assert set(grad_dtypes.values()) == {torch.float32}


def _torch_policy_worker(which):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    kind = TorchPolicy if which == "torch" else fsdpfn.MixedPrecisionPolicy
    model = RECIPE.build()
    mp = kind(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.0"], mp_policy=mp)
    apply = fsdpfn.fsdp(model)
    x = RECIPE.inputs(3, seed=1)
    loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).pow(2).mean())(params)
    return apply(params, x), {k: v.clone() for k, v in grads.params().items()}


def test_torch_mixed_precision_policy_is_taken_as_fsdpfn_s():
    """Code moving from FSDP2 keeps ``torch.distributed.fsdp.MixedPrecisionPolicy``: ``shard`` takes it
    field by field (bf16 compute, fp32 output and reduction here), the same as fsdpfn's own class."""
    for (out, grads), (ref_out, ref_grads) in zip(spmd(2, _torch_policy_worker, "torch"), spmd(2, _torch_policy_worker, "fsdpfn")):
        assert out.dtype == torch.float32
        assert torch.equal(out, ref_out)
        assert {str(g.dtype) for g in grads.values()} == {"torch.float32"}
        for k in ref_grads:
            assert torch.equal(grads[k], ref_grads[k]), k
