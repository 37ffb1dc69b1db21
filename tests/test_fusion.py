"""fsdp's first call on an ``"auto"`` plan fuses units as ``fsdpfn.memory.group_sizes_within`` chooses for
the batch and the optimizer noted on the plan: the same numbers as unfused, every rank alike, never when
the user fixed ``min_bucket_bytes``, and no hang when ranks see different batches."""

import contextlib
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
import fsdpfn.optim
from fsdpfn.testing import decided_together, spmd


def _stack(widths):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _steps(widths, batch, min_bucket_bytes, optimizer, steps=2):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    units = [str(i) for i in range(len(widths) - 1)]
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=min_bucket_bytes)
    opt = fsdpfn.optim.adamw(lr=1e-2) if optimizer == "adamw" else fsdpfn.optim.sgd(1e-2)
    state = opt.init(params) if optimizer else None
    apply = fsdpfn.fsdp(model)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(batch * world, widths[0], generator=g)[rank * batch : (rank + 1) * batch] for _ in range(steps)]
    before = [u.name for u in params.plan.groups]
    bucket = params.plan.bucket_bytes
    losses, first = [], None
    for x in xs:
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
        losses.append(loss.item())
        first = first if first is not None else {k: v.clone() for k, v in grads.items() if v is not None}
        if state is not None:
            params, state = opt.update(grads, state, params)
    after = [u.name for u in params.plan.groups]
    return before, after, losses, first, (bucket, params.plan.bucket_bytes)


def _runs(sizes):
    """The group names of the stack's layers fused in runs of ``sizes``."""
    names, start = [], 0
    for n in sizes:
        names.append("+".join(str(i) for i in range(start, start + n)))
        start += n
    return names


def _expected(widths, world, batch, optimizer, pending_forwards=0):
    return fsdpfn.memory.group_sizes_within(_stack(widths), world, torch.zeros(batch, widths[0]), units=[str(i) for i in range(len(widths) - 1)],
                                            optimizer=optimizer or "none", pending_forwards=pending_forwards)


@settings(max_examples=min(settings().max_examples, 6), deadline=None)
@given(widths=st.lists(st.integers(8, 40), min_size=5, max_size=21), batch=st.integers(1, 8), world=st.integers(2, 4),
       optimizer=st.sampled_from(["adamw", "sgd"]))
def test_the_first_call_fuses_as_the_planner_chooses_and_computes_the_same(widths, batch, world, optimizer):
    auto = spmd(world, _steps, widths, batch, "auto", optimizer)
    plain = spmd(world, _steps, widths, batch, None, optimizer)
    choice = _expected(widths, world, batch, optimizer)
    for (before, after, losses, grads, _), (_, unfused, ref_losses, ref_grads, _) in zip(auto, plain):
        assert len(unfused) == len(widths) - 1
        assert after == _runs(choice.sizes)  # the planner's choice, whatever shard chose
        assert after == auto[0][1]  # every rank alike
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert grads.keys() == ref_grads.keys()
        for k in grads:  # the first step's reduced gradients (AdamW would amplify last-bit differences later)
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


def _headed(n, width, head):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)], nn.Linear(width, head))


def _first_call(n, width, head, batch, optimizer):
    import torch.distributed as dist

    model = _headed(n, width, head)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(n)])  # the head is the root
    if optimizer:
        fsdpfn.optim.adamw().init(params)
    apply = fsdpfn.fsdp(model)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    fsdpfn.value_and_grad(lambda p: apply(p, x).logsumexp(-1).mean())(params)
    return [u.name for u in params.plan.groups if u.name]


def test_fusion_that_costs_no_memory_is_taken_on_the_first_call():
    # a wide root layer used last (an LM head's shape): the step peaks on its output's gradient, where no
    # block is gathered, so the planner fuses blocks without raising the peak, optimizer or not
    # (shard's "auto" fuses three blocks here, 1/8 of the shard bytes; the planner, seeing the logits, more)
    n, width, head, batch = 16, 64, 2048, 256
    choice = fsdpfn.memory.group_sizes_within(_headed(n, width, head), 2, torch.zeros(batch, width), units=[str(i) for i in range(n)])
    assert choice.groups < n // 3 and choice.peak <= choice.budget
    want = _runs(choice.sizes)
    for optimizer in ("adamw", None):
        assert spmd(2, _first_call, n, width, head, batch, optimizer) == [want, want]


def _auto_and_unfused_peaks(widths, batch):
    import torch.distributed as dist

    from fsdpfn.testing.memory import measured_step_peak

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(batch * world, widths[0], generator=torch.Generator().manual_seed(1))[rank * batch : (rank + 1) * batch]
    units = [str(i) for i in range(len(widths) - 1)]
    auto = measured_step_peak(_stack(widths), x, units=units, min_bucket_bytes="auto")
    unfused = measured_step_peak(_stack(widths), x, units=units, min_bucket_bytes=None)
    return auto, unfused


def test_on_cpu_the_first_call_fuses_only_the_last_units_where_the_step_has_room():
    # a stack whose peak is the end of backward, with every gradient alive: fusing the first units would
    # add to it, and on CPU torch's default AdamW (the for-loop kernel) leaves no temporary to spend. The
    # last units' backward comes first, when few gradients exist: those are fused, and the measured peak
    # stays the unfused one (within the planner's 10% tolerance)
    widths, batch = [64] * 17, 4
    choice = _expected(widths, 2, batch, "adamw")
    assert choice.sizes[0] == 1 and max(choice.sizes) > 1 and choice.peak <= choice.budget
    for auto, unfused in spmd(2, _auto_and_unfused_peaks, widths, batch):
        assert [g for g in auto.groups if g != "<root>"] == _runs(choice.sizes)
        assert auto.peak <= 1.10 * unfused.peak, (auto, unfused)


@pytest.mark.parametrize("min_bucket_bytes", [None, 0, 1])
def test_a_fusion_the_user_chose_is_kept(min_bucket_bytes):
    for before, after, *_ in spmd(2, _steps, [64] * 17, 4, min_bucket_bytes, "adamw", 1):
        assert before == after


