"""A unit's gather runs before the module's own forward pre-hooks (``fsdpfn.transform.unit_hooks``), as
FSDP2's does (``prepend=True``): ``torch.nn.utils.weight_norm`` and ``torch.nn.utils.prune`` compute the
weight from the module's parameters in such a hook. Registered before the unit's hook, they used to read
the module's placeholders: the functional layer trained weight_norm to 6.6e34 off one process, silently,
and the compat layer failed inside DTensor dispatch. Both layers now equal one process, before and after
a step."""

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune

import fsdpfn
from fsdpfn.testing import spmd

UNITS = ["0", "2"]


def _model(kind: str, width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    first, second = nn.Linear(5, width), nn.Linear(width, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated (its hook is what is tested)
        if kind == "weight_norm":
            first, second = nn.utils.weight_norm(first), nn.utils.weight_norm(second)
        else:  # a fixed random half of each weight pruned
            for layer in (first, second):
                mask = torch.rand(layer.weight.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
                prune.custom_from_mask(layer, "weight", mask)
    return nn.Sequential(first, nn.Tanh(), second)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(kind, width, seed, world, steps):
    model = _model(kind, width, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        (sum(model(_batch(step, r)).pow(2).mean() for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _worker(kind, width, seed, layer, steps):
    import torch.distributed as dist

    rank, model = dist.get_rank(), _model(kind, width, seed)
    if layer == "functional":
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS)
        apply = fsdpfn.fsdp(model)
        opt = fsdpfn.optim.sgd(0.1)
        state = opt.init(params)
        for step in range(steps):
            _, grads = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).mean())(params, _batch(step, rank))
            params, state = opt.update(grads, state, params)
        return {k: params[k] for k in params.keys()}
    from fsdpfn.compat import fully_shard

    for unit in UNITS:
        fully_shard(model.get_submodule(unit))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        model(_batch(step, rank)).pow(2).mean().backward()
        opt.step()
    return {n: p.detach().to_local() for n, p in model.named_parameters()}


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["weight_norm", "prune"]), world=st.integers(1, 3), width=st.integers(2, 8),
       seed=st.integers(0, 2**16), layer=st.sampled_from(["functional", "compat"]))  # fmt: skip
def test_a_modules_own_forward_pre_hooks_see_its_gathered_parameters(kind, world, width, seed, layer):
    want = _reference(kind, width, seed, world, steps=2)
    results = spmd(world, _worker, kind, width, seed, layer, 2)
    for name, full in want.items():
        got = fsdpfn.unshard_tensors([r[name] for r in results], fsdpfn.ShardSpec(tuple(full.shape), world))
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
