"""Saved-tensor hooks around a sharded forward (``torch.autograd.graph.save_on_cpu()``, a user's activation
compression): autograd runs only the innermost hooks, and with resharding ``apply`` installs its own to
pack the tensors that alias a unit's gathered parameters, which silently switched the user's off for every
saved tensor inside the call (1 of 8 reached them on a 3-layer MLP). Now every saved tensor that is not a
unit's gathered parameter goes to the outer hooks, in both layers, and the gradients are unchanged."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd

UNITS = ["0", "2", "4"]


def _model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(300 + rank))


class _Outer:
    """Hooks that keep a scaled copy of each saved tensor (as compression would) and count what they see."""

    def __init__(self, params=()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.activations = 0  # saved tensors that are not parameters

    def pack(self, t):
        if t.untyped_storage().data_ptr() not in self.params:
            self.activations += 1
        return (2.0, t.detach().clone() * 2.0, t.requires_grad)

    def unpack(self, box):
        return box[1] / box[0]


def _reference(width, seed, world):
    model = _model(width, seed)
    outer = _Outer(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(outer.pack, outer.unpack):
        loss = sum(model(_batch(r)).pow(2).mean() for r in range(world)) / world
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, outer.activations // world


def _worker(width, seed, layer, reshard):
    import torch.distributed as dist

    model, x, outer = _model(width, seed), _batch(dist.get_rank()), _Outer()
    if layer == "functional":
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS)
        apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
        with torch.autograd.graph.saved_tensors_hooks(outer.pack, outer.unpack):
            _, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).pow(2).mean())(params)
        return outer.activations, {k: grads[k] for k in grads.keys()}
    from fsdpfn.compat import fully_shard

    for unit in UNITS:
        fully_shard(model.get_submodule(unit), reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    with torch.autograd.graph.saved_tensors_hooks(outer.pack, outer.unpack):
        loss = model(x).pow(2).mean()
    loss.backward()
    return outer.activations, {n: p.grad.to_local() for n, p in model.named_parameters()}


@settings(max_examples=8, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(2, 9), seed=st.integers(0, 2**16),
       layer=st.sampled_from(["functional", "compat"]), reshard=st.booleans())  # fmt: skip
def test_outer_saved_tensor_hooks_see_every_activation_and_gradients_stay(world, width, seed, layer, reshard):
    want, activations = _reference(width, seed, world)
    results = spmd(world, _worker, width, seed, layer, reshard)
    for seen, _ in results:
        assert seen >= activations, (seen, activations)  # every non-parameter saved tensor reached them
    for name, full in want.items():
        got = fsdpfn.unshard_tensors([grads[name] for _, grads in results], fsdpfn.ShardSpec(tuple(full.shape), world))
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