def _uneven(widths, batches, min_bucket_bytes="auto", steps=1):
    """AdamW steps with rank ``r`` on ``batches[step][r]`` rows: the groups after each step, the losses and
    the first step's gradients."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _stack(widths)
    units = [str(i) for i in range(len(widths) - 1)]
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=min_bucket_bytes)
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model)
    g = torch.Generator().manual_seed(5)
    groups, losses, first = [], [], None
    for rows in batches[:steps]:
        xs = [torch.randn(n, widths[0], generator=g) for n in rows]
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, xs[rank]).square().mean())(params)
        params, state = opt.update(grads, state, params)
        groups.append([u.name for u in params.plan.groups if u.name])
        losses.append(loss.item())
        first = first if first is not None else {k: v.clone() for k, v in grads.items()}
    return groups, losses, first


def _together(widths, world, rows, optimizer="adamw"):
    """The groups ranks with ``rows`` rows each plan together (the runtime's search, its fits decided on
    every rank), or alone when every rank has as many."""
    units = [str(i) for i in range(len(widths) - 1)]
    if len(set(rows)) == 1:
        return _expected(widths, world, rows[0], optimizer)
    choices = decided_together([
        lambda everywhere, n=n: fsdpfn.memory.group_sizes_within(
            _stack(widths), world, torch.zeros(n, widths[0]), units=units, optimizer=optimizer, everywhere=everywhere)
        for n in rows
    ])  # fmt: skip
    assert len({(c.sizes, c.forward_spans, c.kept_gathered) for c in choices}) == 1  # every rank alike
    return choices[0]


def test_ranks_with_batches_of_different_sizes_plan_groups_that_fit_each_ranks_batch():
    # sequences of other lengths per rank: each rank alone would fuse differently (a hang, had they
    # followed their own choice; shard's groups, before), and the choice for the larger batch alone does
    # not fit the smaller one's budget; planned together, every rank takes groups that fit both
    widths = [128] * 17
    alone = [_expected(widths, 2, b, "adamw") for b in (2, 4096)]
    together = _together(widths, 2, (2, 4096))
    choice = lambda c: (c.sizes, c.forward_spans, c.kept_gathered)  # noqa: E731
    assert choice(alone[0]) != choice(alone[1]) and choice(together) not in map(choice, alone) and together.sizes != (1,) * 16
    for groups, losses, _ in spmd(2, _uneven, widths, [(2, 4096)]):
        assert groups == [_runs(together.sizes)] and all(map(math.isfinite, losses))


@settings(max_examples=min(settings().max_examples, 3), deadline=None)
@given(widths=st.lists(st.sampled_from([32, 48, 64]), min_size=7, max_size=15), world=st.integers(2, 3), data=st.data())
@example(widths=[64] * 12, world=2, data=None)
def test_groups_follow_the_largest_batch_of_any_rank_and_compute_the_same(widths, world, data):
    # per-rank batch sizes differ and change: the groups are planned for each rank's largest batch so
    # far (planned again when a training batch outgrows it on some rank), the same on every rank, and the
    # numbers are those of the unfused plan on the same batches
    if data is None:
        batches = [(2, 64), (3, 5), (200, 1)]
    else:
        batches = [tuple(data.draw(st.integers(1, 256), label=f"rows {s}.{r}") for r in range(world)) for s in range(3)]
    batches.append((1,) * world)  # (a request reaches the ranks with its pass check: the next call plans)
    fused = spmd(world, _uneven, widths, batches, "auto", 4)
    plain = spmd(world, _uneven, widths, batches, None, 4)
    for (groups, losses, grads), (_, ref_losses, ref_grads) in zip(fused, plain):
        largest = tuple(max(rows[r] for rows in batches) for r in range(world))  # each rank's, planned by the last call
        first, last = (_runs(_together(widths, world, rows).sizes) for rows in (batches[0], largest))
        assert groups[0] == first and groups[-1] == last, (batches, groups)
        assert groups == fused[0][0]  # every rank alike
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


def _blocks(width, hidden, norm, count, frozen=0, mixed=False):
    """``count`` MLP blocks; the first ``frozen`` are frozen, and with ``mixed`` the next one's first Linear
    too (a unit holding frozen and trainable parameters)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(*([nn.LayerNorm(width)] if norm else []), nn.Linear(width, hidden), nn.GELU(),
                                          nn.Linear(hidden, width)) for _ in range(count)])
    for block in model[:frozen]:
        block.requires_grad_(False)
    if mixed and frozen < count:
        model[frozen][1 if norm else 0].requires_grad_(False)
    return model


def _against_fsdp2(width, hidden, norm, count, batch, frozen=0, mixed=False):
    import torch.distributed as dist

    from fsdpfn.memory.estimate import step_estimator
    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    rank, world = dist.get_rank(), dist.get_world_size()
    units = [str(i) for i in range(count)]
    x = torch.randn(batch * world, width, generator=torch.Generator().manual_seed(1))[rank * batch : (rank + 1) * batch]
    ours = measured_step_peak(_blocks(width, hidden, norm, count, frozen, mixed), x, units=units, min_bucket_bytes="auto")
    theirs = measured_fsdp2_step_peak(_blocks(width, hidden, norm, count, frozen, mixed), x, units=units)
    modelled = step_estimator(_blocks(width, hidden, norm, count, frozen, mixed).to("meta"), x, units=units,
                              optimizer="adamw").fsdp2_backward(world)
    return ours, theirs, modelled


@settings(max_examples=min(settings().max_examples, 3), deadline=None)
@given(width=st.sampled_from([64, 128, 256, 384]), hidden=st.sampled_from([128, 512, 1024]), norm=st.booleans(),
       count=st.integers(4, 9), batch=st.sampled_from([2, 8, 32]), world=st.integers(2, 3),
       frozen=st.sampled_from([0, 0, 1, 2]), mixed=st.booleans())
