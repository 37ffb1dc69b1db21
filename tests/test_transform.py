"""fsdp(module) + value_and_grad against single-process autograd on the whole batch: random models, unit
plans, world sizes 1..4 and both reshard modes; collective counts; live gathered memory; checkpointing."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.memory import settled_live_bytes
from fsdpfn.testing.models import ModelRecipe

LOCAL_BATCH = 2


def _targets(recipe, batch, seed):
    out_dim = recipe.widths[-1] if recipe.kind == "mlp" else recipe.widths[2]
    shape = (batch, out_dim) if recipe.kind == "mlp" else (batch, recipe.seq, out_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 7))


def _local(t, rank):
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def _grads_worker(recipe, units, reshard, prefetch, seed, dtype=torch.float32, min_bucket_bytes=None, exchange_min_bytes=None):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = recipe.build(dtype)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=min_bucket_bytes, donate=False)
    if exchange_min_bytes is not None:  # move every bucket the way large ones move (straight between tensors)
        params.plan.comm.exchange_min_bytes = exchange_min_bytes
    apply = fsdpfn.fsdp(model, reshard_after_forward=_rule(reshard), prefetch=prefetch)
    x = _local(recipe.inputs(LOCAL_BATCH * world, seed, dtype), rank)
    y = _local(_targets(recipe, LOCAL_BATCH * world, seed).to(dtype), rank)
    stats = params.plan.comm.stats
    stats.reset()
    loss, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x), y))(params)
    plan = params.plan
    counts = (stats.all_gathers, stats.reduce_scatters)
    # one gather per group bucket in forward (a group: a unit, or units fused by min_bucket_bytes), at
    # most one more for each resharded group in backward (none when backward saved nothing from it); one
    # reduce-scatter per trainable dtype bucket of each group
    gathers = sum(len(g.gather) for g in plan.groups)
    # (a per-unit rule: the groups with a unit it reshards)
    wants = (lambda unit: reshard) if isinstance(reshard, bool) else _rule(reshard)
    regathers = sum(len(g.gather) for g in plan.groups if g.name and any(wants(u) for u in plan.members(g.name)))
    expect_reduces = sum(len(g.reduce) for g in plan.groups)
    untouched = all(p.grad is None for p in model.parameters())
    return loss, dict(grads.params()), counts, (gathers, regathers, expect_reduces), untouched


def _rule(reshard):
    """``fsdp``'s reshard_after_forward from a test parameter: a bool, or the set of units to reshard."""
    return reshard if isinstance(reshard, bool) else (lambda unit: unit in reshard)


def _reshard_modes(data, units):
    """True, False, or a random set of ``units`` (a per-unit predicate)."""
    if units and data.draw(st.booleans(), label="per-unit reshard"):
        return frozenset(data.draw(st.lists(st.sampled_from(units), unique=True), label="resharded units"))
    return data.draw(st.booleans(), label="reshard")


def _check_grads(recipe, units, world, reshard, prefetch, seed, dtype, tol, min_bucket_bytes=None, exchange_min_bytes=None):
    out = spmd(world, _grads_worker, recipe, units, reshard, prefetch, seed, dtype, min_bucket_bytes, exchange_min_bytes)
    ref = recipe.build(dtype)
    x = recipe.inputs(LOCAL_BATCH * world, seed, dtype)
    y = _targets(recipe, LOCAL_BATCH * world, seed).to(dtype)
    F.mse_loss(ref(x), y).backward()
    losses = [o[0] for o in out]
    torch.testing.assert_close(torch.stack(losses).mean(), F.mse_loss(ref(x), y).detach(), **tol)
    for rank, (_, grads, (n_gathers, n_reduces), (gathers, regathers, reduces), untouched) in enumerate(out):
        assert untouched  # apply mutated nothing on the module
        if world > 1:
            assert gathers <= n_gathers <= gathers + regathers and n_reduces == reduces
        for n, p in ref.named_parameters():
            want = fsdpfn.shard_tensor(p.grad, fsdpfn.ShardSpec(tuple(p.shape), world), rank)
            torch.testing.assert_close(grads[n], want, **tol)


