"""The measured peak of a whole training step (forward, backward, AdamW update) stays under an analytic
bound, for random models, unit plans, fusion settings and world sizes (issue #15 item 2).

Per rank, with ``S`` the bytes of this rank's shards as padded (all trainable here; a trailing rank's
reduced gradients are padded segments too), ``G`` the largest collective
group's gathered bytes, ``T`` one optimizer temporary (none on CPU, where ``fsdpfn.optim.adamw`` runs the
fused kernel; elsewhere its foreach kernels run over groups of at most ``max(S / 8, largest shard)``), ``p``
the prefetch depth and ``A`` the bytes the model's own forward
saves for backward (measured on an unsharded copy: sharding does not change it):

* the update holds shards ``S``, AdamW's two moments ``2S``, the reduced gradients ``S`` and ``T``;
* forward and backward hold ``S + 2S``, at most ``S`` of reduced gradients, the gathered window (``p + 1``
  groups gathered, one group's full-size gradients and one more in its reduce-scatter: ``(p + 3) G``) and
  the activations (``2A``: saved tensors and their gradients).

On CPU from three ranks on, a reduction also holds the chunks of the peers beyond the first until it
sums them in, ``(W - 2) G / W`` (``W`` ranks). So ``peak <= 4S + max(T, (p + 3) G + (W - 2) G / W + 2A)``
plus a few KiB of scalars. A full-size optimizer temporary (the
extra copy issue #15 measured), a gathered buffer that outlives its unit, or a second copy of the shards
breaks it: ``test_the_bound_catches_a_full_size_optimizer_temporary`` checks that it is tight enough to.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn
import fsdpfn.optim as optim
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.memory import saved_bytes
from fsdpfn.testing.models import ModelRecipe

BATCH = 2
SLACK = 16 << 10  # step counters, the loss, Python-side scalars


def _step_peak(recipe, units, fuse, prefetch, seed, one_optimizer_group=False):
    import sys

    adamw_module = sys.modules["fsdpfn.optim.adamw"]  # the module (fsdpfn.optim.adamw is the function)
    grouping, fused = adamw_module.foreach_groups, adamw_module.FUSED_DEVICES
    if one_optimizer_group:  # what fsdpfn.optim did before #15: every shard in one foreach call
        adamw_module.foreach_groups = lambda fqns, tensors: [list(fqns)]
        adamw_module.FUSED_DEVICES = frozenset()
    try:
        return _measured_step(recipe, units, fuse, prefetch, seed)
    finally:  # the pool's processes live on: leave the optimizer as it was
        adamw_module.foreach_groups, adamw_module.FUSED_DEVICES = grouping, fused


def _measured_step(recipe, units, fuse, prefetch, seed):
    import sys

    import torch.distributed as dist

    from fsdpfn.testing.memory import memory_tracker

    rank, world = dist.get_rank(), dist.get_world_size()
    x = recipe.inputs(BATCH * world, seed)[rank * BATCH : (rank + 1) * BATCH]
    activations = saved_bytes(recipe.build(), x)
    model = recipe.build()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=fuse)
    apply = fsdpfn.fsdp(model, prefetch=prefetch)
    opt = optim.adamw(lr=1e-3)
    state = opt.init(params)
    loss_fn = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())
    _, grads = loss_fn(params)
    params, state = opt.update(grads, state, params)  # warm: moments and counters exist
    del grads
    # the smaller peak of two steps: gloo's completion callbacks free a collective's inputs at times that
    # vary from run to run, and a late one only ever adds to a step's peak (measured_step_peak does the same)
    peaks = []
    for _ in range(2):
        tracker = memory_tracker()
        resident = [*params.values(), *(t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)), x]
        tracker.track_external(*resident)
        with tracker:
            _, grads = loss_fn(params)
            params, state = opt.update(grads, state, params)
            del grads
        peaks.append(max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values()))
    peak = min(peaks)
    # a rank's shards, state and gradients are its padded segments (a trailing rank's rows are fewer)
    specs = params.plan.specs
    sizes = [math.prod(specs[f].padded_local_shape) * v.element_size() for f, v in params.items()]
    shards = sum(sizes)
    fused_on = sys.modules["fsdpfn.optim.adamw"].FUSED_DEVICES  # as _step_peak left it
    fused = all(v.device.type in fused_on for v in params.values())
    temporary = 0 if fused else max(shards / optim._common.FOREACH_PARTS, max(sizes))
    group = max(sum(lay.nbytes for lay in g.gather) * world for g in params.plan.groups)
    scratch = max(0, world - 2) * group // world  # a CPU reduction's chunks of the peers beyond the first
    bound = 4 * shards + max(temporary, (prefetch + 3) * group + scratch + 2 * activations) + SLACK
    return peak, bound, (shards, temporary, group, activations)


@st.composite
def _models(draw):
    """MLPs of 3-7 layers, 24-96 wide: parameters dominate (batch 2), as in a model sharded to fit."""
    widths = tuple(draw(st.lists(st.integers(24, 96), min_size=4, max_size=8)))
    return ModelRecipe("mlp", widths, draw(st.integers(0, 999)))


@settings(max_examples=10)
@given(
    world=fst.world_sizes(max_world=3),
    data=st.data(),
    fuse=st.sampled_from([None, "auto", 1 << 14]),
    prefetch=st.integers(0, 2),
    seed=st.integers(0, 99),
)
def test_a_steps_peak_stays_under_the_analytic_bound(world, data, fuse, prefetch, seed):
    recipe = data.draw(_models())
    units = data.draw(fst.unit_plans(recipe))
    for peak, bound, terms in spmd(world, _step_peak, recipe, units, fuse, prefetch, seed):
        assert peak <= bound, (peak, bound, terms)


def test_the_bound_catches_a_full_size_optimizer_temporary():
    recipe = ModelRecipe("mlp", (128,) * 13, 0)  # 12 units: the gathered window is small next to the shards
    units = recipe.unit_candidates()
    for peak, bound, terms in spmd(2, _step_peak, recipe, units, None, 1, 0):
        assert peak <= bound, (peak, bound, terms)
    for peak, bound, terms in spmd(2, _step_peak, recipe, units, None, 1, 0, True):
        assert peak > bound, (peak, bound, terms)  # one foreach call over every shard: a copy of them all
