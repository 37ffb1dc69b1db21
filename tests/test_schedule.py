"""The schedule (fsdpfn.layout.schedule) is pure arithmetic on a plan: which groups reshard, which groups
each gather prefetches, and how many collectives one step moves. Checked here without a process group;
tests/test_transform.py and tests/test_traced.py check both executors against ``counts()``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.layout import ParamInfo, build_plan
from fsdpfn.layout.grouping import fuse_runs
from fsdpfn.layout.schedule import build_schedule, window


@st.composite
def plans(draw, max_units=6):
    """A plan over a root and up to ``max_units`` units, some frozen or in bf16, maybe fused."""
    world = draw(st.integers(1, 4))
    replicas = draw(st.sampled_from([1, 1, 2]))
    n = draw(st.integers(0, max_units))
    names = [f"u{i}" for i in range(n)]
    infos = []
    for unit in ["", *names]:
        for j in range(draw(st.integers(1 if unit == "" else 0, 3))):
            shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=2)))
            dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
            infos.append(ParamInfo(f"{unit or 'root'}.p{j}", shape, dtype, draw(st.booleans()) or j == 0, unit))
    fuse = draw(st.sampled_from([None, None, 16, 256]))
    cast = draw(st.booleans())
    plan = build_plan(
        infos, [], ["", *names], rank=0, world=world, replicas=replicas, min_bucket_bytes=fuse,
        gather_dtype=(lambda d: torch.bfloat16) if cast else (lambda d: d),
    )  # fmt: skip
    return plan


@settings(max_examples=200)
@given(plan=plans(), reshard=st.booleans(), prefetch=st.integers(0, 3))
def test_schedule_follows_the_plan(plan, reshard, prefetch):
    s = build_schedule(plan, reshard=reshard, prefetch=prefetch)
    names = [g.name for g in plan.groups]
    assert list(s.order) == names and set(s.steps) == set(names)
    moves = plan.world > 1 or any(lay.dtype != plan.dtypes[f] for g in plan.groups for lay in g.gather for f in lay.fqns)
    for i, g in enumerate(plan.groups):
        step = s.step(g.name)
        assert step.gather == g.gather and step.reduce == g.reduce
        assert step.units == plan.members(g.name)
        # the root stays gathered; nothing reshards where gathering copies nothing
        assert s.reshards(g.name) == (reshard and g.name != "" and moves)
        assert s.forward_prefetch(g.name) == tuple(names[i + 1 : i + 1 + prefetch])
        assert s.backward_prefetch(g.name) == tuple(reversed(names[max(0, i - prefetch) : i]))
    c = s.counts()
    shard = plan.world > 1
    assert c.forward_gathers == (sum(len(g.gather) for g in plan.groups) if shard else 0)
    assert c.regathers == (sum(len(g.gather) for g in plan.groups if s.reshards(g.name)) if shard else 0)
    assert c.reduce_scatters == (sum(len(g.reduce) for g in plan.groups) if shard else 0)
    assert c.all_reduces == (sum(len(g.reduce) for g in plan.groups) if plan.replicas > 1 else 0)
    assert s.any_reshard == any(s.reshards(n) for n in names)


@settings(max_examples=100)
@given(plan=plans(), data=st.data())
def test_schedule_takes_the_order_and_explicit_prefetch_it_is_given(plan, data):
    names = [g.name for g in plan.groups]
    order = data.draw(st.permutations(names))
    picked = data.draw(st.lists(st.sampled_from(names), max_size=2)) if names else []
    fwd = {names[0]: picked} if names else {}
    s = build_schedule(plan, order=order, prefetch=1, forward_prefetch=fwd, backward_prefetch={n: [] for n in names[1:]})
    assert list(s.order) == list(order)
    for i, name in enumerate(order):
        want = tuple(picked) if name in fwd else tuple(order[i + 1 : i + 2])
        assert s.forward_prefetch(name) == want
        assert s.backward_prefetch(name) == (() if name in names[1:] else tuple(order[max(0, i - 1) : i]))
    # a partial order (groups not run yet) keeps the plan's order for the rest
    if names:
        assert list(build_schedule(plan, order=[names[-1]]).order) == [names[-1], *names[:-1]]


def test_schedule_reshard_predicate_and_errors():
    infos = [ParamInfo(f"{u or 'root'}.w", (4, 2), torch.float32, True, u) for u in ["", "a", "b"]]
    plan = build_plan(infos, [], ["", "a", "b"], rank=0, world=2)
    s = build_schedule(plan, reshard=lambda name: name != "a")  # a predicate may reshard the root too
    assert [s.reshards(n) for n in ["", "a", "b"]] == [True, False, True]
    assert s.reshards("nope") is False and s.forward_prefetch("nope") == ()
    with pytest.raises(KeyError, match="no collective group 'nope'"):
        s.step("nope")
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        build_schedule(plan, prefetch=-1)
    with pytest.raises(ValueError, match="order names groups"):
        build_schedule(plan, order=["zz"])


@given(order=st.lists(st.text("abc", min_size=1, max_size=2), unique=True, max_size=6), size=st.integers(0, 4), data=st.data())
def test_window_is_the_nearest_names_on_one_side(order, size, data):
    if not order:
        assert window(order, "x", size, ahead=True) == ()
        return
    i = data.draw(st.integers(0, len(order) - 1))
    assert window(order, order[i], size, ahead=True) == tuple(order[i + 1 : i + 1 + size])
    assert window(order, order[i], size, ahead=False) == tuple(order[max(0, i - size) : i][::-1])


def _partition(draw, n):
    """Random sizes >= 1 adding up to ``n``."""
    sizes, left = [], n
    while left:
        sizes.append(draw(st.integers(1, left)))
        left -= sizes[-1]
    return sizes


@settings(max_examples=200)
@given(plan=plans(), data=st.data(), reshard=st.booleans())
def test_forward_spans_name_runs_of_consecutive_resharding_groups(plan, data, reshard):
    named = [g.name for g in plan.groups if g.name]
    sizes = _partition(data.draw, len(named))
    s = build_schedule(plan, reshard=reshard, forward_spans=sizes)
    at, want = 0, {}
    for size in sizes:  # a span of several groups that all reshard begins at its first group
        span = tuple(named[at : at + size])
        at += size
        if size > 1 and plan.world > 1 and all(s.reshards(n) for n in span):
            want[span[0]] = span
    assert dict(s.spans) == want
    for name in [g.name for g in plan.groups]:
        assert s.forward_span(name) == want.get(name, ())
    assert s.counts() == build_schedule(plan, reshard=reshard).counts()  # spans change when, not what, is gathered
    # another forward order that splits a span drops it; explicit prefetch lists drop them all
    if want:
        first = next(iter(want))
        order = [want[first][1]] + [n for n in [g.name for g in plan.groups] if n != want[first][1]]
        assert first not in build_schedule(plan, reshard=reshard, forward_spans=sizes, order=order).spans
        assert not build_schedule(plan, reshard=reshard, forward_spans=sizes, forward_prefetch={first: []}).spans
        # the first call's planned spans (the plan's memo) apply once a call has shown the order it runs in
        from fsdpfn.layout.plan import FORWARD_SPANS_MEMO

        plan.memo[FORWARD_SPANS_MEMO] = tuple(sizes)
        try:
            assert not build_schedule(plan, reshard=reshard).spans
            ran = [g.name for g in plan.groups]
            assert dict(build_schedule(plan, reshard=reshard, order=ran).spans) == want
        finally:
            del plan.memo[FORWARD_SPANS_MEMO]


@pytest.mark.parametrize("sizes", [(1,), (0, 3), (5, 5), (True, 2), (1.0, 2)])
def test_forward_spans_must_partition_the_named_groups(sizes):
    infos = [ParamInfo(f"u{i}.w", (4,), torch.float32, True, f"u{i}") for i in range(3)]
    plan = build_plan(infos, [], ["", "u0", "u1", "u2"], rank=0, world=2)
    with pytest.raises(ValueError, match="forward_spans"):
        build_schedule(plan, forward_spans=sizes)


@given(st.lists(st.one_of(st.integers(-1, 4), st.booleans(), st.just(1.0)), max_size=5), st.integers(1, 5))
def test_every_reader_of_group_sizes_accepts_the_same_partitions(sizes, n):
    # plan regrouping, schedule spans and the planner's span pricing take the same sizes: one rule
    from fsdpfn.memory.phases import GroupBytes, forward_with_spans

    infos = [ParamInfo(f"u{i}.w", (4,), torch.float32, True, f"u{i}") for i in range(n)]
    plan = build_plan(infos, [], ["", *(f"u{i}" for i in range(n))], rank=0, world=2)
    want = all(type(k) is int and k >= 1 for k in sizes) and sum(sizes) == n
    g = GroupBytes(gathered=8, full_grads=8, packed=8, reduce_out=4)

    def accepts(fn) -> bool:
        try:
            fn()
        except ValueError:
            return False
        return True

    assert accepts(lambda: fuse_runs(plan.units, plan.specs, sizes)) == want
    assert accepts(lambda: build_schedule(plan, forward_spans=sizes)) == want or not sizes  # () = no spans
    assert accepts(lambda: forward_with_spans(
        shards=8, state=16, batch=0, activations=0, root=GroupBytes(0, 0, 0, 0), groups=[g] * n, prefetch=1,
        reshard=[True] * n, saved_until=[0] * (n + 1), spans=sizes)) == want
