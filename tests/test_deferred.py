"""Deferred reduction (gradient accumulation) and explicit reduction semantics of value_and_grad."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst


def _deferred_worker(recipe, units, k, seed, reshard):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = recipe.build(torch.float64)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, donate=False)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    loss_fn = lambda p, x: apply(p, x).pow(2).mean()  # noqa: E731
    stats = params.plan.comm.stats
    batches = [recipe.inputs(2, seed=seed * 100 + 10 * rank + i, dtype=torch.float64) for i in range(k)]
    # k reduced microbatches, summed
    summed = None
    for x in batches:
        _, g = fsdpfn.value_and_grad(loss_fn)(params, x)
        summed = g if summed is None else torch.utils._pytree.tree_map(lambda a, b: None if a is None else a + b, summed, g)
    # k deferred microbatches, one reduction
    stats.reset()
    acc = None
    for x in batches:
        _, g = fsdpfn.value_and_grad(loss_fn, reduce=False)(params, x)
        acc = fsdpfn.accumulate(acc, g)
    no_reduce_during_accumulation = stats.reduce_scatters
    grads = fsdpfn.reduce(acc, params)
    reduces = stats.reduce_scatters
    buckets = sum(len(g.reduce) for g in params.plan.groups)  # a group: a unit, or units fused by "auto"
    return dict(summed.params()), dict(grads.params()), no_reduce_during_accumulation, reduces, buckets, repr(acc)


@settings(max_examples=50)
@given(world=fst.world_sizes(), data=st.data(), k=st.integers(1, 3), seed=st.integers(0, 99), reshard=st.booleans())
def test_deferred_reduction_equals_sum_of_reduced_microbatches(world, data, k, seed, reshard):
    recipe = data.draw(fst.model_recipes())
    units = data.draw(fst.unit_plans(recipe))
    for summed, deferred, during, reduces, buckets, text in spmd(world, _deferred_worker, recipe, units, k, seed, reshard):
        assert during == 0  # nothing is communicated while accumulating
        assert reduces == (buckets if world > 1 else 0)  # exactly one reduce-scatter per bucket
        assert text.startswith("Unreduced(")
        for n in summed:
            torch.testing.assert_close(deferred[n], summed[n], rtol=1e-10, atol=1e-12)


def _scaling_worker(dtype):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(dtype)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    x = torch.full((2, 4), float(rank + 1), dtype=dtype)
    out = {}
    for label, apply_kw, vg_kw in [
        ("avg", {}, {}),
        ("sum", dict(reduce_op="sum"), {}),
        ("div", dict(divide_by=8), {}),
        ("vg_sum", {}, dict(reduce_op="sum")),
        ("vg_div", {}, dict(divide_by=8)),
    ]:
        apply = fsdpfn.fsdp(model, **apply_kw)
        _, g = fsdpfn.value_and_grad(lambda p: apply(p, x).float().sum(), **vg_kw)(params)
        out[label] = dict(g.params())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduction_semantics_scale_exactly_as_stated(world, dtype):
    # each rank's gradient of sum(W x + b) w.r.t. W is sum_rows(x) = 2 (rank + 1) in every entry
    total = sum(2.0 * (r + 1) for r in range(world))
    expect = {"avg": total / world, "sum": total, "div": total / 8, "vg_sum": total, "vg_div": total / 8}
    for out in spmd(world, _scaling_worker, dtype):
        for label, grads in out.items():
            w = grads["weight"]
            assert w.dtype == dtype
            if w.numel():  # the expected values are exact in fp16/bf16, so the check is exact too
                assert torch.all(w.float() == torch.tensor(expect[label], dtype=dtype).float()), (label, w)


def _mixing_worker(case):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    apply = fsdpfn.fsdp(model)
    x = torch.ones(1, 2)
    _, reduced = fsdpfn.value_and_grad(lambda p: apply(p, x).sum())(params)
    _, unreduced = fsdpfn.value_and_grad(lambda p: apply(p, x).sum(), reduce=False)(params)
    if case == "accumulate":
        fsdpfn.accumulate(unreduced, reduced)
    elif case == "reduce_reduced":
        fsdpfn.reduce(reduced, params)
    elif case == "optimizer":
        opt = fsdpfn.optim.sgd(lr=0.1)
        opt.update(unreduced, opt.init(params), params)
    elif case == "other_plan":
        fsdpfn.reduce(unreduced, fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False))


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("accumulate", TypeError, "grads is already reduced"),
        ("reduce_reduced", TypeError, "already reduced"),
        ("optimizer", TypeError, "grads are Unreduced.*reduce them first"),
        ("other_plan", ValueError, "another plan"),
    ],
)
def test_mixing_reduced_and_unreduced_is_an_error(case, exc, match):
    with pytest.raises(exc, match=match):
        spmd(2, _mixing_worker, case)
