"""A unit whose output is a view of its own parameter: learned queries (DETR), prefix tokens, a
position table sliced and returned (``self.q.unsqueeze(0).expand(B, -1, -1)``).

The view outlives the unit's forward, so it outlives the gathered copy it points into: a library that
frees or reuses that buffer after the forward hands the next units garbage. torch's ``fully_shard``
(``reshard_after_forward=True``) frees the storage under the view and dies with a segmentation fault on
this model (torch 2.13, CPU). fsdpfn drops its own reference only, so the view keeps the buffer and the
result matches one process, in both layers, at every world size and reshard setting.
"""

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd


class _Queries(nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.q = nn.Parameter(torch.randn(n, d))

    def forward(self, x):
        return self.q.unsqueeze(0).expand(x.shape[0], -1, -1)  # a view of the gathered weight


class _Net(nn.Module):
    def __init__(self, n: int, d: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.queries = _Queries(n, d)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])

    def forward(self, x):
        q = self.queries(x)  # read again after every other unit has run (and resharded)
        h = self.inp(x).unsqueeze(1)
        for b in self.blocks:
            h = torch.tanh(b(h + q))
        return (h + q).pow(2).mean()


def _batch(rank: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(3, d, generator=torch.Generator().manual_seed(seed + 7 * rank))


def _reference(world: int, n: int, d: int, seed: int) -> dict[str, torch.Tensor]:
    model = _Net(n, d, seed)
    (sum(model(_batch(r, d, seed)) for r in range(world)) / world).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _sharded(layer: str, reshard: bool, n: int, d: int, seed: int) -> dict[str, torch.Tensor]:
    model = _Net(n, d, seed)
    x = _batch(dist.get_rank(), d, seed)
    units = ["queries", "blocks.0", "blocks.1", "blocks.2"]
    if layer == "functional":
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
        _, grads = fsdpfn.value_and_grad(fsdpfn.fsdp(model, reshard_after_forward=reshard))(params, x)
        return {k: grads[k] for k in grads.keys()}
    from fsdpfn.compat import fully_shard

    for name in units:
        fully_shard(model.get_submodule(name), reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    model(x).backward()
    return {k: p.grad.to_local() for k, p in model.named_parameters()}


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    n=st.integers(1, 5),
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    layer=st.sampled_from(["functional", "compat"]),
    reshard=st.booleans(),
)
def test_a_units_output_that_views_its_parameter_survives_the_reshard(world, n, d, seed, layer, reshard):
    want = _reference(world, n, d, seed)
    got = spmd(world, _sharded, layer, reshard, n, d, seed)
    for k, w in want.items():
        spec = fsdpfn.ShardSpec(tuple(w.shape), world)
        full = fsdpfn.unshard_tensors([g[k] for g in got], spec)
        torch.testing.assert_close(full, w, rtol=1e-5, atol=1e-6)


class _Table(nn.Module):
    def __init__(self, d: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.pos = nn.Parameter(torch.randn(5, d))
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x), self.pos[: x.shape[0]]  # the second output is a view of the parameter


def _kept_after_update(layer: str, units: list[str], d: int, seed: int):
    model = _Table(d, seed)
    x = _batch(dist.get_rank(), d, seed)
    if layer == "functional":
        import fsdpfn.optim as optim

        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
        apply = fsdpfn.fsdp(model)
        full = fsdpfn.unshard(params)
        (_, (_, pos)), grads = fsdpfn.value_and_grad(lambda p: (lambda o: (o[0].sum() + o[1].sum(), o))(apply(p, x)), has_aux=True)(params)
        before = {"pos": pos.detach().clone(), **{k: v.detach().clone() for k, v in full.items()}}
        opt = optim.sgd(lr=1.0)
        opt.update(grads, opt.init(params), params)  # in place on the shards
        after = {"pos": pos.detach(), **{k: v.detach() for k, v in full.items()}}
        return before, after
    from fsdpfn.compat import fully_shard

    for name in units:
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    out, pos = model(x)
    before = {"pos": pos.detach().clone()}
    (out.sum() + pos.sum()).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return before, {"pos": pos.detach()}


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    layer=st.sampled_from(["functional", "compat"]),
    units=st.sampled_from([[], ["lin"]]),
)
def test_outputs_that_view_a_parameter_keep_their_values_after_an_in_place_step(world, d, seed, layer, units):
    """A forward output that views a parameter, and ``unshard``'s full tensors, hold the values they were
    computed from after the optimizer updates the shards in place, at every world size. At world 1 the
    gathered parameter is the shard itself (nothing is moved), so before this they followed the update
    there, and there only."""
    for before, after in spmd(world, _kept_after_update, layer, units, d, seed):
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), k