# min_bucket_bytes: None/0 keep one group per unit; 1 fuses nothing either (every unit reaches it);
# the others fuse runs of consecutive units (nested ones included), up to all of them in one group;
# "auto" (shard's default) measures the link and fuses within its memory cap, agreed by every rank.
FUSION = st.sampled_from([None, 0, 1, 200, 1000, 10**9, "auto"])


# exchange_min_bytes: None keeps the core's choice (these small buckets are packed); 0 sends every
# bucket the way large CPU buckets go, each parameter's rows straight between the tensors.
@given(
    world=fst.world_sizes(), data=st.data(), prefetch=st.integers(0, 2), seed=st.integers(0, 99),
    fuse=FUSION, exchange=st.sampled_from([None, 0]),
)  # fmt: skip
def test_grads_match_single_process_autograd_f64(world, data, prefetch, seed, fuse, exchange):
    recipe = data.draw(fst.model_recipes())
    units = data.draw(fst.unit_plans(recipe))
    reshard = _reshard_modes(data, units)  # every unit, none, or a random set of them
    tol = dict(rtol=1e-10, atol=1e-12)
    _check_grads(recipe, units, world, reshard, prefetch, seed, torch.float64, tol, fuse, exchange)


@given(world=fst.world_sizes(), data=st.data(), reshard=st.booleans(), seed=st.integers(0, 99))
def test_grads_match_single_process_autograd_f32(world, data, reshard, seed):
    # float32: the per-rank means summed over ranks round differently from one full-batch mean; an
    # element that is a difference of larger terms (layer norm, attention) can lose ~1e-5 relative. The
    # float64 test above checks the semantics exactly.
    recipe = data.draw(fst.model_recipes(min_width=4, min_seq=2))
    units = data.draw(fst.unit_plans(recipe))
    _check_grads(recipe, units, world, reshard, 1, seed, torch.float32, dict(rtol=1e-4, atol=1e-5))


def _live_worker(reshard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2", "4"], donate=False)
    apply = fsdpfn.fsdp(model, reshard_after_forward=_rule(reshard))
    stats = params.plan.comm.stats
    x = torch.randn(3, 8)
    s = {k: v.detach().requires_grad_() for k, v in params.items()}
    out = apply(fsdpfn.Sharded(s, params.plan), x)
    after_forward = settled_live_bytes(stats)
    out.sum().backward()
    del out
    import gc

    gc.collect()
    counts = (stats.all_gathers, stats.reduce_scatters)
    return after_forward, settled_live_bytes(stats), [u.name for u in params.plan.units], counts


def test_after_forward_with_reshard_no_unit_buffer_is_alive():
    # the root unit owns nothing here, so with reshard nothing gathered may survive the forward
    for alive, after_backward, units, counts in spmd(2, _live_worker, True):
        assert units == ["0", "2", "4"]
        assert alive == 0 and after_backward == 0
        # units 2 and 4 are gathered twice (their weights are needed for the input gradient); unit 0
        # is not: its input needs no gradient, so backward never asks for its weight
        assert counts == (5, 3)
    for alive, after_backward, _, counts in spmd(2, _live_worker, False):
        assert alive > 0 and after_backward == 0  # without reshard every unit stays until its backward
        assert counts == (3, 3)


def test_a_reshard_predicate_keeps_the_units_it_excludes_gathered():
    # units 0 and 2 reshard; unit 4 (the last) stays gathered until its backward: after the forward only
    # its gathered bytes are alive, and backward gathers unit 2 again but not unit 4
    everything = spmd(2, _live_worker, False)[0][0]
    for alive, after_backward, _, counts in spmd(2, _live_worker, frozenset({"0", "2"})):
        assert 0 < alive < everything and after_backward == 0
        assert counts == (4, 3)


class _TwoLayers(nn.Module):
    """``b(tanh(a(x)))``, noting the gathered bytes alive when backward reaches ``a``'s output: the unit is
    re-gathered by then (``b``'s backward needed it), its gradients are being made."""

    def __init__(self, seen):
        super().__init__()
        self.a, self.b, self.seen = nn.Linear(8, 8), nn.Linear(8, 8), seen

    def forward(self, x):
        h = self.a(x)
        stats = self.stats
        h.register_hook(lambda g: self.seen.append(settled_live_bytes(stats)))
        return self.b(torch.tanh(h))


def _window_worker(prefetch):
    torch.manual_seed(0)
    seen = []
    model = nn.Sequential(*[_TwoLayers(seen) for _ in range(4)])
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "1", "2", "3"], min_bucket_bytes=None, donate=False)
    for block in model:
        block.stats = params.plan.comm.stats
    apply = fsdpfn.fsdp(model, prefetch=prefetch)
    x = torch.randn(3, 8, requires_grad=True)  # so that backward re-gathers every unit
    fsdpfn.value_and_grad(lambda p: apply(p, x).square().sum())(params)
    return seen, 2 * (8 * 8 + 8) * 4  # one unit's gathered bytes


