"""Changes to the module tree under a ``fully_shard`` root after ``fully_shard`` (``fsdpfn.compat.tree``).

A parameter nobody sharded (a submodule swapped, a new ``nn.Parameter``, adapters injected) would train
on each rank alone: torch's ``fully_shard`` lets a swapped submodule through and its ranks drift apart.
fsdpfn.compat refuses it by name (``tests/test_errors.py``: ``compat-unmanaged-param``,
``compat-replaced-module``); the changes that add no parameter keep training exactly as one process
does with the same change, and so does a tie made after ``fully_shard`` between two sharded parameters,
and a parametrization registered on a sharded weight (``torch.nn.utils.parametrize``: the same parameter
moves to ``...parametrizations.weight.original``; torch's ``fully_shard`` then fails in the forward).
"""

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.compat.tree import ModuleTree
from fsdpfn.testing import spmd


class _Net(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(5, width, bias=False)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, width, bias=False)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        return self.out(self.head(self.body(torch.relu(self.embed(x)))))


def _swap_activation(m: _Net) -> None:
    m.body[1] = nn.Sigmoid()  # a parameter-free module: nothing to shard


def _tie_square(m: _Net) -> None:
    m.head.weight = m.body[0].weight  # two sharded parameters of one shape: the tie is honoured


def _wrap_embed(m: _Net) -> None:
    m.embed = nn.Sequential(m.embed)  # the root's own parameter renamed ('embed.0.weight'): planned again


class _Symmetric(nn.Module):
    def forward(self, w):
        return (w + w.t()) / 2


def _parametrize_unit(m: _Net) -> None:
    # moves the body unit's weight (the same parameter) to body.0.parametrizations.weight.original
    torch.nn.utils.parametrize.register_parametrization(m.body[0], "weight", _Symmetric())


def _parametrize_root(m: _Net) -> None:
    torch.nn.utils.parametrize.register_parametrization(m.head, "weight", _Symmetric())


CHANGES = {
    "swap-activation": _swap_activation, "tie": _tie_square, "wrap": _wrap_embed,
    "parametrize-unit": _parametrize_unit, "parametrize-root": _parametrize_root,
}  # fmt: skip


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(width, seed, world, change, when, steps=3):
    model = _Net(width, seed)
    for step in range(steps):
        if step == when:
            CHANGES[change](model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # remade: a tie changes the parameter list
        opt.zero_grad()
        (sum(model(_batch(step, r)).pow(2).mean() for r in range(world)) / world).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def _worker(width, seed, change, when, steps=3):
    import torch.distributed as dist

    from fsdpfn.compat import fully_shard

    rank, model = dist.get_rank(), _Net(width, seed)
    fully_shard(model.body)
    fully_shard(model)
    for step in range(steps):
        if step == when:  # 1: after the root's first forward and step (the plan is rebuilt); 0: before
            CHANGES[change](model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        model(_batch(step, rank)).pow(2).mean().backward()
        opt.step()
    return {n: p.detach().to_local() for n, p in model.named_parameters(remove_duplicate=False)}


@settings(max_examples=8, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(2, 7), seed=st.integers(0, 2**16),
       change=st.sampled_from(sorted(CHANGES)), when=st.sampled_from([0, 1]))  # fmt: skip
@example(world=2, width=3, seed=0, change="wrap", when=1)
@example(world=2, width=3, seed=0, change="swap-activation", when=1)
@example(world=2, width=3, seed=0, change="parametrize-unit", when=1)
@example(world=2, width=3, seed=0, change="parametrize-root", when=0)
def test_a_tree_change_without_new_parameters_trains_as_one_process_does(world, width, seed, change, when):
    want = _reference(width, seed, world, change, when)
    results = spmd(world, _worker, width, seed, change, when)
    for name, full in want.items():
        got = fsdpfn.unshard_tensors([r[name] for r in results], fsdpfn.ShardSpec(tuple(full.shape), world))
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6, msg=lambda m: f"{change} {name}: {m}")


def test_module_tree_notices_replaced_added_and_removed_modules_and_parameters():
    def fresh():
        m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Tanh()))
        return m, ModuleTree(m)

    m, tree = fresh()
    assert not tree.changed()
    m[0].weight.data.add_(1.0)  # values are not structure
    assert not tree.changed()
    changes = {
        "replaced": lambda m: m[1].__setitem__(1, nn.Tanh()),
        "added": lambda m: m[1].add_module("extra", nn.Identity()),
        "removed": lambda m: delattr(m[1], "1"),
        "param added": lambda m: m[0].register_parameter("scale", nn.Parameter(torch.ones(1))),
        "param deleted": lambda m: delattr(m[0], "bias"),
    }
    for what, change in changes.items():
        m, tree = fresh()
        change(m)
        assert tree.changed(), what
