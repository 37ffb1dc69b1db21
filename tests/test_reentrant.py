"""Reentrant activation checkpoints (``fsdpfn.transform.reentrant``): ``torch.utils.checkpoint(...,
use_reentrant=True)`` around a unit (Hugging Face's ``gradient_checkpointing_enable()`` default, torch's
``checkpoint_wrapper(..., CheckpointImpl.REENTRANT)``) trains in the compat layer as in one process and
torch's ``fully_shard``; inside a unit, and anywhere under ``value_and_grad``, it is refused by name on
every rank (its parameters used to get zeros through ``value_and_grad`` and ``None`` through the compat
layer's backward, silently); the same model with the non-reentrant checkpoint still equals the
single-process reference, before and after a refusal."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import fsdpfn
import fsdpfn.compat
from fsdpfn.testing import spmd
from fsdpfn.transform.reentrant import has_reentrant_checkpoint

# float32: per-rank means summed over ranks round differently from one full-batch mean (world 3, seed 137:
# 2.7e-6 off in a weight, exactly as torch's fully_shard is); against torch's fully_shard the tests stay tight
F32_VS_ONE_PROCESS = dict(rtol=1e-4, atol=1e-5)

UNITS = ["blocks.0", "blocks.1", "blocks.2"]


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.inner = None  # None: no checkpoint inside; else use_reentrant for the checkpoint around fc1/fc2

    def _body(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x):
        if self.inner is not None and torch.is_grad_enabled():
            return x + checkpoint(self._body, x, use_reentrant=self.inner)
        return x + self._body(x)


class _Net(nn.Module):
    """Three residual blocks (the units) and a head; with ``stem`` a root layer before them, so the blocks'
    input depends on parameters (torch's ``autograd.grad`` then runs the reentrant region and refuses it
    itself); without, the input itself takes a gradient (else a reentrant region would record nothing at
    all, in a single process too), nothing connects the region to a parameter, and ``autograd.grad`` skips
    it silently."""

    def __init__(self, width: int, seed: int, stem: bool):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(3, width) if stem else nn.Identity()
        self.blocks = nn.ModuleList([_Block(width) for _ in range(3)])
        self.head = nn.Linear(width, 2)
        self.outer = None  # None: no checkpoint around blocks; else use_reentrant for it

    def set_checkpoint(self, where: str, reentrant: bool) -> None:
        self.outer = reentrant if where == "outer" else None
        for b in self.blocks:
            b.inner = reentrant if where == "inner" else None

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.outer) if self.outer is not None and torch.is_grad_enabled() else b(x)
        return self.head(x)


def _batch(rank: int, features: int) -> torch.Tensor:
    return torch.randn(4, features, generator=torch.Generator().manual_seed(1000 + rank), requires_grad=True)


def _reference(width: int, seed: int, stem: bool, world: int) -> dict[str, torch.Tensor]:
    model = _Net(width, seed, stem)
    loss = sum(model(_batch(r, 3 if stem else width)).pow(2).mean() for r in range(world)) / world
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _functional_worker(width, seed, stem, where, reshard):
    import torch.distributed as dist

    model = _Net(width, seed, stem)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    step = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).mean())
    x = _batch(dist.get_rank(), 3 if stem else width)
    model.set_checkpoint(where, reentrant=True)
    try:
        step(params, x)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    model.set_checkpoint(where, reentrant=False)
    _, grads = step(params, x)
    return refused, {k: grads[k] for k in grads.keys()}, None


def _compat_worker(width, seed, stem, where, reshard):
    import torch.distributed as dist

    from fsdpfn.compat import fully_shard

    model = _Net(width, seed, stem)
    for unit in UNITS:
        fully_shard(model.get_submodule(unit), reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    x = _batch(dist.get_rank(), 3 if stem else width)
    model.set_checkpoint(where, reentrant=True)
    try:
        model(x).pow(2).mean().backward()
        refused = ""
        trained = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    except RuntimeError as exc:
        refused, trained = str(exc), None
    model.zero_grad()
    model.set_checkpoint(where, reentrant=False)
    model(x).pow(2).mean().backward()
    return refused, {n: p.grad.to_local().clone() for n, p in model.named_parameters()}, trained


@settings(max_examples=10, deadline=None)
@given(
    world=st.integers(1, 3), width=st.integers(2, 6), seed=st.integers(0, 2**16), stem=st.booleans(),
    where=st.sampled_from(["outer", "inner"]), layer=st.sampled_from(["functional", "compat"]), reshard=st.booleans(),
)  # fmt: skip
def test_a_reentrant_checkpoint_trains_around_a_compat_unit_and_is_refused_elsewhere(world, width, seed, stem, where, layer, reshard):
    worker = _functional_worker if layer == "functional" else _compat_worker
    results = spmd(world, worker, width, seed, stem, where, reshard)
    want = _reference(width, seed, stem, world)
    trains = layer == "compat" and where == "outer"
    for refused, _, _ in results:
        if trains:
            assert refused == "", refused
            continue
        # every rank refuses, naming the fix
        assert "use_reentrant=True" in refused and "pass use_reentrant=False" in refused, refused
        if layer == "compat":
            assert refused.startswith("backward: unit(s) ") and "'blocks.0'" in refused, refused
        else:
            assert refused.startswith("value_and_grad: the function's graph holds"), refused
    for name, full in want.items():
        spec = fsdpfn.ShardSpec(tuple(full.shape), world)
        for which in (1, 2) if trains else (1,):  # the non-reentrant run; the reentrant one where it trains
            got = fsdpfn.unshard_tensors([r[which][name] for r in results], spec)
            torch.testing.assert_close(got, full, **F32_VS_ONE_PROCESS, msg=lambda m: f"{which} {name}: {m}")


def _wrapper_worker(width, seed, reshard, lib, steps):
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fully_shard = fsdpfn.compat.fully_shard if lib == "compat" else torch_fully_shard
    model = _Net(width, seed, stem=True)
    for i, b in enumerate(model.blocks):  # torchtitan's order: the checkpoint wrapper, then fully_shard on it
        model.blocks[i] = checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.REENTRANT)
        fully_shard(model.blocks[i], reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batch(dist.get_rank(), 3)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n.replace("._checkpoint_wrapped_module", ""): p.full_tensor() for n, p in model.named_parameters()}


@settings(max_examples=6, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(2, 6), seed=st.integers(0, 2**16), reshard=st.booleans())
def test_reentrant_checkpoint_wrapper_units_train_as_one_process_and_torch(world, width, seed, reshard):
    """``checkpoint_wrapper(block, CheckpointImpl.REENTRANT)`` as the unit (its node recomputes the block
    without the unit's hooks and differentiates that itself): two SGD steps equal one process on the
    whole batch and torch's ``fully_shard`` in the same setting."""
    model = _Net(width, seed, stem=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        (sum(model(_batch(r, 3)).pow(2).mean() for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    got = spmd(world, _wrapper_worker, width, seed, reshard, "compat", 2)[0]
    theirs = spmd(world, _wrapper_worker, width, seed, reshard, "torch", 2)[0]
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **F32_VS_ONE_PROCESS, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got[name], theirs[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"torch {name}: {m}")


@pytest.mark.parametrize("reentrant", [True, False])
def test_has_reentrant_checkpoint_finds_a_region_anywhere_in_the_graph(reentrant):
    x = torch.randn(3, requires_grad=True)
    deep = torch.sin(x)
    for _ in range(50):
        deep = deep * 1.01 + 0.5
    region = checkpoint(torch.cos, x, use_reentrant=reentrant)
    value = (deep + region.exp()).sum()
    assert has_reentrant_checkpoint(value) is reentrant
    assert not has_reentrant_checkpoint(torch.ones(2).sum())  # no graph at all


class _NormBlock(nn.Module):
    """A reentrant checkpoint inside the unit, around part of it: the norm before it (or the term after
    it) uses the unit's parameters outside, so the forward's gather takes gradients too."""

    def __init__(self, width: int, after: bool):
        super().__init__()
        self.norm, self.after = nn.LayerNorm(width), after
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def _body(self, h):
        return self.fc2(torch.tanh(self.fc1(h)))

    def forward(self, x):
        if self.after:
            return checkpoint(self._body, x, use_reentrant=True) + self.norm(x)
        return x + checkpoint(self._body, self.norm(x), use_reentrant=True)


def _inside_model(width, seed, after):
    # float64: a LayerNorm over two features turns last-bit differences of the reduction order into 1e-5
    # (fp32: torch's fully_shard and compat both 2.7-3.0e-5 off one process, world 3, width 2)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), *[_NormBlock(width, after) for _ in range(2)], nn.Linear(width, 2)).double()


def _inside_worker(width, seed, after, reshard, lib):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fully_shard = fsdpfn.compat.fully_shard if lib == "compat" else torch_fully_shard
    model = _inside_model(width, seed, after)
    for i in (1, 2):
        fully_shard(model[i], reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(_batch(dist.get_rank(), 3).double()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


@settings(max_examples=6, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(2, 6), seed=st.integers(0, 2**16), after=st.booleans(), reshard=st.booleans())
def test_a_reentrant_checkpoint_inside_a_unit_trains_when_the_unit_also_uses_parameters_outside_it(world, width, seed, after, reshard):
    """The inner backward leaves its gradients on the recompute's values; the unit's reduction (reached
    through the parameters used outside the region) carries them (``CallInfo.extra``). Two SGD steps
    equal one process and torch's ``fully_shard``."""
    model = _inside_model(width, seed, after)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        (sum(model(_batch(r, 3).double()).pow(2).mean() for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    got = spmd(world, _inside_worker, width, seed, after, reshard, "compat")[0]
    theirs = spmd(world, _inside_worker, width, seed, after, reshard, "torch")[0]
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got[name], theirs[name], rtol=1e-9, atol=1e-11, msg=lambda m: f"torch {name}: {m}")
