"""A call's lifetime (``fsdpfn.transform.call``): a forward whose graph is dropped without a full backward
frees everything it made, in both layers.

Autograd's C++ nodes hold a call (the gather node's metadata, its hooks, the saved-tensor hooks' unpack);
a call that held graph tensors back, or a saved tensor packed as itself (it then holds its own node), made
a cycle through those nodes that Python's gc never frees. Only a backward through every gather broke it,
so an evaluation in grad mode, an early exit (a loss on an intermediate output) or ``retain_graph`` leaked
the call, its gathered root and every activation of the graph, each step (torch's ``fully_shard`` stays
flat there).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst

WIDTH, BLOCKS, STEPS, LR = 6, 3, 4, 0.1
MEASURED = (1, STEPS - 1)  # steps after which the live calls and graph tensors are counted (a gc pass each: ~0.5 s):
# the first step leaves what later steps reuse; a leak grows the count from the second step to the last


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        hidden = []
        for b in self.blocks:
            x = b(x)
            hidden.append(x)
        return self.head(x).square().mean(), hidden


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 + rank))


def _backward(model, x: torch.Tensor, pattern: str) -> None:
    """One step's forward(s) and backward(s) on a module (single process or compat)."""
    if pattern == "no_backward":
        model(x + 1.0)  # an evaluation in grad mode, its graph dropped
        model(x)[0].backward()
    elif pattern == "early_exit":
        model(x)[1][0].square().mean().backward()  # the later blocks and the head get no gradient
    else:  # retain_graph: two backwards over one graph, the second reaching the middle block only
        loss, hidden = model(x)
        loss.backward(retain_graph=True)
        (0.5 * hidden[1].square().mean()).backward()


def _reference(pattern: str, world: int) -> dict[str, torch.Tensor]:
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        for r in range(world):
            _backward(model, _batch(r), pattern)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= world
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _alive(plan) -> tuple[int, int]:
    """Live calls on ``plan``, and live tensors of an autograd graph in this process (a leaked graph
    keeps both; what earlier work in the process left can only go, never come)."""
    from fsdpfn.transform.call import Call

    gc.collect()
    objects = gc.get_objects()
    calls = sum(1 for o in objects if isinstance(o, Call) and o.plan is plan)
    graph = sum(1 for o in objects if isinstance(o, torch.Tensor) and o.grad_fn is not None and type(o.grad_fn).__name__ != "LocalShardsBackward")
    return calls, graph


def _steps(layer: str, pattern: str, units: list[str]) -> tuple[list[tuple[int, int]], dict[str, torch.Tensor] | None]:
    model = _Net()
    x = _batch(dist.get_rank())
    alive = []
    if layer == "compat":
        from fsdpfn.compat import fully_shard

        for u in units:
            fully_shard(model.get_submodule(u))
        fully_shard(model)
        from fsdpfn.compat.state import state_of

        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            _backward(model, x, pattern)
            opt.step()
            opt.zero_grad()
            if step in MEASURED:
                alive.append(_alive(state_of(model).root.plan))
        full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
        return alive, full
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    apply = fsdpfn.fsdp(model)

    def loss(p, x):
        out, hidden = apply(p, x)
        return hidden[0].square().mean() if pattern == "early_exit" else out

    grad = fsdpfn.value_and_grad(loss)
    opt = fsdpfn.optim.sgd(lr=LR)
    state = opt.init(params)
    for step in range(STEPS):
        if pattern == "no_backward":
            apply(params, (x + 1.0).requires_grad_())  # a graph through every unit, dropped
        _, grads = grad(params, x)
        params, state = opt.update(grads, state, params)
        del grads
        if step in MEASURED:
            alive.append(_alive(params.plan))
    full = fsdpfn.full_state_dict(params)
    return alive, ({k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else None)


@settings(max_examples=3, deadline=None)  # ~1.5 s a draw, beside the examples below
@given(
    world=fst.world_sizes(1, 3),
    layer=st.sampled_from(["functional", "compat"]),
    pattern=st.sampled_from(["no_backward", "early_exit", "retain_graph"]),
    units=st.lists(st.sampled_from([f"blocks.{i}" for i in range(BLOCKS)]), unique=True).map(sorted),
)
@example(world=2, layer="compat", pattern="no_backward", units=["blocks.0", "blocks.1", "blocks.2"])
@example(world=2, layer="functional", pattern="early_exit", units=["blocks.0", "blocks.1", "blocks.2"])
@example(world=1, layer="compat", pattern="retain_graph", units=["blocks.1"])
def test_a_dropped_graph_frees_its_call_and_activations(world, layer, pattern, units):
    if layer == "functional" and pattern == "retain_graph":
        pattern = "no_backward"  # value_and_grad runs one backward: no retain_graph in this layer
    ref = _reference(pattern, world)
    for rank, (alive, full) in enumerate(spmd(world, _steps, layer, pattern, units)):
        (calls, graph), (later_calls, later_graph) = alive
        assert later_calls == calls and later_graph <= graph, (
            f"rank {rank}: (calls, graph tensors) alive after steps {MEASURED} grow: {alive}"
        )
        if full is not None:
            for k, want in ref.items():
                torch.testing.assert_close(full[k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"rank {rank} {k}: {m}")
