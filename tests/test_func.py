"""torch.func transforms through fsdp(module): grad, vjp, jvp, jacrev, vmap (per-example grads) and
grad-of-grad (Hessian-vector products) over a Sharded tree equal the single-device results.

Every rank sees the same batch here and the reduction is the mean over ranks, so the sharded results
equal the single-device ones exactly (FSDP2's hooks cannot run under these transforms at all)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing.memory import settled_live_bytes
from fsdpfn.testing.models import ModelRecipe

RECIPES = [ModelRecipe("mlp", (3, 5, 4, 2), seed=1), ModelRecipe("transformer", (3, 4, 2, 5), seed=2, seq=3)]
UNITS = {"mlp": ["0", "2"], "transformer": ["blocks.0", "head"]}


def _data(recipe):
    x = recipe.inputs(4, seed=9, dtype=torch.float64)
    shape = (4, 2) if recipe.kind == "mlp" else (4, recipe.seq, 2)
    y = torch.randn(shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    return x, y


def _sharded_results(recipe, reshard):
    model = recipe.build(torch.float64)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS[recipe.kind])
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    x, y = _data(recipe)
    loss = lambda p, xi, yi: F.mse_loss(apply(p, xi), yi)  # noqa: E731
    tangent = torch.utils._pytree.tree_map(lambda t: torch.ones_like(t) * 0.5, params)
    out = {}
    out["grad"] = dict(grad(loss)(params, x, y).params())
    _, pullback = vjp(lambda p: apply(p, x), params)
    out["vjp"] = dict(pullback(torch.ones_like(y))[0].params())
    out["jvp"] = jvp(lambda p: apply(p, x), (params,), (tangent,))[1]
    out["jacrev"] = {k: v for k, v in jacrev(lambda p: apply(p, x[:1]).reshape(-1)[:3])(params).params().items()}
    per_example = vmap(grad(lambda p, xi, yi: loss(p, xi[None], yi[None])), in_dims=(None, 0, 0))(params, x, y)
    out["per_example"] = dict(per_example.params())

    world = params.plan.world

    def gv(p):
        # <grad F, t> is a sum over ranks of these local pieces; under reduce_op="avg" every scalar
        # differentiated through apply is read as one rank's term of a MEAN over ranks, hence * world
        g = grad(loss)(p, x, y)
        return sum((g[k] * tangent[k]).sum() for k in p.plan.params) * world

    out["hvp"] = dict(grad(gv)(params).params())
    return out


def _reference(recipe):
    model = recipe.build(torch.float64)
    full = {k: v.detach() for k, v in model.named_parameters()}
    x, y = _data(recipe)
    f = lambda p, xi: functional_call(model, p, (xi,))  # noqa: E731
    loss = lambda p, xi, yi: F.mse_loss(f(p, xi), yi)  # noqa: E731
    tangent = {k: torch.ones_like(v) * 0.5 for k, v in full.items()}
    ref = {}
    ref["grad"] = grad(loss)(full, x, y)
    _, pullback = vjp(lambda p: f(p, x), full)
    ref["vjp"] = pullback(torch.ones_like(y))[0]
    ref["jvp"] = jvp(lambda p: f(p, x), (full,), (tangent,))[1]
    ref["jacrev"] = jacrev(lambda p: f(p, x[:1]).reshape(-1)[:3])(full)
    ref["per_example"] = vmap(grad(lambda p, xi, yi: loss(p, xi[None], yi[None])), in_dims=(None, 0, 0))(full, x, y)

    def gv(p):
        g = grad(loss)(p, x, y)
        return sum((g[k] * tangent[k]).sum() for k in p)

    ref["hvp"] = grad(gv)(full)
    return ref


def _shard(t, full_shape, world, rank, batch_ndim):
    spec = fsdpfn.ShardSpec(full_shape, world)
    start, stop = spec.bounds(rank)
    if not full_shape:
        return t.reshape(*t.shape[:batch_ndim], 1)[..., start:stop]
    return t.narrow(batch_ndim, start, stop - start)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reshard", [False, True])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.kind)
def test_torch_func_transforms_through_apply(recipe, reshard, world):
    ref = _reference(recipe)
    shapes = {k: tuple(v.shape) for k, v in recipe.build().named_parameters()}
    for rank, out in enumerate(spmd(world, _sharded_results, recipe, reshard)):
        torch.testing.assert_close(out["jvp"], ref["jvp"], rtol=1e-10, atol=1e-12)
        for what, batch_ndim in [("grad", 0), ("vjp", 0), ("hvp", 0), ("per_example", 1), ("jacrev", 1)]:
            for k, shape in shapes.items():
                # the averaged reduction over identical per-rank batches equals the single-device value
                want = _shard(ref[what][k], shape, world, rank, batch_ndim)
                torch.testing.assert_close(out[what][k], want, rtol=1e-10, atol=1e-12, msg=f"{what} {k}")


def _remat_worker(reshard):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2", "4"])
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard if isinstance(reshard, bool) else (lambda unit: unit in reshard))
    stats = params.plan.comm.stats
    stats.reset()
    x = torch.randn(3, 6, requires_grad=False)
    seen = []

    def loss(p):
        out = apply(p, x)
        seen.append(settled_live_bytes(stats))  # right after the forward, inside torch.func.grad
        return out.pow(2).sum()

    g = grad(loss)(params)
    _, ref = fsdpfn.value_and_grad(loss)(params)
    same = all(torch.allclose(g[k], ref[k]) for k in params.plan.params)
    return seen[0], stats.all_gathers, same


def test_remat_keeps_the_reshard_memory_profile_under_torch_func_grad():
    for alive, gathers, same in spmd(2, _remat_worker, True):
        assert same
        assert alive == 0  # no unit stays gathered after the forward (the root unit owns nothing)
        # forward: 3 units; torch.func.grad backward recomputes each unit once (3); the autograd
        # reference call: 3 + 2 re-gathers (unit 0's weight is never needed in backward)
        assert gathers == 3 + 3 + 5
    kept = spmd(2, _remat_worker, False)
    for alive, gathers, same in kept:
        assert same and alive > 0 and gathers == 3 + 3
    everything = kept[0][0]
    for alive, gathers, same in spmd(2, _remat_worker, frozenset({"0", "2"})):
        # a predicate: units 0 and 2 run through remat, unit 4 stays gathered from its forward on
        assert same and 0 < alive < everything
        # forward 3; torch.func.grad's backward recomputes units 0 and 2 (2); the autograd reference:
        # 3 + unit 2 again (unit 0's weight is never needed, unit 4 stayed gathered)
        assert gathers == 3 + 2 + 4


class _DropoutNet(torch.nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(0.5), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _dropout_worker(width, seed, units, reshard):
    """Gradients of a model with dropout in every unit, at one random seed per rank: ``torch.func.grad``
    (which recomputes resharded units in backward, ``fsdpfn.transform.remat``) and ``value_and_grad``
    (which keeps the forward's saved tensors)."""
    import torch.distributed as dist

    model = _DropoutNet(width, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    loss = lambda p: apply(p, x).pow(2).mean()  # noqa: E731
    out = []
    for g in (grad(loss), lambda p: fsdpfn.value_and_grad(loss)(p)[1]):
        torch.manual_seed(seed + 17 * dist.get_rank())
        got = g(params)
        out.append({k: got[k].clone() for k in params.plan.params})
    return out


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    width=st.integers(2, 7),
    seed=st.integers(0, 2**16),
    units=st.lists(st.sampled_from(["blocks.0", "blocks.1", "blocks.2", "head"]), unique=True),
    reshard=st.booleans(),
)
@example(world=2, width=6, seed=0, units=["blocks.0", "blocks.1", "blocks.2"], reshard=True)
def test_dropout_under_torch_func_grad_recomputes_the_forwards_masks(world, width, seed, units, reshard):
    """A resharded unit's recomputation in ``torch.func.grad``'s backward draws the dropout masks its
    forward drew (it once drew new ones: gradients 4e-2 off, silently)."""
    for rank, (func, autograd) in enumerate(spmd(world, _dropout_worker, width, seed, units, reshard)):
        for k, want in autograd.items():
            torch.testing.assert_close(func[k], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")