@pytest.mark.parametrize("prefetch", [1, 2])
def test_on_cpu_a_units_gradients_are_made_with_no_other_unit_gathered(prefetch):
    # CPU: backward's prefetch of the units before k starts when k's reduction does, not when k is
    # re-gathered, so while k's gradients are made only k and the prefetch - 1 nearest units before it
    # are gathered (one unit of the window less); the first unit in backward has nothing prefetched yet
    for seen, unit in spmd(2, _window_worker, prefetch):
        in_flight = [0] + [min(prefetch - 1, k) for k in (2, 1, 0)]  # backward runs units 3, 2, 1, 0
        assert seen == [unit * (1 + n) for n in in_flight], seen


def _fused_worker(prefetch, min_bucket_bytes, reshard):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)], nn.Linear(6, 2))  # units 0..5 alike; root: "6"
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(6)], min_bucket_bytes=min_bucket_bytes, donate=False)
    apply = fsdpfn.fsdp(model, prefetch=prefetch, reshard_after_forward=reshard)
    stats = params.plan.comm.stats
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    x.requires_grad_()  # so that backward needs every unit's weight (re-gathers each one)
    import gc

    s = {k: v.detach().requires_grad_() for k, v in params.items()}
    # the forward's peak is the smaller of two forwards: gloo's worker thread drops its hold on a finished
    # gather's buffer a moment after the wait returned, so a late release can only add to one of them
    peaks = []
    for _ in range(2):
        out = None
        gc.collect()
        settled_live_bytes(stats)
        stats.reset()
        stats.recording = True
        out = apply(fsdpfn.Sharded(s, params.plan), x)
        peaks.append(stats.peak_gathered_bytes)
    forward_log, forward_peak = list(stats.log), min(peaks)
    out.square().sum().backward()
    grads = {k: v.grad for k, v in s.items()}
    del out
    gc.collect()
    sizes = {g.name: sum(lay.nbytes for lay in g.gather) * params.plan.world for g in params.plan.groups}
    return [g.name for g in params.plan.groups], forward_log, list(stats.log), forward_peak, settled_live_bytes(stats), sizes, grads