@example(width=64, hidden=256, norm=True, count=9, batch=32, world=2, frozen=0, mixed=False)  # small blocks: forward spans, as bench overhead
# frozen blocks fused with trainable ones (and a unit whose first Linear is frozen): 1.15x and 1.03x torch's
# peak while a frozen parameter's gathered copy required a gradient (its layers saved activations); and
# two frozen blocks fused at the start (64/128, world 3): 1.025x while the planner did not count a flat
# gather's copy out of its rank-major buffer (the group held twice for a moment, before any gradient)
@example(width=256, hidden=512, norm=False, count=8, batch=32, world=2, frozen=2, mixed=True)
@example(width=192, hidden=576, norm=False, count=6, batch=128, world=2, frozen=1, mixed=True)
@example(width=64, hidden=128, norm=False, count=4, batch=2, world=3, frozen=2, mixed=True)
# a forward priced group by group (not as every activation beside the largest window) grew up to a budget
# set by fsdpfn's own unfused backward, which the estimate overstates: 1.021x; the forward is held to the
# unfused forward's peak or torch's modelled one
@example(width=64, hidden=128, norm=False, count=5, batch=32, world=3, frozen=2, mixed=False)
def test_the_first_calls_groups_never_raise_the_peak_above_torchs_fully_shard(width, hidden, norm, count, batch, world, frozen, mixed):
    # both measured alike (MemTracker, parameters, optimizer state and batch resident; torch's AdamW as
    # torch builds it by default); the budget the first call fuses within is the planner's model of
    # FSDP2's backward (fsdpfn.memory.phases.fsdp2_backward), which must not overstate torch's peak
    for ours, theirs, modelled in spmd(world, _against_fsdp2, width, hidden, norm, count, batch, frozen, mixed):
        assert ours.peak <= theirs, (ours, theirs)
        assert modelled <= 1.05 * theirs, (modelled, theirs)  # the activations' share is modelled alike for both


class _MixerBlock(nn.Module):
    """LayerNorm, a Linear over the sequence, LayerNorm, a GELU MLP over the features (residual each)."""

    def __init__(self, seq, width, hidden):
        super().__init__()
        self.n1, self.tok = nn.LayerNorm(width), nn.Linear(seq, seq)
        self.n2, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.n2(x))))


class _Mixer(nn.Module):
    """A token mixer shaped like a language model: embedding and untied head in the root unit."""

    def __init__(self, vocab, seq, width, hidden, count, out):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_MixerBlock(seq, width, hidden) for _ in range(count))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, out)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _mixer_peaks(vocab, seq, width, hidden, count, out, rows):
    """The step peaks of the mixer under fsdp's automatic groups, the compat layer's and torch's
    ``fully_shard`` (each block a unit), on this rank's ``rows`` sequences."""
    import torch.distributed as dist

    from fsdpfn.compat import fully_shard
    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    def model():
        torch.manual_seed(0)
        return _Mixer(vocab, seq, width, hidden, count, out)

    tokens = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    units = [f"blocks.{i}" for i in range(count)]
    ours = measured_step_peak(model(), tokens, units=units, min_bucket_bytes="auto").peak
    compat = measured_fsdp2_step_peak(model(), tokens, units=units, fully_shard=fully_shard)
    return ours, compat, measured_fsdp2_step_peak(model(), tokens, units=units)


@settings(max_examples=min(settings().max_examples, 1), deadline=None)
@given(vocab=st.integers(500, 4000), seq=st.sampled_from([8, 24]), width=st.sampled_from([64, 190]),
       hidden=st.sampled_from([256, 570]), count=st.integers(4, 6), out=st.integers(200, 1000), rows=st.sampled_from([2, 6]),
       world=st.sampled_from([2, 3]))
@example(vocab=3001, seq=24, width=190, hidden=570, count=6, out=999, rows=6, world=2)  # 1.014x both layers before
@example(vocab=3001, seq=24, width=190, hidden=570, count=6, out=999, rows=6, world=3)  # 1.024x
# tiny blocks under a large root, world 3: 1.07x both layers, unfused too, while a small reduction held the
# chunks of every peer at once (fsdpfn.core.exchange.Exchange.reduce_flat; now 0.995x)
@example(vocab=550, seq=4, width=32, hidden=128, count=6, out=1455, rows=2, world=3)
def test_automatic_groups_never_raise_a_language_model_shaped_peak_above_torchs(vocab, seq, width, hidden, count, out, rows, world):
    # the budget is fsdpfn's own unfused estimate where that is above torch's modelled peak; it overstated
    # the last block's backward and understated backward's start, where a group kept gathered sits: each
    # unit's moment is now compared with its own unfused moment (fsdpfn.memory.room.Room.by_unit)
    for ours, compat, theirs in spmd(world, _mixer_peaks, vocab, seq, width, hidden, count, out, rows):
        assert ours <= theirs and compat <= theirs, (ours, compat, theirs)


def _against_fsdp2_per_rank(width, hidden, norm, count, rows):
    """This rank's measured peaks (fsdpfn's ``"auto"`` plan, torch's ``fully_shard``) on ``rows[rank]`` rows."""
    import torch.distributed as dist

    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    rank = dist.get_rank()
    units = [str(i) for i in range(count)]
    x = torch.randn(rows[rank], width, generator=torch.Generator().manual_seed(rank))
    ours = measured_step_peak(_blocks(width, hidden, norm, count), x, units=units, min_bucket_bytes="auto")
    return ours.peak, measured_fsdp2_step_peak(_blocks(width, hidden, norm, count), x, units=units)


@settings(max_examples=min(settings().max_examples, 3), deadline=None)
@given(width=st.sampled_from([64, 128, 256]), hidden=st.sampled_from([256, 768, 1024]), norm=st.booleans(),
       count=st.integers(6, 10), world=st.integers(2, 3), rows=st.lists(st.integers(1, 96), min_size=3, max_size=3))
