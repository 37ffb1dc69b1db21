"""Forwards under ``torch.inference_mode`` between training steps, and two backwards through one
retained graph (``l1.backward(retain_graph=True); l2.backward()``).

An evaluation forward under ``inference_mode`` gathers units into inference tensors: a library that keeps
them (``reshard_after_forward=False``) or updates them in place later breaks the next training step;
torch's ``fully_shard`` raises there ("Inplace update to inference tensor outside InferenceMode", "Inference
tensors cannot be saved for backward"; torch 2.13). Two backwards through one graph must reduce both
gradients and accumulate them. fsdpfn matches one process in both cases, in both layers; and
``value_and_grad`` called under ``inference_mode`` or ``no_grad`` differentiates as ``torch.func.grad`` does.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd, torch_version


def _model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def _batch(rank: int, seed: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed + 13 * rank))


def _losses(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.pow(2).mean(), out.sum().tanh()


def _reference(world: int, width: int, seed: int, pattern: str) -> dict[str, torch.Tensor]:
    model = _model(width, seed)
    total = 0.0
    for r in range(world):
        out = model(_batch(r, seed))
        total = total + (sum(_losses(out)) if pattern == "retain" else out.pow(2).mean())
    (total / world).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _compat(width: int, seed: int, pattern: str, reshard: bool) -> dict[str, torch.Tensor]:
    from fsdpfn.compat import fully_shard

    model = _model(width, seed)
    for block in (model[0], model[2], model):
        fully_shard(block, reshard_after_forward=reshard)
    x = _batch(dist.get_rank(), seed)
    if pattern == "retain":
        l1, l2 = _losses(model(x))
        l1.backward(retain_graph=True)
        l2.backward()
    else:
        with torch.inference_mode():
            model(x)
        model(x).pow(2).mean().backward()
    return {k: p.grad.to_local() for k, p in model.named_parameters()}


def _functional(width: int, seed: int, reshard: bool, pattern: str) -> dict[str, torch.Tensor]:
    """``inference``: an inference_mode forward, then a step; ``inside_...``: the step itself called under
    ``torch.inference_mode()`` or ``torch.no_grad()`` (as ``torch.func.grad``, it differentiates anyway:
    under inference_mode it once returned zeros for every gradient, silently)."""
    model = _model(width, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"])
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    x = _batch(dist.get_rank(), seed)
    step = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).mean())
    if pattern == "inference":
        with torch.inference_mode():
            apply(params, x)
        _, grads = step(params, x)
    else:
        with torch.inference_mode() if pattern == "inside_inference" else torch.no_grad():
            _, grads = step(params, x)
    return {k: grads[k] for k in grads.keys()}


@settings(max_examples=10, deadline=None)
@given(
    world=st.integers(1, 3),
    width=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    case=st.sampled_from(
        ["compat-retain", "compat-inference", "functional-inference", "functional-inside_inference", "functional-inside_no_grad"]
    ),
    reshard=st.booleans(),
)
@example(world=2, width=3, seed=0, case="functional-inside_inference", reshard=True)
@example(world=2, width=1, seed=0, case="compat-inference", reshard=False)  # a copy kept from an inference forward
def test_inference_mode_forwards_and_retained_graphs_match_one_process(world, width, seed, case, reshard):
    layer, pattern = case.split("-")
    want = _reference(world, width, seed, pattern)
    if layer == "compat":
        got = spmd(world, _compat, width, seed, pattern, reshard)
    else:
        got = spmd(world, _functional, width, seed, reshard, pattern)
    for k, w in want.items():
        full = fsdpfn.unshard_tensors([g[k] for g in got], fsdpfn.ShardSpec(tuple(w.shape), world))
        torch.testing.assert_close(full, w, rtol=1e-5, atol=1e-6)


def _compiled_steps(width: int, seed: int, inference: bool) -> list[dict[str, torch.Tensor]]:
    model = _model(width, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"])
    apply = fsdpfn.fsdp(model)
    step = fsdpfn.compile_step(lambda p, x: apply(p, x).pow(2).mean(), backend="aot_eager")
    x = _batch(dist.get_rank(), seed)
    out = []
    for _ in range(2):  # the first call runs eagerly, the second compiled
        with torch.inference_mode() if inference else torch.enable_grad():
            _, grads = step(params, x)
        out.append({k: grads[k].clone() for k in grads.keys()})
    return out


@pytest.mark.skipif(torch_version() < (2, 13), reason="compile_step refuses torch < 2.13 (checked by test_traced.py::test_compile_step_refuses_where_it_is_not_verified)")
def test_compile_step_under_inference_mode_differentiates():
    """``compile_step`` called under ``inference_mode`` gives the gradients it gives outside (dynamo failed
    on it, and its eager call returned zeros)."""
    outside = spmd(2, _compiled_steps, 4, 0, False)
    inside = spmd(2, _compiled_steps, 4, 0, True)
    for rank, (a, b) in enumerate(zip(outside, inside)):
        for call, (ga, gb) in enumerate(zip(a, b)):
            for k in ga:
                torch.testing.assert_close(gb[k], ga[k], rtol=0, atol=0, msg=lambda m: f"rank {rank} call {call} {k}: {m}")


def _anomaly(width: int, seed: int, layer: str, nan: bool):
    """A step under ``torch.autograd.detect_anomaly()``: the gradients, or what was raised. ``nan``: the
    loss's gradient is NaN on every rank (``sqrt`` at 0)."""
    model = _model(width, seed)
    x = _batch(dist.get_rank(), seed)

    def loss(out):
        return out.pow(2).mean() + ((out - out.detach()).abs().sqrt().sum() if nan else 0)

    with torch.autograd.detect_anomaly():
        try:
            if layer == "compat":
                from fsdpfn.compat import fully_shard

                for block in (model[0], model[2], model):
                    fully_shard(block)
                loss(model(x)).backward()
                return {k: p.grad.to_local() for k, p in model.named_parameters()}
            params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"])
            apply = fsdpfn.fsdp(model)
            _, grads = fsdpfn.value_and_grad(lambda p: loss(apply(p, x)))(params)
            return {k: grads[k] for k in grads.keys()}
        except RuntimeError as exc:
            return str(exc)


@settings(max_examples=6, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(1, 6), seed=st.integers(0, 2**16), layer=st.sampled_from(["compat", "functional"]))
@example(world=2, width=3, seed=0, layer="compat")
def test_anomaly_mode_trains_and_names_a_nan_on_every_rank(world, width, seed, layer):
    """compat under ``detect_anomaly`` failed in every backward (DTensor had no rule for ``_is_any_true``,
    which anomaly mode runs on each gradient; torch's ``fully_shard`` works): it must train exactly, and a
    NaN gradient must be named on every rank."""
    want = _reference(world, width, seed, "inference")
    got = spmd(world, _anomaly, width, seed, layer, False)
    for k, w in want.items():
        full = fsdpfn.unshard_tensors([g[k] for g in got], fsdpfn.ShardSpec(tuple(w.shape), world))
        torch.testing.assert_close(full, w, rtol=1e-5, atol=1e-6)
    for rank, raised in enumerate(spmd(world, _anomaly, width, seed, layer, True)):
        assert isinstance(raised, str) and "returned nan values" in raised, (rank, raised)