@pytest.mark.parametrize("fuse", [None, 300])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_collective_order_count_and_live_bytes_with_prefetch(prefetch, fuse):
    # each Linear(6, 6) gathers 42 floats = 168 bytes at world 2: 300 bytes fuse pairs of units
    plain = [out[-1] for out in spmd(2, _fused_worker, 0, None, True)]
    want = ["", "0+1", "2+3", "4+5"] if fuse else ["", "0", "1", "2", "3", "4", "5"]
    for rank, (groups, forward, whole, peak, after, sizes, grads) in enumerate(spmd(2, _fused_worker, prefetch, fuse, True)):
        assert groups == want
        labels = ["<root>", *want[1:]]
        # forward: the root, then every group once, in order, each one all-gather (prefetch only moves
        # the launch earlier, never adds one)
        assert [label for kind, label, _ in forward] == labels
        assert all(kind == "all_gathers" for kind, _, _ in forward)
        # backward: one reduce-scatter per group, none per unit; every resharded group re-gathered once
        assert sorted(label for kind, label, _ in whole if kind == "reduce_scatters") == sorted(labels)
        assert sorted(label for kind, label, _ in whole[len(forward):] if kind == "all_gathers") == sorted(labels[1:])
        # live gathered bytes in forward: the root (gathered for the whole forward), at most prefetch + 1
        # groups, plus the one whose parameters are being copied out of its just-gathered buffer
        biggest = max(sizes[g] for g in groups if g)
        assert peak <= sizes[""] + (prefetch + 2) * biggest
        # and prefetch really holds that many ahead (prefetch 0: the group and its copy-out)
        assert peak >= sizes[""] + max(2, prefetch + 1) * min(sizes[g] for g in groups if g)
        assert after == 0
        for k in grads:  # identical to the unfused run without prefetch: same sums in the same order
            assert torch.equal(grads[k], plain[rank][k]), k


def _ckpt(f, *args):
    return torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False)


class _CheckpointedInside(nn.Sequential):
    """A unit that checkpoints its first layer inside its own forward."""

    def forward(self, x):
        return self[2](self[1](_ckpt(self[0], x)))


class _Checkpointed(nn.Module):
    """``where``: "unit" checkpoints whole units, "inside" the layers inside each unit (and the root's
    head): a recompute there runs no unit hook."""

    def __init__(self, where="unit"):
        super().__init__()
        self.where = where
        block = nn.Sequential if where == "unit" else _CheckpointedInside
        self.blocks = nn.ModuleList(block(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for b in self.blocks:
            x = x + (_ckpt(b, x) if self.where == "unit" else b(x))
        return _ckpt(self.head, x) if self.where == "inside" else self.head(x)


def _ckpt_worker(reshard, where="unit"):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Checkpointed(where)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.0", "blocks.1", "blocks.2"], donate=False)
    # the module's own parameters are poisoned: a recompute that read them would be wrong
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))[rank * 4 : rank * 4 + 4]
    loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).pow(2).mean())(params)
    return loss, dict(grads.params())


@pytest.mark.parametrize("where", ["unit", "inside"])
@pytest.mark.parametrize("reshard", [True, False])
def test_activation_checkpointing_recomputes_with_gathered_parameters(reshard, where):
    torch.manual_seed(0)
    ref = _Checkpointed(where)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    ref(x).pow(2).mean().backward()
    for rank, (loss, grads) in enumerate(spmd(2, _ckpt_worker, reshard, where)):
        assert torch.isfinite(loss)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], fsdpfn.shard_tensor(p.grad, fsdpfn.ShardSpec(tuple(p.shape), 2), rank))


def _raising_backward_worker():
    """A backward that raises after the units' values went into their modules: nothing is left behind."""
    import torch.nn.modules.module as module_hooks

    torch.manual_seed(0)
    model = _Checkpointed("inside")
    own = {n: p for n, p in model.named_parameters()}
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.0", "blocks.1", "blocks.2"], donate=False)
    apply = fsdpfn.fsdp(model)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    loss_fn = lambda p: apply(p, x).pow(2).mean()  # noqa: E731
    want = fsdpfn.value_and_grad(loss_fn)(params)

    def fail(_grad):
        raise RuntimeError("boom in backward")

    handle = model.blocks[0].register_forward_hook(lambda _m, _a, out: out.register_hook(fail) and None)
    try:
        fsdpfn.value_and_grad(loss_fn)(params)
    except RuntimeError as e:
        assert "boom in backward" in str(e)
    else:
        raise AssertionError("the backward did not raise")
    handle.remove()
    hooks = len(module_hooks._global_forward_pre_hooks) + len(module_hooks._global_forward_hooks)
    got = fsdpfn.value_and_grad(loss_fn)(params)
    restored = all(p is own[n] for n, p in model.named_parameters())
    return hooks, restored, torch.equal(got[0], want[0]) and all(torch.equal(got[1][k], want[1][k]) for k in want[1].keys())