@example(width=128, hidden=1024, norm=True, count=8, world=2, rows=[8, 64, 0])  # 0.996x and 0.966x
# a forward span of five units planned for 43 rows, unchecked on the others: 1.003x on the rank with 8
@example(width=64, hidden=256, norm=True, count=9, world=3, rows=[8, 1, 43])
def test_groups_planned_for_the_largest_rank_batch_never_raise_any_ranks_peak_above_torchs(width, hidden, norm, count, world, rows):
    # the groups are planned for the largest batch and checked against every rank's own budget: fewer
    # rows hold fewer activations, under torch's lower peak beside them
    rows = tuple(rows[:world])
    for ours, theirs in spmd(world, _against_fsdp2_per_rank, width, hidden, norm, count, rows):
        assert ours <= theirs, (rows, ours, theirs)


def _kept_steps(widths, batch, kept, min_bucket_bytes):
    """Two AdamW steps with ``fsdp(reshard_after_forward=rule)`` keeping the units in ``kept`` gathered;
    the groups after the first call and the losses and first gradients."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    units = [str(i) for i in range(len(widths) - 1)]
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=min_bucket_bytes)
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model, reshard_after_forward=lambda unit: unit not in kept)
    g = torch.Generator().manual_seed(3)
    losses, first = [], None
    for _ in range(2):
        x = torch.randn(batch * world, widths[0], generator=g)[rank * batch : (rank + 1) * batch]
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
        losses.append(loss.item())
        first = first if first is not None else {k: v.clone() for k, v in grads.items()}
        params, state = opt.update(grads, state, params)
    return [u.name for u in params.plan.groups if u.name], losses, first


@settings(max_examples=min(settings().max_examples, 4), deadline=None)
@given(widths=st.lists(st.integers(8, 40), min_size=6, max_size=16), batch=st.integers(1, 8), world=st.integers(2, 3),
       last=st.integers(1, 3))
def test_the_first_call_never_fuses_a_unit_kept_gathered_with_one_that_is_not(widths, batch, world, last):
    n = len(widths) - 1
    kept = {str(i) for i in range(n - last, n)}  # keep_gathered's shape: the last units
    auto = spmd(world, _kept_steps, widths, batch, kept, "auto")
    plain = spmd(world, _kept_steps, widths, batch, kept, None)
    rule = lambda unit: unit not in kept  # noqa: E731
    choice = fsdpfn.memory.group_sizes_within(_stack(widths), world, torch.zeros(batch, widths[0]), units=[str(i) for i in range(n)],
                                              reshard_after_forward=rule, fuse_key=rule)
    for (groups, losses, grads), (_, ref_losses, ref_grads) in zip(auto, plain):
        assert groups == _runs(choice.sizes)
        for group in groups:
            assert len({u in kept for u in group.split("+")}) == 1, (groups, kept)
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


def _spans(cuts, n):
    """The sizes of the runs ``cuts`` (positions) make of ``n`` groups."""
    edges = [0, *sorted(c for c in cuts if c < n), n]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _spanned_steps(widths, batch, cuts, prefetch, fused, mp=False):
    """Two SGD steps over the stack with ``spans`` of its groups gathered together in forward; the losses,
    each step's gradients and the all-gathers each step issued."""
    import torch.distributed as dist

    from fsdpfn.layout.plan import FORWARD_SPANS_MEMO

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    units = [str(i) for i in range(len(widths) - 1)]
    policy = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=fused, mp_policy=policy)
    groups = [g.name for g in params.plan.groups if g.name]
    if cuts is not None:
        params.plan.memo[FORWARD_SPANS_MEMO] = _spans(cuts, len(groups))
    opt = fsdpfn.optim.sgd(1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model, prefetch=prefetch)
    g = torch.Generator().manual_seed(3)
    losses, grads, gathers = [], [], []
    for _ in range(2):
        x = torch.randn(batch * world, widths[0], generator=g)[rank * batch : (rank + 1) * batch]
        before = params.plan.comm.stats.all_gathers
        loss, got = fsdpfn.value_and_grad(lambda p: apply(p, x).tanh().square().mean())(params)
        gathers.append(params.plan.comm.stats.all_gathers - before)
        losses.append(loss.item())
        grads.append({k: v.clone() for k, v in got.items()})
        params, state = opt.update(got, state, params)
    return losses, grads, gathers, groups


@settings(max_examples=min(settings().max_examples, 8), deadline=None)
@given(widths=st.lists(st.integers(1, 24), min_size=3, max_size=12), batch=st.integers(1, 5), world=st.integers(2, 4),
       prefetch=st.integers(0, 2), fused=st.sampled_from([None, 300]), cuts=st.sets(st.integers(1, 10)), mp=st.booleans())
def test_groups_gathered_together_in_forward_compute_exactly_what_they_compute_apart(widths, batch, world, prefetch, fused, cuts, mp):
    # a forward span: one collective for several groups, each unpacked into its own buffer; backward still
    # gathers and reduces group by group. Bit-identical losses and gradients (also gathering bf16 copies of
    # fp32 shards, mixed precision); one forward gather per span from the second call on (the first runs
    # group by group: it has not yet seen the order the groups run in).
    spanned = spmd(world, _spanned_steps, widths, batch, cuts, prefetch, fused, mp)
    apart = spmd(world, _spanned_steps, widths, batch, None, prefetch, fused, mp)
    for (losses, grads, gathers, groups), (ref_losses, ref_grads, ref_gathers, _) in zip(spanned, apart):
        assert losses == ref_losses
        for got, ref in zip(grads, ref_grads):
            assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)
        assert gathers[0] == ref_gathers[0]
        assert ref_gathers[1] - gathers[1] == len(groups) - len(_spans(cuts, len(groups)))


