"""Ranks that run different units, caught without ``FSDPFN_DEBUG`` (``fsdpfn.core.pass_check``).

A layer dropped at random with per-rank randomness (LayerDrop), or a branch on per-rank data, makes the
ranks issue different collectives. With equal sizes they paired up across units: block 2's gradients were
averaged with block 1's and training went on, 0.025 off one process with no error (torch's
``fully_shard`` does the same). Every backward now ends with one small all-reduce of a digest of the
collectives; a mismatch raises ``CollectivePlanError`` on every rank before a gradient is returned.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.core.guard import CollectivePlanError
from fsdpfn.testing import spmd

BLOCKS = 4


class _Net(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(BLOCKS)])  # equal sizes
        self.head = nn.Linear(width, 2)

    def forward(self, x, skip=()):
        for i, b in enumerate(self.blocks):
            if i not in skip:
                x = torch.tanh(b(x))
        return self.head(x)


def _step(layer: str, width: int, seed: int, skips: list[tuple[int, ...]], reshard: bool):
    """One training step with rank r skipping ``skips[r]``: ``("raised", message)`` or the gradients."""
    rank = dist.get_rank()
    model = _Net(width, seed)
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(seed + rank))
    try:
        if layer == "functional":
            # unfused: each unit its own collectives (fusion planned from different forwards would make
            # their sizes differ, and gloo aborts the process on a size mismatch)
            params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[f"blocks.{i}" for i in range(BLOCKS)], min_bucket_bytes=None)
            apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
            _, grads = fsdpfn.value_and_grad(lambda p, x: apply(p, x, skips[rank]).pow(2).mean())(params, x)
            return "trained", {k: grads[k] for k in grads.keys()}
        from fsdpfn.compat import fully_shard

        for b in model.blocks:
            fully_shard(b, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        model.set_reduce_scatter_unused_params(True)  # a block no rank ran gets zeros, as the functional layer's
        model(x, skips[rank]).pow(2).mean().backward()
        return "trained", {k: torch.zeros_like(p.to_local()) if p.grad is None else p.grad.to_local() for k, p in model.named_parameters()}
    except CollectivePlanError as e:
        return "raised", str(e)


def _reference(world: int, width: int, seed: int, skips: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """One process: the mean over ranks of each rank's loss, each with its own skipped blocks."""
    model = _Net(width, seed)
    xs = [torch.randn(3, width, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]
    (sum(model(x, skips[r]).pow(2).mean() for r, x in enumerate(xs)) / world).backward()
    return {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}


@settings(max_examples=10, deadline=None)
@given(
    world=st.integers(2, 3),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    dropped=st.lists(st.integers(0, BLOCKS - 1), min_size=3, max_size=3),
    layer=st.sampled_from(["functional", "compat"]),
)
@example(world=2, width=3, seed=0, dropped=[1, 2, 0], layer="functional")
@example(world=2, width=3, seed=0, dropped=[1, 2, 0], layer="compat")
@example(world=2, width=3, seed=0, dropped=[0, 3, 0], layer="compat")  # gloo aborted while compat kept its last block
def test_ranks_that_run_different_units_raise_together_or_train_exactly(world, width, seed, dropped, layer):
    """Each rank drops one block (all blocks the same size, so mismatched collectives still pair up).
    Every outcome is either the right gradients (those of the mean of each rank's own loss: the same
    block dropped everywhere) or an error on every rank. Units reshard after forward, so each is gathered
    when it runs: with units kept gathered, some divergences leave ranks with different numbers of
    collectives, which end in a timeout (FSDPFN_TIMEOUT) naming the unit rather than here."""
    skips = [(dropped[r],) for r in range(world)]
    results = spmd(world, _step, layer, width, seed, skips, True)
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1, "some ranks raised and others did not"
    if kinds == {"raised"}:
        assert len(set(skips)) > 1, "ranks that ran the same units were refused"
        for _, message in results:
            assert "ranks ran different collectives since the last check" in message and "FSDPFN_DEBUG=1" in message
        return
    want = _reference(world, width, seed, skips)
    for k, w in want.items():
        full = fsdpfn.unshard_tensors([r[1][k] for r in results], fsdpfn.ShardSpec(tuple(w.shape), world))
        torch.testing.assert_close(full, w, rtol=1e-5, atol=1e-6, msg=k)


def test_dropping_different_blocks_with_units_resharded_is_refused():
    """The silent case before: each unit gathered when it runs, so rank 0's block 2 paired with rank 1's block 1."""
    for layer in ("functional", "compat"):
        results = spmd(2, _step, layer, 3, 0, [(1,), (2,)], True)
        assert [kind for kind, _ in results] == ["raised", "raised"], (layer, results)


def _forward_only(skips: list[tuple[int, ...]]):
    """Evaluation forwards (no backward), each unit gathered only when it runs (no prefetch, which gathers
    in the plan's order whatever runs): a divergence is named at the next forward."""
    rank = dist.get_rank()
    model = _Net(4, 0)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[f"blocks.{i}" for i in range(BLOCKS)], min_bucket_bytes=None)
    apply = fsdpfn.fsdp(model, prefetch=0)
    x = torch.ones(2, 4)
    with torch.no_grad():
        apply(params, x, skips[rank])
        try:
            apply(params, x)
        except CollectivePlanError:
            return "raised at the next forward"
    return "not raised"


