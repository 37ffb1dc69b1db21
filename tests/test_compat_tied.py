"""Tied parameters (one ``nn.Parameter`` used by two modules, e.g. a tied embedding and LM head) whose
uses land in different ``fully_shard`` calls.

FSDP2 refuses this at the first forward (``ValueError``: "Parameter ... is shared with a parameter already
managed by another FSDP group"); fsdpfn.compat keeps the tie, as ``fsdpfn.shard`` does: the parameter
stays one ``DTensor`` registered under every name, belongs to the innermost ``fully_shard`` module that
holds all its uses, and its gradient is the sum over both uses. Each case trains a few SGD steps at
world 2 and compares every parameter with an unsharded single-process model trained on the same data;
the named plans are the common layouts, the property draws any placement of the uses in units.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist
from torch import nn

from fsdpfn.testing import spmd, torch_version

V, D, BATCH, STEPS, WORLD = 6, 4, 3, 3, 2
TOL = dict(rtol=1e-5, atol=1e-6)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, V, (BATCH,), generator=torch.Generator().manual_seed(rank + 10 * step))


@functools.cache
def _reference() -> dict[str, torch.Tensor]:
    """One process, the mean of the ranks' losses: what data parallelism over ``WORLD`` ranks computes."""
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(model(_x(r, step)).pow(2).mean() for r in range(WORLD)) / WORLD).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _shard(lib: str, plan: list, reshard: bool) -> TiedLM:
    fully_shard = importlib.import_module(lib).fully_shard
    model = TiedLM()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for part in plan:
            mods = [model.get_submodule(n) for n in part] if isinstance(part, tuple) else model.get_submodule(part)
            fully_shard(mods, reshard_after_forward=reshard)
        fully_shard(model)
    return model


def _train(lib: str, plan: list, reshard: bool, convert: bool = False) -> tuple:
    model = _shard(lib, plan, reshard)
    if convert:  # module.to(...) after fully_shard converts each registration of the tied parameter
        model.double().float()
    tied = model.head.weight is model.emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        for step in range(STEPS):
            opt.zero_grad()
            model(_x(dist.get_rank(), step)).pow(2).mean().backward()
            opt.step()
    except ValueError as e:
        return "raised", str(e)
    names = [n for n, _ in model.named_parameters()]
    return tied, names, {n: p.full_tensor() for n, p in model.named_parameters()}, sorted(model.state_dict())


PLANS = {
    "embedding-and-head-units": ["emb", "head"],
    "embedding-unit": ["emb"],
    "head-unit": ["head"],
    "every-module-a-unit": ["emb", "mid", "head"],
    "grouped-embedding-and-head": [("emb", "head")],
}


@st.composite
def _plans(draw) -> list:
    """Which modules get a ``fully_shard`` call of their own before the root's (the embedding and the
    head possibly grouped in one call), in any order."""
    grouped = draw(st.booleans())
    parts = [("emb", "head")] if grouped else []
    for name in ("mid",) if grouped else ("emb", "mid", "head"):
        if draw(st.booleans()):
            parts.append(name)
    return draw(st.permutations(parts))


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_parameter_tied_across_fully_shard_calls_trains_as_one_parameter(plan):
    _check_trains_as_one(PLANS[plan], reshard=True)


@settings(max_examples=16)
@given(plan=_plans(), reshard=st.booleans())
def test_any_placement_of_the_tied_uses_trains_as_one_parameter(plan, reshard):
    _check_trains_as_one(plan, reshard)


def _check_trains_as_one(plan: list, reshard: bool) -> None:
    want = _reference()
    tied, names, got, keys = spmd(WORLD, _train, "fsdpfn.compat", plan, reshard)[0]
    assert tied, f"{plan}: fully_shard untied head.weight from emb.weight"
    assert names == list(want), (plan, names)  # one parameter, under its first name
    assert keys == sorted(["emb.weight", "head.weight", "mid.weight", "mid.bias"]), (plan, keys)
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, **TOL, msg=lambda m: f"{plan} reshard={reshard} {n}: {m}")


def test_the_tie_survives_module_to():
    want = _reference()
    tied, _, got, _ = spmd(WORLD, _train, "fsdpfn.compat", PLANS["embedding-and-head-units"], True, True)[0]
    assert tied, "model.double().float() untied head.weight from emb.weight"
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.skipif(torch_version() < (2, 13), reason="torch 2.11's fully_shard trained this plan too (it refuses since 2.13 at the latest)")
def test_torch_refuses_what_fsdpfn_keeps():
    """The difference is on purpose: torch's fully_shard raises where fsdpfn trains correctly."""
    status, msg = spmd(WORLD, _train, "torch.distributed.fsdp", PLANS["embedding-and-head-units"], True)[0]
    assert status == "raised" and "is shared with a parameter already managed by another FSDP group" in msg, msg


def _separate_roots() -> str:
    from fsdpfn.compat import fully_shard

    model = TiedLM()
    fully_shard(model.emb)
    fully_shard(model.head)  # no fully_shard on a module holding both: two roots share one parameter
    try:
        model.head(torch.zeros(1, D))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_parameter_tied_across_two_roots_is_refused_naming_it():
    msg = spmd(WORLD, _separate_roots)[0]
    assert msg.startswith("Parameter 'weight' is shared with a parameter already managed by another FSDP group"), msg
    assert "tied to 'weight' of FSDPEmbedding" in msg, msg
