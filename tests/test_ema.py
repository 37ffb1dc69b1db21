"""EMA of parameters as a shard-local tree_map: no collectives, equal to the single-process EMA of the
full parameters, saved and restored with the rest (and loadable at another world size)."""

import importlib.util
import pathlib

import torch
from torch.utils._pytree import tree_map

import fsdpfn
from fsdpfn.testing import spmd

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(ckpt):
    spec = importlib.util.spec_from_file_location("example_ema", ROOT / "examples" / "ema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(steps=6, decay=0.5, ckpt=ckpt)


def _load_elsewhere(ckpt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"])
    state = fsdpfn.optim.adamw(lr=1e-2).init(params)
    like = {"params": params, "ema": tree_map(torch.zeros_like, params), "opt": state, "step": 0}
    out = fsdpfn.load(ckpt, like)
    return dict(out["ema"].params()), out["step"]


def test_ema_is_shard_local_and_survives_a_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ema")
    out = spmd(2, _example, ckpt)
    for o in out:
        assert o["ema_collectives"] == 0  # the EMA never gathers
        assert o["restored_equal"]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    specs = {n: fsdpfn.ShardSpec(tuple(p.shape), 2) for n, p in model.named_parameters()}
    full_ema = {n: fsdpfn.unshard_tensors([o["ema"][n] for o in out], s) for n, s in specs.items()}
    # the EMA is between the initial and final parameters, and differs from the final ones
    full_params = {n: fsdpfn.unshard_tensors([o["params"][n] for o in out], s) for n, s in specs.items()}
    assert any(not torch.equal(full_ema[n], full_params[n]) for n in specs)
    # loaded at world 3, the gathered EMA is the same tensor
    loaded = spmd(3, _load_elsewhere, ckpt)
    for n in specs:
        spec3 = fsdpfn.ShardSpec(specs[n].shape, 3)
        assert torch.equal(fsdpfn.unshard_tensors([ema[n] for ema, _ in loaded], spec3), full_ema[n])
    assert all(step == 6 for _, step in loaded)


def _ema_reference():
    # the same EMA computed on full single-process parameters, step by step
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"])
    apply = fsdpfn.fsdp(model)
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    ema_full = {k: v.clone() for k, v in fsdpfn.unshard(params).items()}
    ema = tree_map(torch.clone, params)
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        _, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x), x.sum(-1, keepdim=True)))(params)
        params, state = opt.update(grads, state, params)
        ema = tree_map(lambda e, p: e.lerp_(p, 0.25), ema, params)
        full = fsdpfn.unshard(params)
        ema_full = {k: v.lerp(full[k], 0.25) for k, v in ema_full.items()}
    gathered = fsdpfn.unshard(ema)
    return all(torch.allclose(gathered[k], ema_full[k], rtol=0, atol=1e-7) for k in ema_full)


def test_shard_local_ema_equals_the_ema_of_full_parameters():
    assert spmd(3, _ema_reference) == [True, True, True]