@pytest.mark.parametrize("skips, want", [([(1,), (2,)], "raised at the next forward"), ([(1,), (1,)], "not raised")])
def test_a_divergence_in_forward_only_passes_is_named_at_the_next_forward(skips, want):
    assert spmd(2, _forward_only, skips) == [want, want]


class _Gated(nn.Module):
    """A block whose ``gate`` runs on the ranks in ``users`` only, with a zero gradient (``0 * gate(x)``):
    a rank that did not run it gets a reduced gradient of zeros, which alone cannot tell it apart from a
    parameter no rank used."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 4)
        self.users: tuple[int, ...] = ()

    def forward(self, x):
        x = torch.tanh(self.body(x))
        return x + 0 * self.gate(x) if dist.get_rank() in self.users else x


def _gated_step(seed: int, users: tuple[int, ...]):
    from fsdpfn.compat import fully_shard

    model = nn.Sequential(_Gated(seed), nn.Linear(4, 2))
    model[0].users = users
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    try:
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + dist.get_rank()))).sum().backward()
    except RuntimeError as exc:
        return "raised", str(exc)
    opt.step()
    return "trained", {n: p.full_tensor() for n, p in model.named_parameters()}


@settings(max_examples=6, deadline=None)
@given(world=st.integers(2, 3), seed=st.integers(0, 2**16), users=st.lists(st.integers(0, 2), unique=True))
@example(world=2, seed=0, users=[0])
def test_a_parameter_used_on_some_ranks_with_a_zero_gradient_is_refused_on_every_rank(world, seed, users):
    """compat, ``set_reduce_scatter_unused_params`` off: a rank where the parameter got no gradient gives
    ``None`` (FSDP2's answer for a parameter no rank used), a rank that used it the reduced zeros; AdamW
    then decays the shard on one rank and skips it on the other: silently different weights. The pass
    check compares the ranks' sets of parameters without a gradient and every rank raises."""
    users = tuple(u for u in users if u < world)
    results = spmd(world, _gated_step, seed, users)
    if 0 < len(users) < world:
        for rank, (what, msg) in enumerate(results):
            assert what == "raised", (rank, users)
            assert "got a gradient on some ranks and none on others" in msg, msg
            assert ("'0.gate.weight'" in msg) == (rank not in users), msg
    else:  # every rank or none used it: the ranks agree (zeros everywhere, or None everywhere)
        assert all(what == "trained" for what, _ in results), results
        for name, value in results[0][1].items():
            for rank, (_, got) in enumerate(results[1:], 1):
                torch.testing.assert_close(got[name], value, msg=lambda m: f"rank {rank} {name}: {m}")


def _nested_step(skips: list[tuple[int, ...]]):
    """``_Net``'s blocks as units of a root nested on another mesh (``fully_shard`` on an HSDP mesh inside a
    ``fully_shard`` on the 1-D mesh), rank r skipping ``skips[r]``: what the backward did."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpfn.compat import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    flat = init_device_mesh("cpu", (world,))
    other = init_device_mesh("cpu", (1, world), mesh_dim_names=("rep", "shard"))
    net = _Net(3, 0)
    model = nn.Sequential(nn.Linear(3, 3), net)
    for b in net.blocks:
        fully_shard(b, mesh=other)
    fully_shard(net, mesh=other)
    fully_shard(model, mesh=flat)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    try:
        net.forward = lambda x, _f=net.forward: _f(x, skips[rank])
        model(x).pow(2).mean().backward()
    except CollectivePlanError as e:
        return "raised", str(e)
    return "trained", None


@pytest.mark.parametrize("skips", [[(1,), (2,)], [(1,), (1,)]])
def test_a_divergence_inside_a_root_nested_on_another_mesh_raises_on_every_rank(skips):
    """A root nested in another's forward reads its check at the end of the backward (its ranks need not
    meet in the middle of the enclosing backward): the divergence is still refused by every rank, before
    ``backward()`` returns; the same blocks everywhere train."""
    results = spmd(2, _nested_step, skips)
    if skips[0] != skips[1]:
        assert [kind for kind, _ in results] == ["raised", "raised"], results
        assert all("ranks ran different collectives since the last check" in msg for _, msg in results)
    else:
        assert [kind for kind, _ in results] == ["trained", "trained"], results