def test_a_backward_that_raises_leaves_no_values_or_hooks_behind():
    for hooks, restored, same in spmd(2, _raising_backward_worker):
        assert hooks == 0 and restored and same


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.block = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.frozen(torch.tanh(self.block(self.emb(idx)))))


def _tied_worker():
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _TiedLM()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["block", "frozen", "head"], donate=False)
    idx = torch.arange(8).reshape(2, 4) % 11
    apply = fsdpfn.fsdp(model)
    stats = params.plan.comm.stats
    stats.reset()
    loss, grads = fsdpfn.value_and_grad(lambda p: F.cross_entropy(apply(p, idx[rank : rank + 1]).flatten(0, 1), idx[rank]))(params)
    units = {u.name: (len(u.gather), len(u.reduce)) for u in params.plan.units}
    return dict(grads.params()), units, stats.reduce_scatters, list(params.keys())


def test_tied_embedding_and_frozen_leaves():
    torch.manual_seed(0)
    ref = _TiedLM()
    idx = torch.arange(8).reshape(2, 4) % 11
    F.cross_entropy(ref(idx).flatten(0, 1), idx.flatten()).backward()
    for rank, (grads, units, reduces, keys) in enumerate(spmd(2, _tied_worker)):
        assert "head.weight" not in keys  # the tied weight is one leaf
        assert units["frozen"] == (1, 0)  # a frozen unit is gathered but never reduced
        assert units[""] == (1, 1)  # tied weight lives in the root unit (common ancestor of both uses)
        assert reduces == 2  # root + block; the frozen unit costs no reduce-scatter
        assert grads["frozen.weight"] is None and grads["frozen.bias"] is None
        for n in ("emb.weight", "block.weight", "block.bias"):
            p = ref.get_parameter(n)
            torch.testing.assert_close(grads[n], fsdpfn.shard_tensor(p.grad, fsdpfn.ShardSpec(tuple(p.shape), 2), rank))


class _FrozenFirst(nn.Module):
    """A frozen layer and a trainable one in the same unit (and a frozen embedding beside a trainable head
    in the root): the frozen layer's input takes no gradient, so autograd must record nothing for it."""

    def __init__(self, ckpt=False):
        super().__init__()
        self.ckpt = ckpt
        self.emb = nn.Embedding(11, 6).requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(6, 6).requires_grad_(False), nn.GELU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        h = self.emb(idx)
        h = _ckpt(self.block, h) if self.ckpt else self.block(h)
        return self.head(h)