class _Wide(nn.Module):
    """A block whose forward makes a large temporary it does not save (the estimate counts saved tensors)."""

    def __init__(self, width, hidden):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.width, self.hidden = width, hidden

    def forward(self, x):
        t = self.up(x)  # (batch, hidden), freed within the block: mean's backward needs no input
        return x + t.view(x.shape[0], self.hidden // self.width, self.width).mean(1)


def _wide_peaks(width, hidden, count, batch):
    import torch.distributed as dist

    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[_Wide(width, hidden) for _ in range(count)])

    x = torch.randn(batch * world, width, generator=torch.Generator().manual_seed(1))[rank * batch : (rank + 1) * batch]
    units = [str(i) for i in range(count)]
    spans = fsdpfn.memory.group_sizes_within(build(), world, x, units=units).forward_spans
    ours = measured_step_peak(build(), x, units=units, min_bucket_bytes="auto")
    return ours.peak, measured_fsdp2_step_peak(build(), x, units=units), spans


@pytest.mark.parametrize("width, hidden, count, batch, spanned", [(16, 1024, 12, 64, True), (16, 8192, 8, 512, False)])
def test_forward_spans_stay_under_torchs_peak_beside_large_forward_temporaries(width, hidden, count, batch, spanned):
    # a temporary the blocks make and drop sits beside the gathered spans in forward (in torch's step beside
    # its own window); the planner counts it (ForwardCost.working): 2 MiB leaves room for spans; of 16 MiB (in
    # a model of 0.5 MiB blocks) the backward makes one too (mean's gradient, expanded), in torch's step as in
    # ours, so the planner may span a little there (it spans 2 groups: 0.985x torch's measured peak)
    for ours, theirs, spans in spmd(2, _wide_peaks, width, hidden, count, batch):
        assert any(s > 1 for s in spans) or not spanned, spans
        assert ours <= theirs, (ours, theirs, spans)



def _capped_first_call(widths, batch, latency_s, bytes_per_s):
    """On a rank of ``spmd``: the first call on an "auto" plan as on a GPU (collectives that overlap compute),
    over a link of the given cost; the plan's groups, its forward spans and each unit's gathered bytes."""
    import torch.distributed as dist

    import fsdpfn.transform.fusion as fusion
    from fsdpfn.layout.autobucket import LinkCost
    from fsdpfn.layout.plan import FORWARD_SPANS_MEMO

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    opt = fsdpfn.optim.adamw(lr=1e-2)
    opt.init(params)
    apply = fsdpfn.fsdp(model)
    x = torch.randn(batch * world, widths[0], generator=torch.Generator().manual_seed(3))[rank * batch : (rank + 1) * batch]
    saved = fusion.FUSED_DEVICES, fusion.link_of
    fusion.FUSED_DEVICES, fusion.link_of = frozenset(), lambda comm: LinkCost(latency_s, bytes_per_s)
    try:
        fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
    finally:
        fusion.FUSED_DEVICES, fusion.link_of = saved
    plan = params.plan
    sizes = {u.name: u.gathered_bytes(world) for u in plan.units if u.name}
    return [g.name for g in plan.groups if g.name], plan.memo.get(FORWARD_SPANS_MEMO, ()), sizes


@settings(max_examples=min(settings().max_examples, 5), deadline=None)
@given(widths=st.lists(st.integers(8, 40), min_size=6, max_size=16), batch=st.integers(1, 8), world=st.integers(2, 3),
       share=st.floats(0.05, 0.6))
def test_where_collectives_overlap_compute_the_first_call_fuses_no_group_past_the_links_target(widths, batch, world, share):
    # GPUs: a group (or forward span) past the link's latency-bound size only delays the compute that
    # waits for it, so the first call caps both at LinkCost.target_bytes (the CPU, where gloo shares the
    # cores, fuses what memory allows: the other tests here)
    from fsdpfn.layout.autobucket import LinkCost

    full = sum((a + 1) * b * 4 for a, b in zip(widths, widths[1:]))
    link = LinkCost(latency_s=1e-5, bytes_per_s=share * full / (4 * 1e-5))  # its target: that share of the model
    target = link.target_bytes()
    want = fsdpfn.memory.group_sizes_within(_stack(widths), world, torch.zeros(batch, widths[0]), units=[str(i) for i in range(len(widths) - 1)],
                                            optimizer="adamw", max_group_bytes=target)  # fmt: skip
    for groups, spans, sizes in spmd(world, _capped_first_call, widths, batch, link.latency_s, link.bytes_per_s):
        assert groups == _runs(want.sizes) and tuple(spans) == want.forward_spans  # the planner's choice under the cap
        gathered = [sum(sizes[u] for u in g.split("+")) for g in groups]
        assert all("+" not in g or b <= target for g, b in zip(groups, gathered)), (groups, gathered, target)
        at = 0
        for span in spans:  # a forward span of several groups gathers within it as well
            assert span == 1 or sum(gathered[at : at + span]) <= target, (spans, gathered, target)
            at += span



_SIMULATED = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdpfn
from fsdpfn.core import Comm, agree, measure_link
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from test_fusion import _first_call, _headed, _runs
n, width, head, batch = 16, 64, 2048, 256
link = measure_link(Comm(fsdpfn.init_mesh()))
shards = [u.name for u in fsdpfn.shard(_headed(n, width, head), fsdpfn.init_mesh(), units=[str(i) for i in range(n)]).plan.groups if u.name]
choice = fsdpfn.memory.group_sizes_within(_headed(n, width, head), 2, torch.zeros(batch, width), units=[str(i) for i in range(n)])
print(json.dumps({"agree": agree(Comm(fsdpfn.init_mesh()), 7), "link": [link.latency_s, link.bytes_per_s], "shard": shards,
                  "first_call": _first_call(n, width, head, batch, "adamw"), "planned": _runs(choice.sizes)}))
