"""unshard / reduce / reshard across real gloo ranks (world 1..4), checked against single-process
references computed in the test process from the same seeds."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsdpfn
from fsdpfn import shard_tensor
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.models import ParamTree

F64 = (torch.float64,)


def _rank_grads(tree: ParamTree, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s full 'upstream gradients' y_r, one per trainable parameter (deterministic)."""
    g = torch.Generator().manual_seed(seed * 101 + rank)
    model = tree.build()
    return {
        n: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ---- workers (module level: they run in the spmd pool) ---------------------------------------
def _unshard_round_trip(tree, units):
    model = tree.build()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, donate=False)
    stats = params.plan.comm.stats
    stats.reset()
    full = fsdpfn.unshard(params)
    exact = {n: bool(torch.equal(_bits(full[n]), _bits(p.detach()))) and full[n].shape == p.shape for n, p in model.named_parameters()}
    buckets = sum(len(g.gather) for g in params.plan.groups)  # fused groups travel together
    back = fsdpfn.reshard(full, params)
    resharded = all(torch.equal(_bits(back[k]), _bits(params[k])) for k in params.plan.params)
    return exact, stats.all_gathers, buckets, resharded


def _adjoint_and_grads(tree, units, seed):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = tree.build()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, donate=False)
    y = _rank_grads(tree, rank, seed)
    stats = params.plan.comm.stats
    shards = {k: v.clone().requires_grad_(params.plan.requires_grad[k]) for k, v in params.items()}
    live = fsdpfn.Sharded(shards, params.plan)
    full = fsdpfn.unshard(live)
    # a frozen member's gathered tensor takes no gradient, whatever its bucket-mates take
    grad_flags_follow_plan = all(full[n].requires_grad == params.plan.requires_grad[n] for n in params.plan.params)
    lhs = sum((full[n].double() * y[n].double()).sum() for n in y) if y else torch.zeros((), dtype=torch.float64)
    stats.reset()
    if lhs.requires_grad:
        lhs.backward()
    backward_reduces = stats.reduce_scatters
    reduce_buckets = sum(len(g.reduce) for g in params.plan.groups)
    red_sum = fsdpfn.reduce(y, params, op="sum")
    red_avg = fsdpfn.reduce(y, params, op="avg")
    red_div = fsdpfn.reduce(y, params, op="sum", divide_by=3.0)
    rhs = sum((params[n].double() * red_sum[n].double()).sum() for n in y) if y else torch.zeros((), dtype=torch.float64)
    grads = {n: shards[n].grad for n in y}
    return dict(
        lhs=lhs.item(),
        rhs=rhs.item(),
        grads=grads,
        sum={n: red_sum[n] for n in y},
        avg={n: red_avg[n] for n in y},
        div={n: red_div[n] for n in y},
        frozen_none=all(red_sum[n] is None for n in params.plan.params if not params.plan.requires_grad[n]),
        grad_flags_follow_plan=grad_flags_follow_plan,
        backward_reduces=backward_reduces,
        reduce_buckets=reduce_buckets,
    )


# ---- properties -------------------------------------------------------------------------------
@given(world=fst.world_sizes(), data=st.data())
def test_unshard_equals_full_tensors(world, data):
    tree = data.draw(fst.param_trees())
    units = data.draw(fst.tree_unit_plans(tree))
    for exact, gathers, buckets, resharded in spmd(world, _unshard_round_trip, tree, units):
        assert all(exact.values()), exact
        assert resharded
        # exactly one all-gather per collective-group bucket, never one per parameter
        assert gathers == (buckets if world > 1 else 0)


@given(world=fst.world_sizes(), seed=st.integers(0, 1000), data=st.data())
def test_reduce_is_adjoint_of_unshard_and_scales_as_stated(world, seed, data):
    tree = data.draw(fst.param_trees(dtypes_=F64))
    units = data.draw(fst.tree_unit_plans(tree))
    out = spmd(world, _adjoint_and_grads, tree, units, seed)
    lhs = sum(o["lhs"] for o in out)
    rhs = sum(o["rhs"] for o in out)
    assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-9)
    model = tree.build()
    ys = [_rank_grads(tree, r, seed) for r in range(world)]
    for rank, o in enumerate(out):
        assert o["frozen_none"]
        assert o["grad_flags_follow_plan"]
        assert o["backward_reduces"] == (o["reduce_buckets"] if world > 1 else 0)
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            spec = fsdpfn.ShardSpec(tuple(p.shape), world)
            want = shard_tensor(sum(y[n] for y in ys), spec, rank)  # the single-process reduce-scatter
            torch.testing.assert_close(o["sum"][n], want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o["grads"][n], want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o["avg"][n], want / world, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o["div"][n], want / 3.0, rtol=1e-12, atol=1e-12)


