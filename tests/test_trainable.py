"""Freezing and unfreezing parameters between steps in the functional layer (``fsdpfn.freeze`` /
``fsdpfn.unfreeze``), as ``requires_grad_`` does in a single process and under ``fully_shard``.

Before, a ``Sharded`` tree's trainable parameters were fixed by ``shard``: ``requires_grad_`` on the module
afterwards changed nothing (a backbone meant to be frozen for the first epochs silently trained on, and
layers meant to be unfrozen never trained). Now the tree's plan follows ``freeze``/``unfreeze``, the
optimizer state carries over (fresh state for a parameter at its first update, kept state for a frozen
one, as ``torch.optim``), and a flag set on the module is refused by name.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
import fsdpfn.optim as optim
from fsdpfn.layout.plan import ParamInfo, build_plan
from fsdpfn.layout.trainable import with_requires_grad
from fsdpfn.testing import spmd, torch_version

MODULES = ["inp", "blocks.0", "blocks.1", "blocks.2", "head"]
NAMES = [*MODULES, "blocks.1.0.bias", "head.weight"]  # a parameter alone: part of a unit frozen
UNITS = ["blocks.0", "blocks.1", "blocks.2"]


class _Net(nn.Module):
    def __init__(self, width: int, seed: int, frozen: frozenset = frozenset()):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(width, 2)
        _set_frozen(self, frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).pow(2).mean()


def _set_frozen(model: nn.Module, frozen: frozenset) -> None:
    model.requires_grad_(True)
    for name in frozen:
        part = model.get_parameter(name) if name not in MODULES else model.get_submodule(name)
        part.requires_grad_(False)


def _batch(rank: int, step: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 1000 * step + 7 * rank))


def _reference(world: int, case: dict) -> dict[str, torch.Tensor]:
    """One process on the whole batch, ``requires_grad_`` toggled before each step; torch's AdamW skips
    a parameter without a gradient and keeps its state."""
    schedule = case["schedule"]
    model = _Net(case["width"], case["seed"], schedule[0])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step, frozen in enumerate(schedule):
        _set_frozen(model, frozen)
        for r in range(world):
            loss = model(_batch(r, step, case["seed"])) / world
            if loss.requires_grad:  # not when every module is frozen
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _functional(case: dict, traced: bool = False) -> dict[str, torch.Tensor]:
    schedule = case["schedule"]
    model = _Net(case["width"], case["seed"], schedule[0])
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS, min_bucket_bytes=case["fuse"])
    apply = fsdpfn.fsdp(model, reshard_after_forward=case["reshard"])
    opt = optim.adamw(lr=0.05, weight_decay=0.1)
    state = opt.init(params)
    if traced:
        step_fn = fsdpfn.compile_step(apply, opt, backend="aot_eager")
    else:
        grad_fn = fsdpfn.value_and_grad(apply)

        def step_fn(params, state, x):
            loss, grads = grad_fn(params, x)
            for k in params.keys():  # a frozen parameter takes no gradient at all
                assert (grads[k] is None) == (not params.plan.requires_grad[k]), k
            return (loss, *opt.update(grads, state, params))

    for step, frozen in enumerate(schedule):
        params = fsdpfn.freeze(fsdpfn.unfreeze(params, ""), sorted(frozen))
        _, params, state = step_fn(params, state, _batch(dist.get_rank(), step, case["seed"]))
    return {k: v.clone() for k, v in fsdpfn.full_state_dict(params, rank0_only=False).items()}


def _run(case: dict, traced: bool = False) -> dict[str, float]:
    got = _functional(case, traced)
    want = _reference(dist.get_world_size(), case)
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


_frozen_sets = st.frozensets(st.sampled_from(NAMES))


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    schedule=st.lists(_frozen_sets, min_size=2, max_size=4),
    reshard=st.booleans(),
    fuse=st.sampled_from([None, "auto", 1 << 20]),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@example(world=2, schedule=[{"inp", "blocks.0"}, {"inp"}, set()], reshard=True, fuse=None, width=5, seed=0)
@example(world=2, schedule=[set(), {"blocks.1.0.bias", "head.weight"}], reshard=False, fuse="auto", width=5, seed=1)
@example(world=3, schedule=[set(MODULES), {"blocks.2"}], reshard=True, fuse=1 << 20, width=4, seed=2)
def test_freezing_and_unfreezing_between_steps_matches_one_process(world, schedule, reshard, fuse, width, seed):
    """A random schedule of frozen modules per step (the first as ``shard`` sees it): the functional
    layer with ``freeze``/``unfreeze`` and AdamW matches one process with ``requires_grad_`` and
    ``torch.optim.AdamW`` (state created at a parameter's first gradient, kept while it is frozen)."""
    case = dict(schedule=schedule, reshard=reshard, fuse=fuse, width=width, seed=seed)
    off = spmd(world, _run, case)[0]
    worst = max(off, key=off.get)
    assert off[worst] < 1e-5, f"{case} world {world}: {worst} off by {off[worst]:.3g} ({off})"


@pytest.mark.skipif(
    torch_version() < (2, 13), reason="compile_step refuses torch < 2.13 (test_traced.py checks the refusal)"
)
def test_compile_step_follows_freezing_between_steps():
    """Each new plan's first call runs eagerly, then traces: a frozen backbone, then all of it training."""
    schedule = [{"inp", "blocks.0"}] * 2 + [set()] * 2
    case = dict(schedule=schedule, reshard=True, fuse="auto", width=5, seed=3)
    off = spmd(2, _run, case, True)[0]
    worst = max(off, key=off.get)
    assert off[worst] < 1e-5, f"traced {case}: {worst} off by {off[worst]:.3g} ({off})"


def _plan_structure(plan):
    def buckets(layouts):
        return [(b.dtype, b.fqns) for b in layouts]

    return [(u.name, u.fqns, buckets(u.gather), buckets(u.reduce)) for u in plan.groups]


@settings(max_examples=40, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=6, max_size=6),
    start=st.lists(st.booleans(), min_size=6, max_size=6),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16]), min_size=6, max_size=6),
    reduce_dtype=st.sampled_from([None, torch.float32]),
    fuse=st.sampled_from([None, 1, 200]),
)
def test_a_derived_plan_is_the_plan_shard_would_build_with_those_flags(flags, start, dtypes, reduce_dtype, fuse):
    """``with_requires_grad`` gives the units and fused groups ``build_plan`` makes for the new flags
    (reduce buckets in the policy's dtype, frozen members in none), keeps one plan per pattern, and
    returns the origin for the origin's own flags."""
    policy = fsdpfn.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    units = ["", "a", "b"]

    def infos(rg):
        return [ParamInfo(f"p{i}", (3, i + 1), dtypes[i], rg[i], units[i % 3]) for i in range(6)]

    def build(rg):
        return build_plan(infos(rg), [], units, rank=0, world=2, reduce_dtype=policy.grad_reduce_dtype,
                          min_bucket_bytes=fuse, mp_policy=policy)  # fmt: skip

    origin = build(start)
    wanted = dict(zip(origin.params, flags))
    derived = with_requires_grad(origin, wanted)
    assert _plan_structure(derived) == _plan_structure(build(flags))
    assert dict(derived.requires_grad) == wanted
    assert with_requires_grad(derived, wanted) is derived
    assert with_requires_grad(derived, dict(zip(origin.params, start))) is origin
    assert derived is origin or derived.origin is origin


