"""An optimizer holding parameters ``fully_shard`` replaced (``fsdpfn.compat.replaced_params``).

An optimizer made from ``model.parameters()`` before ``fully_shard`` holds the plain parameters that
``fully_shard`` swapped for ``DTensor`` ones: they never get a gradient, so torch's ``fully_shard``
skips them at every step and the model does not train, silently. fsdpfn refuses the step by name
(``tests/test_errors.py``: ``compat-optimizer-before``); an optimizer made after trains exactly as one
process does.
"""

import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn.testing import spmd


class _Blocks(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _batch(rank: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(3, width, generator=torch.Generator().manual_seed(seed + 101 * rank))


def _reference(world: int, width: int, seed: int, steps: int) -> dict[str, torch.Tensor]:
    model = _Blocks(width, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(steps):
        sum(model(_batch(r, width, seed)).pow(2).mean() for r in range(world)).div(world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(width: int, seed: int, before: list[int], steps: int):
    """Wrap the blocks in ``before`` first, make the optimizer, then wrap the rest and the root. Returns
    ``("refused", message, values unchanged)`` or ``("trained", full values)``."""
    from fsdpfn.compat import fully_shard

    model = _Blocks(width, seed)
    for i in before:
        fully_shard(model.blocks[i])
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for i in range(3):
        if i not in before:
            fully_shard(model.blocks[i])
    fully_shard(model)
    x = _batch(dist.get_rank(), width, seed)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        values = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        try:
            opt.step()
        except ValueError as e:
            after = {n: p.full_tensor() for n, p in model.named_parameters()}
            return "refused", str(e), all(torch.equal(values[n], after[n]) for n in values)
        opt.zero_grad()
    return "trained", {n: p.full_tensor().clone() for n, p in model.named_parameters()}


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    width=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    before=st.lists(st.integers(0, 2), unique=True, max_size=3),
    late=st.booleans(),
)
@example(world=2, width=3, seed=0, before=[0, 1, 2], late=True)
def test_a_step_is_refused_exactly_when_the_optimizer_holds_a_replaced_parameter(world, width, seed, before, late):
    """``late``: the optimizer is made after every ``fully_shard`` (then it trains as one process does);
    else after the blocks in ``before`` only, and its first step names the first parameter it holds that
    a later ``fully_shard`` replaced, on every rank, changing nothing."""
    if late:
        results = spmd(world, _train_late, width, seed)
        want = _reference(world, width, seed, steps=2)
        for got in results:
            assert got[0] == "trained"
            for n, w in want.items():
                torch.testing.assert_close(got[1][n], w, rtol=1e-5, atol=1e-6)
        return
    results = spmd(world, _train, width, seed, before, 2)
    order = [f"blocks.{i}.{a}" for i in range(3) for a in ("weight", "bias")] + ["head.weight", "head.bias"]
    stale = [k for k, n in enumerate(order) if not (n.startswith("blocks.") and int(n.split(".")[1]) in before)]
    first = stale[0]
    for kind, message, unchanged in results:
        assert kind == "refused"
        assert f"SGD's param_groups[0]['params'][{first}] is parameter '{order[first].rpartition('.')[2]}' of Linear" in message
        assert "Build the optimizer after fully_shard" in message
        assert unchanged


def _train_late(width: int, seed: int):
    return _train_after_wrapping(width, seed, steps=2)


def _train_after_wrapping(width: int, seed: int, steps: int):
    from fsdpfn.compat import fully_shard

    model = _Blocks(width, seed)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x = _batch(dist.get_rank(), width, seed)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return "trained", {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def _later_changes():
    """After good steps: a replaced parameter added to a group, and a parameter the user replaced by a
    new DTensor parameter after the optimizer was made. Both refused; an unrelated optimizer never is."""
    from fsdpfn.compat import fully_shard

    out = {}
    plain = nn.Linear(2, 2)
    original = plain.weight.detach().clone()
    model = _Blocks(3, 0)
    head_weight = model.head.weight
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = _batch(dist.get_rank(), 3, 0)
    model(x).sum().backward()
    opt.step()
    plain(torch.ones(1, 2)).sum().backward()
    other.step()  # an optimizer of parameters fully_shard never saw
    out["unrelated"] = not torch.equal(plain.weight.detach(), original)  # it stepped
    opt.add_param_group({"params": [head_weight]})
    try:
        opt.step()
    except ValueError as e:
        out["added"] = str(e)
    opt.param_groups.pop()
    w = model.blocks[0].weight
    model.blocks[0].weight = nn.Parameter(DTensor.from_local(w.to_local().detach() * 0.5, w.device_mesh, w.placements, shape=w.shape, stride=w.stride()))
    model(x).sum().backward()  # the root registers the new DTensor parameter as the sharded one
    try:
        opt.step()
    except ValueError as e:
        out["swapped"] = str(e)
    return out


def test_replaced_parameters_are_refused_when_they_reach_the_optimizer_later():
    for out in spmd(2, _later_changes):
        assert out["unrelated"]
        assert "SGD's param_groups[1]['params'][0] is parameter 'weight' of Linear as it was before fully_shard" in out["added"]
        assert "SGD's param_groups[0]['params'][0] is parameter 'weight' of Linear an earlier sharded parameter: a new one" in out["swapped"]
