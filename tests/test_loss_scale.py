"""fsdpfn.optim.loss_scale: torch.amp.GradScaler's rule on sharded gradients, the same decision on every rank."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst

STEPS = 5
LR = 0.05


def _batch(recipe, rank, step, poisoned):
    x = recipe.inputs(2, seed=100 * step + rank)
    return x * float("inf") if (step, rank) in poisoned else x  # an overflowing microbatch on that rank


def _sharded_run(recipe, units, kw, poisoned):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = recipe.build()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units)
    apply = fsdpfn.fsdp(model)
    opt = fsdpfn.optim.sgd(lr=LR, momentum=0.9)
    opt_state = opt.init(params)
    ls = fsdpfn.optim.loss_scale(**kw)
    ls_state = ls.init()
    trace = []
    for step in range(STEPS):
        x = _batch(recipe, rank, step, poisoned)
        _, grads = fsdpfn.value_and_grad(lambda p: ls.scale(apply(p, x).pow(2).mean(), ls_state))(params)
        grads, finite, ls_state = ls.unscale(grads, ls_state)
        if finite:
            params, opt_state = opt.update(grads, opt_state, params)
        trace.append((finite, ls_state.scale, ls_state.good_steps))
    return trace, fsdpfn.full_state_dict(params, rank0_only=False)


def _one_process(recipe, world, kw, poisoned):
    """torch.optim.SGD with torch.amp.GradScaler over every rank's batch (the mean over ranks)."""
    model = recipe.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=kw["init_scale"], growth_factor=kw["growth_factor"],
                                  backoff_factor=kw["backoff_factor"], growth_interval=kw["growth_interval"])
    trace = []
    for step in range(STEPS):
        loss = sum(model(_batch(recipe, r, step, poisoned)).pow(2).mean() for r in range(world)) / world
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        finite = not sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        scaler.update()
        trace.append((finite, scaler.get_scale(), None))
        opt.zero_grad()
        assert finite or scaler.get_scale() < before
    return trace, model.state_dict()


@settings(max_examples=int(os.environ.get("FSDPFN_LS_EXAMPLES", "8")), deadline=None)
@given(
    recipe=fst.model_recipes(min_width=4, min_seq=2),  # narrower layer norms amplify float32 rounding
    data=st.data(),
    world=st.integers(1, 3),
    init_exp=st.integers(0, 20),
    growth_factor=st.sampled_from([2.0, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25]),
    growth_interval=st.integers(1, 3),
)
def test_matches_grad_scaler_and_skips_the_same_steps_on_every_rank(
    recipe, data, world, init_exp, growth_factor, backoff_factor, growth_interval
):
    units = data.draw(fst.unit_plans(recipe))
    poisoned = data.draw(st.sets(st.tuples(st.integers(0, STEPS - 1), st.integers(0, world - 1)), max_size=2))
    kw = dict(init_scale=2.0**init_exp, growth_factor=growth_factor, backoff_factor=backoff_factor,
              growth_interval=growth_interval)
    want_trace, want = _one_process(recipe, world, kw, poisoned)
    for trace, got in spmd(world, _sharded_run, recipe, units, kw, poisoned):
        assert [(f, s) for f, s, _ in trace] == [(f, s) for f, s, _ in want_trace]
        for k, v in want.items():
            # float32, the ranks' sum in another order, 5 momentum steps: rounding, not a skipped update
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _one_rank_overflows(bad_rank, mesh_shape):
    """Only ``bad_rank``'s shard of the gradients is non-finite: every rank must skip."""
    import torch.distributed as dist

    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(mesh_shape), units=["0"])
    grads = torch.utils._pytree.tree_map(torch.ones_like, params)
    if dist.get_rank() == bad_rank:
        grads["0.weight"][0, 0] = float("inf")
    ls = fsdpfn.optim.loss_scale(8.0)
    grads, finite, state = ls.unscale(grads, ls.init())
    return finite, state, float(grads["2.weight"].flatten()[0]) if grads["2.weight"].numel() else None


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["fsdp2", "fsdp4", "hsdp2x2"])
def test_an_overflow_in_one_ranks_shard_skips_every_rank(mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    for rank, (finite, state, unscaled) in enumerate(spmd(world, _one_rank_overflows, world - 1, mesh_shape)):
        assert not finite and state == fsdpfn.optim.LossScaleState(4.0, 0), rank
        assert unscaled in (None, 1.0 / 8.0)  # divided in place


def test_the_state_is_saved_and_loaded_with_a_checkpoint(tmp_path):
    ls = fsdpfn.optim.loss_scale()
    state = ls.init()._replace(scale=1024.0, good_steps=7)
    fsdpfn.save(str(tmp_path / "ck"), {"loss_scale": state})
    assert fsdpfn.load(str(tmp_path / "ck"), {"loss_scale": ls.init()}) == {"loss_scale": state}