def _frozen_first_worker(ckpt):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _FrozenFirst(ckpt)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["block"], donate=False)
    apply = fsdpfn.fsdp(model)
    frozen_out = []
    model.block[0].register_forward_hook(lambda m, i, o: frozen_out.append(o.requires_grad))
    saved = []
    idx = torch.arange(8).reshape(2, 4) % 11
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, idx[rank : rank + 1]).pow(2).mean())(params)
    return frozen_out, saved, dict(grads.params())


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_frozen_layer_beside_trainable_ones_records_no_graph(ckpt):
    # The frozen Linear's weight shares its unit's gather with a trainable Linear; its gathered copy
    # used to require a gradient, so the frozen layer saved its input and GELU's for a backward whose
    # gradients were dropped (a step's peak 0.4% over FSDP2's on such a model).
    torch.manual_seed(0)
    ref = _FrozenFirst(ckpt)
    idx = torch.arange(8).reshape(2, 4) % 11
    ref(idx).pow(2).mean().backward()
    for rank, (frozen_out, saved, grads) in enumerate(spmd(2, _frozen_first_worker, ckpt)):
        assert frozen_out and not any(frozen_out)
        # the trainable Linear's input then takes no gradient either, so it saves its input only, not its
        # (6, 6) weight; the frozen one saves nothing (inside a checkpoint the recompute's values are checked)
        assert ckpt or (6, 6) not in saved, saved
        assert grads["block.0.weight"] is None and grads["emb.weight"] is None
        for n in ("block.2.weight", "block.2.bias", "head.weight", "head.bias"):
            p = ref.get_parameter(n)
            torch.testing.assert_close(grads[n], fsdpfn.shard_tensor(p.grad, fsdpfn.ShardSpec(tuple(p.shape), 2), rank))


def _bad_apply(case):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["1"], donate=False)
    apply = fsdpfn.fsdp(model)
    x = torch.randn(2, 3)
    if case == "other_module":
        other = fsdpfn.shard(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5)), fsdpfn.init_mesh())
        apply(other, x)
    elif case == "renamed":
        apply(fsdpfn.shard(nn.Sequential(nn.Linear(3, 4)), fsdpfn.init_mesh()), x)
    elif case == "stale":
        model[1] = nn.Linear(4, 3)
        apply(params, x)
    elif case == "dict":
        apply(dict(params.items()), x)
    elif case == "tensor_leaf":
        apply(params.replace({"0.weight": torch.zeros(1, 1)}), x)
    elif case == "nested":
        inner = fsdpfn.fsdp(model)

        class Evil(nn.Module):
            def forward(self, t):
                return inner(params, t)

        model[0] = nn.Sequential()
        model[0].register_forward_hook(lambda *a: None)
        apply(params, x)
    elif case == "non_scalar":
        fsdpfn.value_and_grad(lambda p: apply(p, x))(params)
    elif case == "bad_option":
        fsdpfn.fsdp(model, prefetch=-1)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("other_module", ValueError, r"leaf '1.weight' was sharded as \(5, 4\)"),
        ("renamed", ValueError, r"module parameters \['1.weight', '1.bias'\] are not in params"),
        ("stale", ValueError, r"leaf '1.weight' was sharded as \(2, 4\).*is now \(3, 4\).*stale"),
        ("dict", TypeError, "first argument must be the fsdpfn.Sharded"),
        ("tensor_leaf", ValueError, r"leaf '0.weight' is \(1, 1\)"),
        ("non_scalar", TypeError, r"must return a scalar tensor, got a tensor of shape \(2, 2\)"),
        ("bad_option", ValueError, "prefetch must be an int >= 0"),
    ],
)
def test_bad_input_to_apply_names_the_leaf(case, exc, match):
    with pytest.raises(exc, match=match):
        spmd(2, _bad_apply, case)


def test_repr_states_the_reduction():
    model = nn.Linear(2, 2)
    assert "reduction='avg'" in repr(fsdpfn.fsdp(model))
    assert "reduction='sum / 8'" in repr(fsdpfn.fsdp(model, divide_by=8))


def _modes_worker(seed):
    import torch.distributed as dist

    rank = dist.get_rank()
    recipe = ModelRecipe("transformer", (3, 6, 2, 5, 7), seed=seed, seq=3)
    model = recipe.build()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.0", "blocks.1", "head"], donate=False)
    x = recipe.inputs(2, seed=rank)
    out = {}
    for reshard in (True, False):
        for prefetch in (0, 1, 2):
            apply = fsdpfn.fsdp(model, reshard_after_forward=reshard, prefetch=prefetch)
            loss_fn = lambda p: apply(p, x).pow(2).mean()  # noqa: E731
            (loss, aux), grads = fsdpfn.value_and_grad(lambda p: (loss_fn(p), "aux"), has_aux=True)(params)
            only = fsdpfn.grad(loss_fn)(params)
            out[(reshard, prefetch)] = (loss, dict(grads.params()), dict(only.params()), aux)
    return out