def _tied_and_errors() -> dict:
    model = _Net(3, 0)
    model.head2 = nn.Linear(3, 2)
    model.head2.weight = model.head.weight  # tied: one leaf, two names
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS)
    out = {}
    frozen = fsdpfn.freeze(params, "head2")  # by the alias
    out["tied"] = tuple(frozen.plan.requires_grad[k] for k in ("head.weight", "head.bias", "head2.bias"))
    ema = fsdpfn.freeze(torch.utils._pytree.tree_map(torch.clone, params), ["head2.weight", "head2.bias"])
    out["same_plan"] = ema.plan is frozen.plan and fsdpfn.unfreeze(frozen, "head2").plan is params.plan
    out["shared"] = frozen["inp.weight"] is params["inp.weight"]
    try:
        fsdpfn.freeze(params, "blocks.9")
    except ValueError as e:
        out["unknown"] = str(e)
    apply = fsdpfn.fsdp(model)
    grad_fn = fsdpfn.value_and_grad(lambda p, x: apply(p, x))
    grad_fn(params, torch.ones(2, 4))
    model.blocks[1].requires_grad_(False)  # the torch way: refused, it would change nothing
    try:
        grad_fn(params, torch.ones(2, 4))
    except ValueError as e:
        out["module_flag"] = str(e)
    frozen = fsdpfn.freeze(params, "blocks.1")  # module and tree agree now
    _, grads = grad_fn(frozen, torch.ones(2, 4))
    out["frozen_grad"] = grads["blocks.1.0.weight"]
    return out


def test_freeze_names_tied_parameters_shares_leaves_and_refuses_module_flags():
    out = spmd(2, _tied_and_errors)[0]
    assert out["tied"] == (False, True, False)
    assert out["same_plan"] and out["shared"]
    assert "'blocks.9' names no parameter or module" in out["unknown"] and "'blocks.1.0'" in out["unknown"]
    assert "'blocks.1.0.weight'" in out["module_flag"] and "fsdpfn.freeze(params" in out["module_flag"]
    assert out["frozen_grad"] is None
