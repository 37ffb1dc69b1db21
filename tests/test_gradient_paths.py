"""Gradients that meet other paths: terms on the shards themselves, gradients taken inside the function
being differentiated, and gradients of gradients.

- An L2 penalty on the shards inside a ``value_and_grad`` loss: each shard's gradient is its unit's
  reduction plus the penalty's own. The reduction used to enter autograd unfinished (left in flight for
  overlap), and autograd added the penalty to a buffer still being filled: 1e24 off at world 2, with no
  error. Reductions in flight now stay out of autograd (``fsdpfn.ops.deferred``).
- ``torch.autograd.grad`` inside the differentiated function (a sharpness-aware step's perturbation, a
  gradient norm): it got the same unfinished buffers. Its reductions now finish before it returns.
- A gradient-norm penalty (``create_graph=True``), both layers: exact, with the average's meaning (the
  mean over ranks of each rank's terms). ``fully_shard`` turned the gradients into constants before.
- MAML (fast weights from a ``create_graph`` gradient, gathered again): exact in both layers with summed
  reductions (every reduction the adjoint of its gather); refused by name with the average, which would
  take the mean twice along the fast weights' path (``errors.md``, ``second-order-avg``). The functional
  layer's ``fsdpfn.grad`` nests as JAX's does.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

import fsdpfn
from fsdpfn.testing import spmd

UNIT_PLANS = [[], ["0"], ["0", "2"], ["2", "4"]]
# what every property here draws: world size, model width, seed, unit plan, reshard after forward
CASES = dict(
    world=st.integers(1, 3),
    width=st.integers(1, 7),
    seed=st.integers(0, 2**16),
    units=st.sampled_from(UNIT_PLANS),
    reshard=st.booleans(),
)
LAYERS = st.sampled_from(["functional", "compat"])


def _model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


def _batch(rank: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 17 * rank))


def _full(results: list[dict[str, torch.Tensor]], like: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    return {k: fsdpfn.unshard_tensors([r[k] for r in results], fsdpfn.ShardSpec(tuple(v.shape), world)) for k, v in like.items()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-4, atol=1e-6, msg=k)


# --- first order: terms on the shards, gradients inside the function --------------------------------
def _penalised_reference(world: int, width: int, seed: int, lam: float) -> dict[str, torch.Tensor]:
    model = _model(width, seed)
    loss = sum(model(_batch(r, seed)).pow(2).mean() for r in range(world)) / world
    (loss + lam * sum(p.pow(2).sum() for p in model.parameters())).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _penalised(width: int, seed: int, lam: float, units: list[str], reshard: bool):
    model = _model(width, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    keys = list(params.keys())
    inner: dict[str, torch.Tensor] = {}

    def loss_fn(p, x):
        # a gradient taken inside the function (first order), then the loss with an L2 term on the shards
        g = torch.autograd.grad(apply(p, x).pow(2).mean(), [p[k] for k in keys])
        inner.update({k: gi.clone() for k, gi in zip(keys, g)})
        return apply(p, x).pow(2).mean() + lam * sum(p[k].pow(2).sum() for k in keys)

    x = _batch(dist.get_rank(), seed)
    _, grads = fsdpfn.value_and_grad(loss_fn)(params, x)
    plain = fsdpfn.grad(lambda p, x: apply(p, x).pow(2).mean())(params, x)
    return {k: grads[k] for k in keys}, inner, {k: plain[k] for k in keys}


@settings(max_examples=10, deadline=None)
@given(**CASES, lam=st.floats(0.001, 1.0))
@example(world=2, width=6, seed=0, lam=0.01, units=["0", "2"], reshard=False)
def test_terms_on_the_shards_and_gradients_inside_the_function_are_exact(world, width, seed, lam, units, reshard):
    want = _penalised_reference(world, width, seed, lam)
    results = spmd(world, _penalised, width, seed, lam, units, reshard)
    _close(_full([r[0] for r in results], want, world), want)
    for _, inner, plain in results:  # the gradient taken inside: finished, the same as fsdpfn.grad's
        for k in plain:
            torch.testing.assert_close(inner[k], plain[k], rtol=0, atol=0)


# --- second order ------------------------------------------------------------------------------------
def _gradient_penalty_reference(world: int, width: int, seed: int, lam: float) -> dict[str, torch.Tensor]:
    model = _model(width, seed)
    ps = dict(model.named_parameters())
    loss = sum(functional_call(model, ps, (_batch(r, seed),)).pow(2).mean() for r in range(world)) / world
    g = torch.autograd.grad(loss, list(ps.values()), create_graph=True)
    # the average's meaning: each rank's penalty on its shards is one term of a mean over ranks
    (loss + lam / world * sum(gi.pow(2).sum() for gi in g)).backward()
    return {k: p.grad for k, p in ps.items()}


def _gradient_penalty(layer: str, width: int, seed: int, lam: float, units: list[str], reshard: bool):
    model = _model(width, seed)
    x = _batch(dist.get_rank(), seed)
    if layer == "functional":
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
        apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
        keys = list(params.keys())

        def loss_fn(p, x):
            loss = apply(p, x).pow(2).mean()
            g = torch.autograd.grad(loss, [p[k] for k in keys], create_graph=True)
            return loss + lam * sum(gi.pow(2).sum() for gi in g)

        _, grads = fsdpfn.value_and_grad(loss_fn)(params, x)
        return {k: grads[k] for k in keys}
    from fsdpfn.compat import fully_shard

    for name in units:
        fully_shard(model.get_submodule(name), reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    loss = model(x).pow(2).mean()
    g = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    (loss + lam * sum(gi.to_local().pow(2).sum() for gi in g)).backward()
    return {k: p.grad.to_local() for k, p in model.named_parameters()}


@settings(max_examples=10, deadline=None)
@given(**CASES, lam=st.floats(0.01, 1.0), layer=LAYERS)
def test_a_penalty_on_the_gradients_is_exact_with_the_average(world, width, seed, lam, units, layer, reshard):
    want = _gradient_penalty_reference(world, width, seed, lam)
    _close(_full(spmd(world, _gradient_penalty, layer, width, seed, lam, units, reshard), want, world), want)


def _maml_reference(world: int, width: int, seed: int, lr: float) -> dict[str, torch.Tensor]:
    model = _model(width, seed)
    ps = dict(model.named_parameters())
    inner = sum(functional_call(model, ps, (_batch(r, seed),)).pow(2).mean() for r in range(world)) / world
    g = torch.autograd.grad(inner, list(ps.values()), create_graph=True)
    fast = {k: p - lr * gi for (k, p), gi in zip(ps.items(), g)}
    outer = sum(functional_call(model, fast, (_batch(r, seed) + 1,)).sin().mean() for r in range(world)) / world
    outer.backward()
    return {k: p.grad for k, p in ps.items()}


def _maml(layer: str, width: int, seed: int, lr: float, units: list[str], reshard: bool, op: str):
    """One MAML step; losses divided by the world size by hand when the reductions sum."""
    model = _model(width, seed)
    x = _batch(dist.get_rank(), seed)
    div = dist.get_world_size() if op == "sum" else 1
    try:
        if layer == "compat":
            from fsdpfn.compat import fully_shard

            for m in [model.get_submodule(n) for n in units] + [model]:
                fully_shard(m, reshard_after_forward=reshard)
                if op == "sum":
                    m.set_gradient_divide_factor(1.0)
            ps = dict(model.named_parameters())
            g = torch.autograd.grad(functional_call(model, ps, (x,)).pow(2).mean() / div, list(ps.values()), create_graph=True)
            fast = {k: p - lr * gi for (k, p), gi in zip(ps.items(), g)}
            (functional_call(model, fast, (x + 1,)).sin().mean() / div).backward()
            return {k: p.grad.to_local() for k, p in model.named_parameters()}
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
        apply = fsdpfn.fsdp(model, reshard_after_forward=reshard, reduce_op=op)

        def outer(p, x):
            g = fsdpfn.grad(lambda q, x: apply(q, x).pow(2).mean() / div)(p, x)  # nested: stays differentiable
            fast = tree_map(lambda a, b: a - lr * b, p, g)
            return apply(fast, x + 1).sin().mean() / div

        _, grads = fsdpfn.value_and_grad(outer)(params, x)
        return {k: grads[k] for k in grads.keys()}
    except RuntimeError as e:
        return str(e)


@settings(max_examples=10, deadline=None)
@given(**CASES, lr=st.floats(0.05, 0.5), layer=LAYERS)
@example(world=2, width=5, seed=0, lr=0.3, units=["0", "2"], layer="functional", reshard=True)
@example(world=2, width=5, seed=0, lr=0.3, units=["0", "2"], layer="compat", reshard=False)
def test_maml_is_exact_with_summed_reductions(world, width, seed, lr, units, layer, reshard):
    want = _maml_reference(world, width, seed, lr)
    results = spmd(world, _maml, layer, width, seed, lr, units, reshard, "sum")
    assert not any(isinstance(r, str) for r in results), results
    _close(_full(results, want, world), want)


@pytest.mark.parametrize("layer", ["functional", "compat"])
def test_maml_with_the_average_is_refused_on_every_rank_and_exact_at_world_one(layer):
    for r in spmd(2, _maml, layer, 5, 0, 0.3, ["0", "2"], True, "avg"):
        assert isinstance(r, str) and "reduced with reduce_op='avg'" in r and "Reduce with op='sum'" in r, r
    want = _maml_reference(1, 5, 0, 0.3)  # world one: the average is the sum, nothing to refuse
    _close(_full(spmd(1, _maml, layer, 5, 0, 0.3, ["0", "2"], True, "avg"), want, 1), want)