def test_reshard_and_prefetch_modes_give_identical_results():
    for out in spmd(2, _modes_worker, 5):
        base_loss, base_grads, _, _ = out[(True, 0)]
        for (loss, grads, only, aux) in out.values():
            assert aux == "aux"
            assert torch.equal(loss, base_loss)
            for n in base_grads:
                assert torch.equal(grads[n], base_grads[n]) and torch.equal(only[n], base_grads[n])


def _stale_after_use():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    apply = fsdpfn.fsdp(model)
    apply(params, torch.ones(1, 3))  # validated once ...
    model[1] = nn.Linear(4, 3)  # ... then the module changes under the same params
    apply(params, torch.ones(1, 3))


def test_a_module_changed_after_a_call_is_still_caught():
    with pytest.raises(ValueError, match=r"leaf '1.weight' was sharded as \(2, 4\).*now \(3, 4\).*stale"):
        spmd(2, _stale_after_use)


class _Twice(nn.Module):
    """A unit whose forward runs twice per call (weight sharing across depth)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


def _twice_worker(reshard, calls):
    import torch.distributed as dist

    model = _Twice()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["block"], donate=False)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss_fn = lambda p: sum(apply(p, x).pow(2).sum() for _ in range(calls))  # noqa: E731
    _, grads = fsdpfn.value_and_grad(loss_fn)(params)
    return dict(grads.params())


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("reshard", [True, False])
def test_a_unit_gathered_twice_in_one_backward_gets_the_summed_gradient(reshard, calls):
    # Both gathers' reductions reach the same shard: each must be complete before autograd adds them.
    world = 2
    ref = _Twice()
    for r in range(world):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(r))
        (calls * ref(x).pow(2).sum() / world).backward()
    for rank, grads in enumerate(spmd(world, _twice_worker, reshard, calls)):
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], fsdpfn.shard_tensor(p.grad, fsdpfn.ShardSpec(tuple(p.shape), world), rank))


class _IdleMember(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.lin, self.idle = nn.Linear(a, b), nn.Linear(b, 3)

    def forward(self, x):
        return torch.tanh(self.lin(x))  # self.idle takes no part


class _Partly(nn.Module):
    """Blocks with an ``idle`` member forward never uses, some blocks skipped, an unused root Linear."""

    def __init__(self, widths, skipped):
        super().__init__()
        self.blocks = nn.ModuleList(_IdleMember(a, b) for a, b in zip(widths, widths[1:]))
        self.side = nn.Linear(2, 2)
        self.skipped = frozenset(skipped)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if i in self.skipped:  # a skipped block's parameters take no part
                x = torch.zeros(x.shape[0], b.lin.out_features)
            else:
                x = b(x)
        return x.pow(2).sum()


def _partly_worker(widths, skipped, units, fuse, seed):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = _Partly(widths, skipped)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=fuse)
    apply = fsdpfn.fsdp(model)
    x = torch.randn(2 * world, widths[0], generator=torch.Generator().manual_seed(seed))[2 * rank : 2 * rank + 2]
    _, grads = fsdpfn.value_and_grad(lambda p: apply(p, x))(params)
    _, unreduced = fsdpfn.value_and_grad(lambda p: apply(p, x), reduce=False)(params)
    return dict(grads.params()), dict(fsdpfn.reduce(unreduced, params).params())


@settings(max_examples=12, deadline=None)
@given(
    world=fst.world_sizes(1, 3),
    widths=st.lists(st.integers(1, 6), min_size=3, max_size=5),
    data=st.data(),
    fuse=st.sampled_from([None, 1000, 10**9, "auto"]),
    seed=st.integers(0, 99),
)
def test_a_parameter_forward_does_not_use_gets_zeros_whatever_the_buckets(world, widths, data, fuse, seed):
    """A block skipped in forward, a member its unit never uses, an unused root parameter: each gets a zero
    gradient (as torch.func.grad gives), whether or not a fused bucket carried it through a reduction, so
    the optimizer's update (weight decay, moments) does not depend on ``min_bucket_bytes``; the same zeros
    come out of ``reduce(value_and_grad(reduce=False))``."""
    n = len(widths) - 1
    skipped = data.draw(st.lists(st.integers(0, n - 1), unique=True), label="skipped blocks")
    units = data.draw(st.lists(st.sampled_from([f"blocks.{i}" for i in range(n)]), unique=True), label="units")
    torch.manual_seed(seed)
    ref = _Partly(widths, skipped)
    x = torch.randn(2 * world, widths[0], generator=torch.Generator().manual_seed(seed))
    want = torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)) / world)(dict(ref.named_parameters()))
    for rank, (grads, via_reduce) in enumerate(spmd(world, _partly_worker, widths, skipped, sorted(units), fuse, seed)):
        for name, w in want.items():
            shard = fsdpfn.shard_tensor(w, fsdpfn.ShardSpec(tuple(w.shape), world), rank)
            assert grads[name] is not None, (rank, name)
            torch.testing.assert_close(grads[name], shard, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
            torch.testing.assert_close(via_reduce[name], shard, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name} via reduce: {m}")


def test_a_kept_modules_own_weights_are_back_after_every_call():
    """With ``donate=False`` a call puts placeholders in unit parameter slots: the module's own parameters
    are back after a call that returns, one that raises, and a backward (the module stays usable)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 2)))
    before = dict(model.named_parameters())
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"], donate=False)
    apply = fsdpfn.fsdp(model)
    _, grads = fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 3)).sum())(params)
    assert dict(model.named_parameters()) == before
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        apply(params, torch.ones(2, 5))
    assert dict(model.named_parameters()) == before
    assert all(not p.is_meta and p.grad is None for p in model.parameters())