"""


def test_a_simulated_world_plans_its_first_call_as_a_real_one():
    # torch's fake backend: one process stands for rank 0 of a larger world (bench/step.py --fake-world, the
    # GPU sessions' world of 8) and collectives move nothing. The ranks' agreement on the first call's
    # groups must not read the fake group's unchanged sum as a disagreement (until 2026-11-26 fake worlds
    # kept shard's groups), nor the link probe's sum as the timings of W ranks. The model is
    # test_fusion_that_costs_no_memory_is_taken_on_the_first_call's, where the planner fuses more than shard.
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _SIMULATED, str(Path(__file__).parent)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["agree"] is True
    assert got["link"][0] >= 0 and got["link"][1] > 0
    assert got["planned"] != got["shard"], got  # (what makes this a test of the first call)
    assert got["first_call"] == got["planned"], got


def _evaluated_first(widths, batch, mode):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    apply = fsdpfn.fsdp(model)
    x = torch.randn(batch * world, widths[0], generator=torch.Generator().manual_seed(2))[rank * batch : (rank + 1) * batch]
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        apply(params, x)  # an evaluation is the first call: it plans the groups
    return [u.name for u in params.plan.groups if u.name]


@settings(max_examples=min(settings().max_examples, 4), deadline=None)
@given(widths=st.lists(st.sampled_from([32, 64]), min_size=7, max_size=17), batch=st.sampled_from([4, 32]),
       world=st.integers(2, 3), mode=st.sampled_from(["no_grad", "inference_mode"]))
@example(widths=[64] * 17, batch=32, world=2, mode="no_grad")  # no_grad pricing: (1, 1, 1, 1, 1, 2, 2, 3, 4)
def test_an_evaluation_as_the_first_call_plans_the_groups_a_training_step_needs(widths, batch, world, mode):
    # the groups serve every later call: priced without the activations a training step saves, they were
    # larger and raised training's peak (bench/recipe_step.py eval, bf16: 1.008x torch's fully_shard)
    want = _runs(_expected(widths, world, batch, None).sizes)
    for groups in spmd(world, _evaluated_first, widths, batch, mode):
        assert groups == want


def _grown(widths, first, batch, optimizer, hold, min_bucket_bytes="auto"):
    """A first call on ``first`` rows (a shape check, autograd on; ``hold``: its graph kept alive over the
    first training step), then three training steps on ``batch`` rows per rank: the groups each step ran
    with, the losses, the first step's gradients and how many times the ranks asked to plan again."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)],
                          min_bucket_bytes=min_bucket_bytes)
    opt = fsdpfn.optim.adamw(lr=1e-2) if optimizer == "adamw" else fsdpfn.optim.sgd(1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model)
    g = torch.Generator().manual_seed(3)
    # held: a graph whose backward may still run (the shards as autograd leaves, as under value_and_grad)
    leaves = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), params) if hold else params
    held = [apply(leaves, torch.randn(first, widths[0], generator=g))]
    del leaves
    groups, losses, first_grads = [], [], None
    for step in range(3):
        x = torch.randn(batch * world, widths[0], generator=g)[rank * batch : (rank + 1) * batch]
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
        groups.append([u.name for u in params.plan.groups if u.name])
        losses.append(loss.item())
        first_grads = first_grads if first_grads is not None else {k: v.clone() for k, v in grads.items() if v is not None}
        params, state = opt.update(grads, state, params)
        if step == 0:
            held.clear()  # the shape check's graph goes: its backward can no longer run
    from fsdpfn.layout.plan import FORWARD_SPANS_MEMO

    return groups, losses, first_grads, params.plan.comm.guard.replans, params.plan.memo.get(FORWARD_SPANS_MEMO, ())


@settings(max_examples=min(settings().max_examples, 5), deadline=None)
@given(widths=st.lists(st.sampled_from([32, 40, 64]), min_size=9, max_size=21), first=st.integers(1, 4),
       batch=st.sampled_from([16, 32]), world=st.integers(2, 3), optimizer=st.sampled_from(["adamw", "sgd"]),
       hold=st.booleans())
@example(widths=[64] * 17, first=1, batch=16, world=2, optimizer="adamw", hold=False)  # (..., 2, 2, 2, 3) -> (..., 2, 1, 2)
@example(widths=[64] * 17, first=1, batch=16, world=2, optimizer="sgd", hold=True)
def test_a_training_batch_larger_than_the_first_calls_plans_the_groups_again(widths, first, batch, world, optimizer, hold):
    # the first call's groups were priced for its batch: a shape check on one row planned groups that
    # raised training's peak (compat, 8 LayerNorm-MLP blocks: 1.05x torch's fully_shard)
    small = _runs(_expected(widths, world, first, optimizer).sizes)
    # (a held graph awaits its backward beside the first training step's forward: planned for beside it)
    choice = _expected(widths, world, batch, optimizer, pending_forwards=int(hold))
    want = _runs(choice.sizes)
    ours = spmd(world, _grown, widths, first, batch, optimizer, hold)
    plain = spmd(world, _grown, widths, first, batch, optimizer, hold, None)
    for (groups, losses, grads, asked, spans), (_, ref_losses, ref_grads, _, _) in zip(ours, plain):
        assert spans == choice.forward_spans  # the check's spans do not outlive its groups
        # on CPU the request is read at the training step's own pass check: it plans at once, unless a
        # call's backward may still run on the old groups (the shape check's, held): then one step later
        assert groups == ([small] if hold else [want]) + [want, want], (groups, small, want)
        assert asked == 1  # one request for the whole run: later steps are no larger than planned
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