# ---- torch.func and higher-order autograd through the collectives --------------------------------
def _func_worker(tree, seed):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    params = fsdpfn.shard(tree.build(), fsdpfn.init_mesh())
    g = torch.Generator().manual_seed(seed)
    full_t = {n: torch.randn(s.shape, generator=g, dtype=torch.float64) for n, s in params.specs.items()}
    tangent = fsdpfn.reshard(full_t, params)
    _, jvp_out = torch.func.jvp(lambda s: fsdpfn.unshard(s), (params,), (tangent,))
    jvp_ok = all(torch.equal(jvp_out[n], full_t[n]) for n in full_t)
    # vmap: a batch of 3 shard trees gathers to the batch of full trees, in one collective per bucket
    batch = [fsdpfn.reshard({n: t * (b + 1) for n, t in full_t.items()}, params) for b in range(3)]
    stacked = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *batch)
    stats = params.plan.comm.stats
    stats.reset()
    vm = torch.func.vmap(fsdpfn.unshard)(stacked)
    vmap_gathers = stats.all_gathers
    vmap_ok = all(torch.equal(vm[n][b], full_t[n] * (b + 1)) for n in full_t for b in range(3))
    # Hessian-vector product through unshard -> reduce -> unshard
    s = {k: v.clone().requires_grad_() for k, v in params.items()}
    p = fsdpfn.unshard(fsdpfn.Sharded(s, params.plan))
    c = rank + 1.0
    loss = sum((p[n] ** 3).sum() for n in p) * c
    grads = torch.autograd.grad(loss, list(s.values()), create_graph=True)
    gv = sum((g_ * tangent[k]).sum() for g_, k in zip(grads, s))
    hvp = torch.autograd.grad(gv, list(s.values()), allow_unused=True)
    return jvp_ok, vmap_ok, vmap_gathers, {k: h for k, h in zip(s, hvp)}, world


@given(world=st.integers(2, 3), seed=st.integers(0, 100), data=st.data())
def test_jvp_vmap_and_hvp_through_unshard(world, seed, data):
    tree = data.draw(fst.param_trees(dtypes_=F64, frozen=False, max_params=3))
    out = spmd(world, _func_worker, tree, seed)
    model = tree.build()
    g = torch.Generator().manual_seed(seed)
    full_t = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}
    total_c = sum(r + 1.0 for r in range(world))
    for rank, (jvp_ok, vmap_ok, vmap_gathers, hvp, w) in enumerate(out):
        assert jvp_ok and vmap_ok
        assert vmap_gathers == 1  # the whole batch travels in the one bucket of the root unit
        for n, p in model.named_parameters():
            want = fsdpfn.shard_tensor(6 * total_c * p.detach() * full_t[n], fsdpfn.ShardSpec(tuple(p.shape), w), rank)
            torch.testing.assert_close(hvp[n], want, rtol=1e-10, atol=1e-10)


def _mixed_worker():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].to(torch.bfloat16)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    full = fsdpfn.unshard(params)
    same = all(torch.equal(full[n], p) for n, p in model.named_parameters())
    s = {k: v.clone().requires_grad_() for k, v in params.items()}
    f = fsdpfn.unshard(fsdpfn.Sharded(s, params.plan))
    (f["0.weight"].sum() + f["1.weight"].float().sum()).backward()
    return same, len(params.plan.units[0].gather), s["1.weight"].grad.dtype, s["1.weight"].grad.float().unique().tolist()


def test_a_unit_mixing_fp32_and_bf16_round_trips():
    for same, buckets, dtype, values in spmd(2, _mixed_worker):
        assert same and buckets == 2 and dtype == torch.bfloat16
        assert values in ([2.0], [])  # 1 per rank, summed over 2 ranks


def _bad_unshard(case):
    params = fsdpfn.shard(torch.nn.Linear(3, 2), fsdpfn.init_mesh())
    other = fsdpfn.shard(torch.nn.Linear(5, 2), fsdpfn.init_mesh())
    if case == "not_sharded":
        fsdpfn.unshard({"weight": torch.zeros(3)})
    elif case == "wrong_shape":
        fsdpfn.unshard(params.replace({"weight": other["weight"]}))
    elif case == "wrong_dtype":
        fsdpfn.unshard(params.replace({"bias": params["bias"].double()}))
    elif case == "not_tensor":
        fsdpfn.unshard(params.replace({"bias": 3}))
    elif case == "reduce_unknown":
        fsdpfn.reduce({"nope": torch.zeros(2)}, params)
    elif case == "reduce_op":
        fsdpfn.reduce({}, params, op="mean")
    elif case == "divide_by":
        fsdpfn.reduce({}, params, divide_by=0)
    elif case == "unknown_unit":
        fsdpfn.unshard(params, units=["blocks.0"])
    elif case == "reshard_shape":
        fsdpfn.reshard({"weight": torch.zeros(3, 3), "bias": torch.zeros(2)}, params)
    elif case == "reduce_transposed":  # same numel: at world 1 it was reshaped into place, silently
        fsdpfn.reduce({"weight": torch.zeros(3, 2)}, params)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("not_sharded", TypeError, "expected a fsdpfn.Sharded"),
        ("wrong_shape", ValueError, r"leaf 'weight' is \((1|2), 5\).*does not belong to this plan"),
        ("wrong_dtype", ValueError, r"leaf 'bias' is \((1|2),\) torch.float64"),
        ("not_tensor", TypeError, "leaf 'bias' is int"),
        ("reduce_unknown", KeyError, r"nope\W* is not a parameter of this plan"),
        ("reduce_op", ValueError, "op='mean' is not a reduction"),
        ("divide_by", ValueError, "divide_by=0 must be a positive number"),
        ("unknown_unit", KeyError, r"no unit \W*blocks.0"),
        ("reshard_shape", ValueError, r"'weight' has shape \(3, 3\), the plan says \(2, 3\)"),
        ("reduce_transposed", ValueError, r"reduce: gradient of 'weight' has shape \(3, 2\), expected \(2, 3\)"),
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_bad_input_to_ops_names_the_leaf(case, exc, match, world):
    with pytest.raises(exc, match=match):
        spmd(world, _bad_unshard, case)