def test_a_forward_error_that_is_not_about_the_meta_device_comes_out_unchanged():
    """apply rewrites only failures on the meta device (a bypassed unit); other errors, one about
    "metadata" included, reach the caller as raised."""

    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Sequential(nn.Linear(2, 2))

        def forward(self, x):
            raise RuntimeError("tensor metadata mismatch in the user's own code")

    model = Raises()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["lin"])
    with pytest.raises(RuntimeError) as info:
        fsdpfn.fsdp(model)(params, torch.ones(1, 2))
    assert str(info.value) == "tensor metadata mismatch in the user's own code"


@pytest.mark.parametrize("node", ["UnshardFunction", "UnshardFunctionBackward"])  # torch 2.13 / torch 2.11
def test_autograds_inplace_error_is_explained_in_either_torchs_wording(node):
    """autograd's "Output k of <node> is a view ... modified inplace" names the gather node differently by
    torch version; either becomes apply's error naming the parameter (on 2.11 it went through unexplained)."""
    from types import SimpleNamespace

    from fsdpfn.transform.validate import explain_inplace_error

    w = torch.zeros(2)
    call = SimpleNamespace(changed=[], gathered={"body": {"emb.weight": w, "emb.bias": w}}, versions={"body": (w._version, w._version)}, snapshots={})
    exc = RuntimeError(f"Output 1 of {node} is a view and its base or another view of its base has been modified inplace. ...")
    explained = explain_inplace_error(exc, call)
    assert explained is not None and "the forward changed 'emb.bias' in place" in str(explained)
    assert explain_inplace_error(RuntimeError("Output 1 of OtherFunction is a view and its base"), call) is None