def _kept_across_a_replan(widths, first, batch):
    """A graph on ``first`` rows kept with ``retain_graph=True`` past its first backward, three training
    steps on ``batch`` rows (the ``"auto"`` groups are planned again for them), then its second backward:
    both backwards' gradients and whether the groups changed in between."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    apply = fsdpfn.fsdp(model)
    g = torch.Generator().manual_seed(3)
    leaves = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), params)
    kept = apply(leaves, torch.randn(first, widths[0], generator=g)).square().mean()
    shards = [leaves[k] for k in leaves.keys()]
    once = torch.autograd.grad(kept, shards, retain_graph=True)
    before = [u.name for u in params.plan.groups]
    x = torch.randn(batch * world, widths[0], generator=g)[rank * batch : (rank + 1) * batch]
    for _ in range(3):
        fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
    again = torch.autograd.grad(kept, shards)
    return once, again, before != [u.name for u in params.plan.groups]


@settings(max_examples=min(settings().max_examples, 2), deadline=None)
@given(widths=st.lists(st.sampled_from([32, 40, 64]), min_size=9, max_size=21), first=st.integers(1, 4),
       batch=st.sampled_from([16, 32]), world=st.integers(2, 3))
@example(widths=[64] * 17, first=1, batch=16, world=2)  # planned again in between
def test_a_graph_kept_across_a_replan_runs_backward_again_on_the_groups_it_was_planned_with(widths, first, batch, world):
    # a replan needs no call awaiting its backward, but a graph kept with retain_graph=True may run one
    # more: it re-gathers and reduces the groups its forward gathered (a KeyError, then an error, before)
    results = spmd(world, _kept_across_a_replan, widths, first, batch)
    if (widths, first, batch, world) == ([64] * 17, 1, 16, 2):
        assert all(replanned for _, _, replanned in results)  # (what makes the example a test)
    for once, again, _ in results:
        for a, b in zip(once, again):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def _same_batch(widths, batch):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    apply = fsdpfn.fsdp(model)
    x = torch.randn(batch * world, widths[0], generator=torch.Generator().manual_seed(2))[rank * batch : (rank + 1) * batch]
    with torch.no_grad():
        apply(params, torch.cat([x, x]))  # an evaluation on a larger batch asks nothing: it saves no activations
    for _ in range(2):
        fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())(params)
    return params.plan.comm.guard.replans


def test_batches_no_larger_than_the_planned_one_never_plan_again():
    assert spmd(2, _same_batch, [64] * 17, 8) == [0, 0]


def _summed_forwards(widths, batch, forwards):
    """Three AdamW steps of a loss summing ``forwards`` calls of ``apply`` (DPO's pair, microbatches) on an
    ``"auto"`` plan: the groups each step ran with and the graphs awaiting backward the plan is priced for."""
    import torch.distributed as dist

    from fsdpfn.layout.plan import PLANNED_BATCH_MEMO

    rank = dist.get_rank()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model)
    xs = [torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(forwards)]
    groups = []
    for _ in range(3):
        _, grads = fsdpfn.value_and_grad(lambda p: sum(apply(p, x).tanh().square().mean() for x in xs))(params)
        params, state = opt.update(grads, state, params)
        groups.append([u.name for u in params.plan.groups if u.name])
    return groups, params.plan.memo[PLANNED_BATCH_MEMO].pending


@settings(max_examples=min(settings().max_examples, 3), deadline=None)
@given(widths=st.lists(st.sampled_from([32, 64, 96]), min_size=9, max_size=15), batch=st.sampled_from([8, 32]),
       forwards=st.integers(2, 3), world=st.integers(2, 3))
def test_forwards_beside_others_awaiting_backward_plan_for_their_graphs(widths, batch, forwards, world):
    # the first call plans for one graph; its later forwards begin beside the earlier ones' graphs, which
    # asks to plan again, priced with them (group_sizes_within(pending_forwards=))
    with_graphs = _runs(_expected(widths, world, batch, "adamw", pending_forwards=forwards - 1).sizes)
    runs = spmd(world, _summed_forwards, widths, batch, forwards)
    plain = spmd(world, _summed_forwards, widths, batch, 1)
    for groups, pending in runs:
        assert pending == forwards - 1
        assert groups[0] == _runs(_expected(widths, world, batch, "adamw").sizes)  # (the first call's: one graph)
        assert groups[1:] == [with_graphs, with_graphs], (groups, with_graphs)
        assert groups == runs[0][0]  # every rank alike
    assert [p for _, p in plain] == [0] * world  # one forward per backward: nothing awaits


def _planner_kept(widths, batch, rule):
    """Three AdamW steps of ``fsdp(model, reshard_after_forward=True)`` (``rule`` true) or with a predicate that
    reshards every unit, on an ``"auto"`` plan: the units its
    first call left gathered, the groups, the labels of the last step's all-gathers, the losses and the
    first step's gradients."""
    import torch.distributed as dist

    from fsdpfn.layout.plan import KEPT_GATHERED_MEMO

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model, reshard_after_forward=True if rule else lambda unit: True)  # (a predicate keeps what it says)
    g = torch.Generator().manual_seed(3)
    stats = params.plan.comm.stats
    losses, first = [], None
    for step in range(3):
        x = torch.randn(batch * world, widths[0], generator=g)[rank * batch : (rank + 1) * batch]
        if step == 2:
            stats.reset()
            stats.recording = True
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).tanh().square().mean())(params)
        stats.recording = False
        losses.append(loss.item())
        first = first if first is not None else {k: v.clone() for k, v in grads.items()}
        params, state = opt.update(grads, state, params)
    gathers = [label for kind, label, _ in stats.log if kind == "all_gathers"]
    kept = sorted(params.plan.memo.get(KEPT_GATHERED_MEMO, ()))
    return kept, [u.name for u in params.plan.groups if u.name], gathers, losses, first


@settings(max_examples=min(settings().max_examples, 4), deadline=None)
@given(widths=st.lists(st.integers(8, 48), min_size=5, max_size=14), batch=st.integers(1, 8), world=st.integers(2, 3))
@example(widths=[40] * 8, batch=4, world=2)  # the last two of seven groups kept
def test_the_first_call_keeps_the_last_groups_gathered_as_the_planner_chooses(widths, batch, world):
    # reshard_after_forward=True on an "auto" plan: the last groups whose gathered copy costs no memory stay
    # gathered until their backward (gathered once a step, not twice); a predicate keeps what it says
    kept_runs = spmd(world, _planner_kept, widths, batch, True)
    resharded = spmd(world, _planner_kept, widths, batch, False)
    choice = _expected(widths, world, batch, "adamw")
    for (kept, groups, gathers, losses, grads), (none, same, regathers, ref_losses, ref_grads) in zip(kept_runs, resharded):
        assert kept == sorted(choice.kept_gathered) and none == [] and groups == same == _runs(choice.sizes)
        held = [g for g in groups if set(g.split("+")) <= set(kept)]
        assert held == groups[len(groups) - len(held) :] and sum(len(g.split("+")) for g in held) == len(kept)  # the last ones
        for g in held:
            assert gathers.count(g) == 1, (g, gathers)  # forward only: backward finds it gathered
            assert g == groups[0] or regathers.count(g) >= 1, (g, regathers)  # resharded: gathered again in backward
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
    assert all(r[0] == kept_runs[0][0] for r in kept_runs)  # every rank alike