def _batched_chain():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    from fsdpfn.ops.api import gather_collective

    g = gather_collective(params.plan, params.plan.units, 0.25)
    gb = g.batched()
    r, g2 = g.adjoint, g.adjoint.adjoint
    rb, g2b = gb.adjoint, gb.adjoint.adjoint
    return (
        gb.batch_ndim == rb.batch_ndim == g2b.batch_ndim == 1,
        rb.fqns == r.fqns and g2b.fqns == g2.fqns,  # the reduce's adjoint is gather' (trainable only)
        g2b.scale == g2.scale == 0.25,  # ... which carries the reduction's scale
        g2b.adjoint is rb,
    )


def test_batched_collectives_keep_the_adjoint_chain():
    for checks in spmd(2, _batched_chain):
        assert all(checks), checks


def _world_one_gather():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    out = {}
    for name, mp in (("plain", None), ("bf16", fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16))):
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0"], mp_policy=mp, donate=False)
        stats = params.plan.comm.stats
        stats.reset()
        full = fsdpfn.unshard(params)
        out[name] = {
            "aliases": all(full[k].data_ptr() == params[k].data_ptr() for k in params.keys()),
            "dtypes": {str(full[k].dtype) for k in params.keys()},
            "equal": all(torch.equal(full[k].float(), p.detach().to(full[k].dtype).float()) for k, p in model.named_parameters()),
            "counts": (stats.all_gathers, stats.reduce_scatters, stats.peak_gathered_bytes),
        }
        # the backward of the gather at world 1 is the identity times the reduction's scale
        g = fsdpfn.grad(lambda p: sum((v.float() ** 2).sum() for v in fsdpfn.unshard(p, op="sum").values()))(params)
        out[name]["grad_ok"] = all(
            torch.allclose(g[k], 2 * params[k].to(full[k].dtype).to(params[k].dtype), rtol=1e-2) for k in params.keys()
        )
    return out


def test_at_world_one_the_gather_moves_nothing_and_returns_copies():
    (out,) = spmd(1, _world_one_gather)
    # no collective; the full tensors are copies, not the shards (they keep their values when an
    # optimizer updates the shards in place, as at any other world size)
    assert not out["plain"]["aliases"] and out["plain"]["dtypes"] == {"torch.float32"}
    assert not out["bf16"]["aliases"] and out["bf16"]["dtypes"] == {"torch.bfloat16"}  # the cast is a copy
    for name in ("plain", "bf16"):
        assert out[name]["equal"] and out[name]["grad_ok"], name
        assert out[name]["counts"] == (0, 0, 0), name  # no collective, no gathered buffer


def _reduce_then_reuse(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0"])
    acc = {k: torch.randn(params.specs[k].shape) for k in params.keys()}  # an accumulator the caller reuses
    out = {}
    for op in ("sum", "avg"):
        reduced = fsdpfn.reduce(acc, params, op=op)
        kept = {k: v.clone() for k, v in reduced.items()}
        saved = {k: v.clone() for k, v in acc.items()}
        for v in acc.values():
            v.zero_()  # the next accumulation round starts
        out[op] = all(torch.equal(reduced[k], kept[k]) for k in kept)
        for k, v in saved.items():
            acc[k].copy_(v)
    full = fsdpfn.unshard(params)
    snap = {k: v.clone() for k, v in full.items()}
    for v in params.values():
        v.add_(1.0)  # an in-place optimizer step
    out["unshard"] = all(torch.equal(full[k], snap[k]) for k in snap)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_reduce_and_unshard_results_share_no_memory_with_their_inputs(world):
    """At world 1 nothing is moved, and the results were the inputs themselves there (only there): an
    accumulator zeroed for the next round zeroed the reduced gradients, an in-place step changed the
    unsharded copy."""
    for out in spmd(world, _reduce_then_reuse, 3):
        assert out == {"sum": True, "avg": True, "unshard": True}