def _lm_against_fsdp2(dim, vocab, blocks, batch, seed):
    """This rank's measured step peaks of a small language model (a vocabulary-sized head), fsdpfn's
    ``"auto"`` plan and torch's ``fully_shard``, the units the first call kept gathered, and the head's
    output bytes (what the loss's backward is priced with)."""
    import torch.distributed as dist

    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak
    from fsdpfn.testing.models import ModelRecipe

    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = ModelRecipe("transformer", (dim, dim, vocab, *[2 * dim] * blocks), seed=seed, seq=8)
    units = [f"blocks.{i}" for i in range(blocks)]
    x = recipe.inputs(batch * world, seed)[rank * batch : (rank + 1) * batch]
    ours = measured_step_peak(recipe.build(), x, units=units, min_bucket_bytes="auto")
    theirs = measured_fsdp2_step_peak(recipe.build(), x, units=units)
    return ours.peak, theirs, list(ours.kept)


@settings(max_examples=min(settings().max_examples, 2), deadline=None)  # ~3 s a draw
@given(dim=st.sampled_from([32, 64]), vocab=st.sampled_from([256, 512, 2048, 4096]), blocks=st.integers(4, 6),
       batch=st.sampled_from([2, 4]), world=st.integers(2, 3), seed=st.integers(0, 9))
# heads whose loss backward is the step's peak: priced as one output-sized gradient, the planner kept the
# last block on it (1.02x and 1.03x torch's peak); priced as an unseen loss's (4 outputs), it keeps nothing
@example(dim=32, vocab=512, blocks=6, batch=2, world=2, seed=1)
@example(dim=64, vocab=2048, blocks=5, batch=4, world=2, seed=3)
@example(dim=64, vocab=512, blocks=6, batch=4, world=2, seed=0)  # the last block kept
def test_groups_the_first_call_keeps_gathered_never_raise_a_language_models_peak_above_torchs(dim, vocab, blocks, batch, world, seed):
    for ours, theirs, kept in spmd(world, _lm_against_fsdp2, dim, vocab, blocks, batch, seed):
        assert ours <= theirs, (ours, theirs, kept)


def _forwards_then_backward(widths, batch, forwards, keep):
    """The measured peak of a warm AdamW step whose loss sums ``forwards`` calls of ``apply`` before one
    backward (DPO's pair, accumulated microbatches), with ``fsdp``'s default resharding (``keep``: the
    planner's last groups kept) or a predicate that reshards every unit; the kept units, the losses and
    the last step's all-gather labels."""
    import warnings

    import torch.distributed as dist

    from fsdpfn.layout.plan import KEPT_GATHERED_MEMO
    from fsdpfn.testing.memory import memory_tracker

    rank = dist.get_rank()
    model = _stack(widths)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model, reshard_after_forward=True if keep else lambda unit: True)
    xs = [torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(forwards)]
    tracker = None

    def loss_fn(p):
        total = 0.0
        for x in xs:
            if tracker is not None:
                tracker.reset_mod_stats()  # (MemTracker counts one call per module otherwise)
            total = total + apply(p, x).tanh().square().mean()
        return total

    losses = []
    for step in range(3):  # (the first call plans for one forward; the second, for them all: measured third)
        stats = params.plan.comm.stats
        stats.reset()
        stats.recording = True
        if step == 2:
            tracker = memory_tracker()
            tracker.track_external(*[params[k] for k in params.keys()], *xs)
        with tracker if tracker is not None else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            loss, grads = fsdpfn.value_and_grad(loss_fn)(params)
            params, state = opt.update(grads, state, params)
        stats.recording = False
        losses.append(loss.item())
    peak = max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
    gathers = [label for kind, label, _ in stats.log if kind == "all_gathers"]
    return peak, sorted(params.plan.memo.get(KEPT_GATHERED_MEMO, ())), losses, gathers


@settings(max_examples=min(settings().max_examples, 3), deadline=None)
@given(widths=st.lists(st.sampled_from([64, 128]), min_size=7, max_size=11), batch=st.sampled_from([4, 16]),
       forwards=st.integers(2, 4), world=st.integers(2, 3))
@example(widths=[128] * 9, batch=16, forwards=4, world=2)  # each forward's kept copy pinned by its graph: 1.03x
def test_forwards_before_one_backward_keep_nothing_gathered_beyond_the_resharded_peak(widths, batch, forwards, world):
    # the planner priced one forward and its backward; a second forward before that backward drops the
    # copies the first one kept (its backward gathers them again) and keeps none of its own: the step's
    # peak is the resharded plan's, and so are its numbers
    kept_runs = spmd(world, _forwards_then_backward, widths, batch, forwards, True)
    resharded = spmd(world, _forwards_then_backward, widths, batch, forwards, False)
    for (peak, kept, losses, gathers), (ref_peak, none, ref_losses, _) in zip(kept_runs, resharded):
        assert none == [] and peak <= ref_peak, (kept, peak, ref_peak)
        for unit in kept:  # (kept groups are in no forward span: each gathers alone, under its own name)
            group = next(g for g in gathers if unit in g.split("+"))
            assert gathers.count(group) == 2 * forwards, (group, gathers)  # each forward's, again in its backward
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
