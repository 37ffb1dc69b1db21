"""Layout properties (single process): ShardSpec follows torch.chunk, shard/unshard round-trips bit-exactly,
and bucket packing/unpacking agrees with a simulated all-gather and reduce-scatter."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpfn import ShardSpec, shard_tensor, unshard_tensors
from fsdpfn.layout import BucketLayout
from fsdpfn.testing import strategies as fst


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe, dtype and shape included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@given(spec=fst.shard_specs())
def test_spec_follows_torch_chunk(spec):
    x = torch.arange(spec.numel).reshape(spec.shape) if spec.shape else torch.tensor(7)
    rows_view = x.reshape(1) if not spec.shape else x
    chunks = rows_view.chunk(spec.world, spec.dim) if spec.rows else ()
    assert spec.chunk == math.ceil(spec.rows / spec.world)
    for rank in range(spec.world):
        start, stop = spec.bounds(rank)
        assert 0 <= start <= stop <= spec.rows
        if rank < len(chunks):
            assert tuple(chunks[rank].shape) == spec.local_shape(rank)
        else:  # torch.chunk returns fewer chunks: the trailing ranks hold nothing
            assert spec.local_rows(rank) == 0
    assert sum(spec.local_rows(r) for r in range(spec.world)) == spec.rows
    assert all(spec.local_rows(r) <= spec.chunk for r in range(spec.world))


@given(spec=fst.shard_specs(), data=st.data())
def test_shard_unshard_round_trip_is_bit_exact(spec, data):
    x = data.draw(fst.tensors(spec.shape, data.draw(fst.dtypes())))
    shards = [shard_tensor(x, spec, r) for r in range(spec.world)]
    for r, s in enumerate(shards):
        assert tuple(s.shape) == spec.local_shape(r)
        assert s.is_contiguous()
    assert _same(unshard_tensors(shards, spec), x)


@st.composite
def buckets(draw, max_members=4):
    world = draw(st.integers(1, 16))
    n = draw(st.integers(1, max_members))
    specs = [draw(fst.shard_specs(shape=draw(fst.shapes(max_dims=3)))) for _ in range(n)]
    specs = [ShardSpec(s.shape, world, s.dim) for s in specs]
    dtype = draw(fst.dtypes())
    return BucketLayout.build([f"p{i}" for i in range(n)], specs, dtype)


@given(layout=buckets(), data=st.data())
def test_bucket_gather_round_trip(layout, data):
    fulls = [data.draw(fst.tensors(s.shape, layout.dtype)) for s in layout.specs]
    segs = []
    for rank in range(layout.world):
        seg = layout.pack_shards([shard_tensor(x, s, rank) for x, s in zip(fulls, layout.specs)], rank)
        assert seg.shape == (layout.numel,)  # every rank holds the same padded size
        for spec, off in zip(layout.specs, layout.offsets):  # padding is zero
            real = spec.local_numel(rank)
            assert not seg[off + real : off + spec.padded_numel].ne(0).any()
        segs.append(seg)
    gathered = torch.stack(segs)  # what an all-gather delivers
    out = layout.unpack_full(gathered)
    for x, y in zip(fulls, out):
        assert _same(y.contiguous(), x)
    if len(layout.specs) == 1 and gathered.numel():  # a one-member bucket is a pure view
        assert out[0].untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()


@given(layout=buckets(), data=st.data())
def test_bucket_reduce_scatter_matches_sum_of_fulls(layout, data):
    dtype = torch.float64
    layout = BucketLayout.build(layout.fqns, layout.specs, dtype)
    per_rank = [[data.draw(fst.tensors(s.shape, dtype)) for s in layout.specs] for _ in range(layout.world)]
    summed = sum(layout.pack_full(f) for f in per_rank)  # reduce-scatter input, summed over ranks
    for rank in range(layout.world):
        got = layout.unpack_shards(summed[rank], rank)
        for i, spec in enumerate(layout.specs):
            want = shard_tensor(sum(f[i] for f in per_rank), spec, rank)
            torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)


@given(layout=buckets(), data=st.data())
def test_concatenating_forms_equal_the_buffer_forms(layout, data):
    """concat_shards / split_full / concat_full (what compiled graphs use) give exactly what
    pack_shards / unpack_full / pack_full give, None members and padding included."""
    fulls = [data.draw(fst.tensors(s.shape, layout.dtype)) for s in layout.specs]
    segs = []
    for rank in range(layout.world):
        shards = [shard_tensor(x, s, rank) for x, s in zip(fulls, layout.specs)]
        seg = layout.concat_shards(shards, rank)
        assert _same(seg, layout.pack_shards(shards, rank))
        segs.append(seg)
    gathered = torch.stack(segs)
    for a, b in zip(layout.split_full(gathered), layout.unpack_full(gathered)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)  # randn: no NaN
    some = [None if data.draw(st.booleans()) else x for x in fulls]
    assert _same(layout.concat_full(some), layout.pack_full(some))


@given(layout=buckets(), data=st.data())
def test_packing_into_a_given_buffer_equals_packing_into_a_new_one(layout, data):
    """pack_shards(out=) writes every element of ``out`` (stale contents never leak) and returns it;
    a buffer of another shape or dtype is refused, naming both."""
    fulls = [data.draw(fst.tensors(s.shape, layout.dtype)) for s in layout.specs]
    rank = data.draw(st.integers(0, layout.world - 1))
    shards = [None if data.draw(st.booleans()) else shard_tensor(x, s, rank) for x, s in zip(fulls, layout.specs)]
    out = torch.full((layout.numel,), 7, dtype=layout.dtype) if layout.dtype != torch.bool else torch.ones(layout.numel, dtype=torch.bool)
    got = layout.pack_shards(shards, rank, out=out)
    assert got is out and _same(out, layout.pack_shards(shards, rank))
    with pytest.raises(ValueError, match=r"pack_shards: out is \(%d,\)" % (layout.numel + 1)):
        layout.pack_shards(shards, rank, out=torch.empty(layout.numel + 1, dtype=layout.dtype))


@given(layout=buckets(max_members=3), batch=st.integers(1, 3), data=st.data())
def test_bucket_batched_matches_unbatched(layout, batch, data):
    dtype = torch.float64
    layout = BucketLayout.build(layout.fqns, layout.specs, dtype)
    fulls = [data.draw(fst.tensors((batch, *s.shape), dtype)) for s in layout.specs]
    segs = [
        layout.pack_shards([torch.stack([shard_tensor(x[b], s, r) for b in range(batch)]) for x, s in zip(fulls, layout.specs)], r, batch=(batch,))
        for r in range(layout.world)
    ]
    out = layout.unpack_full(torch.stack(segs), batch_ndim=1)
    for x, y in zip(fulls, out):
        assert torch.equal(x, y)
    packed = layout.pack_full(fulls, batch=(batch,))
    for rank in range(layout.world):
        got = layout.unpack_shards(packed[rank], rank, batch_ndim=1)
        for x, g, s in zip(fulls, got, layout.specs):
            assert torch.equal(g, torch.stack([shard_tensor(x[b], s, rank) for b in range(batch)]))


def test_mixed_members_keep_their_offsets():
    specs = (ShardSpec((5, 2), 2), ShardSpec((3,), 2), ShardSpec((), 2))
    layout = BucketLayout.build(("w", "b", "s"), specs, torch.float32)
    assert layout.offsets == (0, 6, 8)
    assert layout.numel == 9
    assert layout.sizes == (6, 2, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape=(3, 4), world=2, dim=2), "dim=2 is out of range"),
        (dict(shape=(3, 4), world=2, dim=-3), "dim=-3 is out of range"),
        (dict(shape=(3,), world=0), "world must be an int >= 1"),
        (dict(shape=(3,), world=-1), "world must be an int >= 1"),
        (dict(shape=(3,), world=2.0), "world must be an int >= 1"),
        (dict(shape=(-1, 2), world=2), "negative size"),
        (dict(shape=(), world=2, dim=1), "dim=1 is out of range"),
    ],
)
def test_spec_rejects_bad_input(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ShardSpec(**kwargs)


def test_spec_rejects_bad_rank_and_shapes():
    spec = ShardSpec((4,), 2)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        spec.bounds(2)
    with pytest.raises(ValueError, match="does not match spec shape"):
        shard_tensor(torch.zeros(5), spec, 0)
    with pytest.raises(ValueError, match="got 1 shards"):
        unshard_tensors([torch.zeros(2)], spec)
    with pytest.raises(ValueError, match="shard of rank 1 has shape"):
        unshard_tensors([torch.zeros(2), torch.zeros(3)], spec)


def test_zero_dim_tensor_shards_to_rank_zero():
    spec = ShardSpec((), 3)
    x = torch.tensor(2.5)
    shards = [shard_tensor(x, spec, r) for r in range(3)]
    assert [tuple(s.shape) for s in shards] == [(1,), (0,), (0,)]
    assert unshard_tensors(shards, spec).shape == ()
    assert unshard_tensors(shards, spec).item() == 2.5


# --- fusing units into collective groups (shard(..., min_bucket_bytes=)) -----------------------------
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    world=fst.world_sizes(),
    root=st.booleans(),
    threshold=st.integers(1, 600),
)
def test_fused_groups_partition_the_units_greedily(sizes, world, root, threshold):
    from fsdpfn.layout.plan import ParamInfo, build_plan

    names = [f"u{i}" for i in range(len(sizes))]
    infos = [ParamInfo(f"{n}.w", (k,), torch.float32, True, n) for n, k in zip(names, sizes)]
    infos += [ParamInfo(f"{n}.b", (2,), torch.float64, i % 2 == 0, n) for i, n in enumerate(names)]
    if root:
        infos.append(ParamInfo("w", (3,), torch.float32, True, ""))
    plan = build_plan(infos, [], [""] + names, rank=0, world=world, min_bucket_bytes=threshold)
    unfused = build_plan(infos, [], [""] + names, rank=0, world=world)
    assert plan.units == unfused.units  # units themselves are untouched
    groups = [g for g in plan.groups if g.name]
    assert [u for g in groups for u in plan.members(g.name)] == names  # consecutive, in order, each once
    gathered = {u.name: sum(lay.nbytes for lay in u.gather) * world for u in plan.units}
    for i, g in enumerate(groups):
        members = plan.members(g.name)
        assert g.name == "+".join(members) and all(plan.group_of[m] == g.name for m in members)
        assert list(g.fqns) == [f for m in members for f in plan.unit(m).fqns]
        total = sum(gathered[m] for m in members)
        assert sum(gathered[m] for m in members[:-1]) < threshold  # greedy: closed as soon as it is full
        assert total >= threshold or i == len(groups) - 1  # only the last group may stay small
        # one bucket per dtype; the reduce buckets hold the trainable members only
        assert sorted(str(lay.dtype) for lay in g.gather) == ["torch.float32", "torch.float64"]
        assert {f for lay in g.reduce for f in lay.fqns} == {f for m in members for lay in plan.unit(m).reduce for f in lay.fqns}
    if root:
        assert plan.group("") is plan.unit("") and plan.group_of[""] == ""


@given(data=st.data(), world=fst.world_sizes(), root=st.booleans())
def test_regroup_by_sizes_fuses_runs_and_names_bad_sizes(data, world, root):
    from fsdpfn.layout.plan import ParamInfo, build_plan

    count = data.draw(st.integers(1, 8))
    names = [f"u{i}" for i in range(count)]
    infos = [ParamInfo(f"{n}.w", (data.draw(st.integers(1, 40)),), torch.float32, True, n) for n in names]
    if root:
        infos.append(ParamInfo("w", (3,), torch.float32, True, ""))
    plan = build_plan(infos, [], [""] + names, rank=0, world=world)
    sizes, left = [], count
    while left:
        sizes.append(data.draw(st.integers(1, left)))
        left -= sizes[-1]
    assert plan.regroup(sizes=sizes) == (sizes != [1] * count)
    groups = [g for g in plan.groups if g.name]
    assert [len(plan.members(g.name)) for g in groups] == sizes
    assert [u for g in groups for u in plan.members(g.name)] == names  # consecutive, in order, each once
    assert [f for g in groups for f in g.fqns] == [f"{n}.w" for n in names]
    assert (plan.group("") is plan.unit("")) if root else "" not in plan.group_of
    assert plan.regroup(sizes=sizes) is False  # the same groups: nothing changes
    for bad in ([0] + [1] * count, [1] * (count + 1), [True] * count, [count + 1]):
        with pytest.raises(ValueError, match=f"sizes must be ints >= 1 adding up to the {count} non-root units"):
            plan.regroup(sizes=bad)
    with pytest.raises(ValueError, match="pass min_bucket_bytes or sizes, not both"):
        plan.regroup(8, sizes=sizes)
    assert plan.regroup(None) == (sizes != [1] * count) and [g.name for g in plan.groups if g.name] == names


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1MB"])
def test_fusion_threshold_must_be_a_byte_count(bad):
    from fsdpfn.layout.plan import ParamInfo, build_plan

    infos = [ParamInfo("u.w", (4,), torch.float32, True, "u")]
    with pytest.raises(ValueError, match="min_bucket_bytes"):
        build_plan(infos, [], ["", "u"], rank=0, world=2, min_bucket_bytes=bad)


@given(keys=st.lists(st.integers(0, 2), min_size=1, max_size=8), threshold=st.integers(1, 400))
def test_units_of_different_keys_never_share_a_group(keys, threshold):
    from fsdpfn.layout.plan import ParamInfo, build_plan

    names = [f"u{i}" for i in range(len(keys))]
    infos = [ParamInfo(f"{n}.w", (5,), torch.float32, True, n) for n in names]
    key = dict(zip(names, keys))
    plan = build_plan(infos, [], names, rank=0, world=2, min_bucket_bytes=threshold, fuse_key=key.__getitem__)
    assert [u for g in plan.groups for u in plan.members(g.name)] == names
    for g in plan.groups:
        members = plan.members(g.name)
        assert len({key[m] for m in members}) == 1
        each = sum(lay.nbytes for lay in plan.unit(members[0]).gather) * 2  # 3 padded floats per rank
        assert each * (len(members) - 1) < threshold  # still greedy within a key


# --- automatic collective groups (min_bucket_bytes="auto") -----------------------------------------
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    world=fst.world_sizes(),
    root=st.integers(0, 5000),
    latency=st.floats(0, 1e-2),
    bandwidth=st.one_of(st.floats(1e5, 1e11), st.just(float("inf"))),
)
def test_auto_groups_fill_up_to_the_chosen_size_and_never_past_it(sizes, world, root, latency, bandwidth):
    from fsdpfn.layout.autobucket import CAP_PARTS, LATENCY_SHARE, LinkCost, auto_bucket_bytes
    from fsdpfn.layout.plan import ParamInfo, build_plan

    names = [f"u{i}" for i in range(len(sizes))]
    infos = [ParamInfo(f"{n}.w", (k,), torch.float32, True, n) for n, k in zip(names, sizes)]
    if root:
        infos.append(ParamInfo("w", (root,), torch.float32, True, ""))
    link = LinkCost(latency, bandwidth)
    plan = build_plan(infos, [], [""] + names, rank=0, world=world, min_bucket_bytes="auto", link=link)
    gathered = {u.name: sum(lay.nbytes for lay in u.gather) * world for u in plan.units}
    shard_bytes = sum(lay.nbytes for u in plan.units for lay in u.gather)
    cap = max(gathered[n] for n in names) if names else 0
    cap = max(cap, shard_bytes // CAP_PARTS)
    target = cap if bandwidth == float("inf") else int(LATENCY_SHARE * latency * bandwidth)
    limit = plan.bucket_bytes
    assert limit == auto_bucket_bytes(plan.units, world, link)
    if limit is None:  # nothing fused: no group could hold two units
        assert plan.groups == plan.units
        assert len(names) < 2 or min(target, cap) < 2 * min(gathered[n] for n in names)
        return
    assert limit == min(target, cap) and limit <= cap
    groups = [g for g in plan.groups if g.name]
    assert [u for g in groups for u in plan.members(g.name)] == names  # a partition, in order
    totals = [sum(gathered[m] for m in plan.members(g.name)) for g in groups]
    for i, (g, total) in enumerate(zip(groups, totals)):
        assert total <= limit or len(plan.members(g.name)) == 1  # never past the limit (a big unit stays alone)
        if i + 1 < len(groups):  # greedy: the next unit did not fit
            assert total + gathered[plan.members(groups[i + 1].name)[0]] > limit
    if root:
        assert plan.group("") is plan.unit("")


def test_auto_needs_the_link_cost_and_strings_other_than_auto_are_refused():
    from fsdpfn.layout.plan import ParamInfo, build_plan

    infos = [ParamInfo(f"u{i}.w", (4,), torch.float32, True, f"u{i}") for i in range(3)]
    with pytest.raises(ValueError, match="needs the mesh's measured all-gather cost"):
        build_plan(infos, [], ["u0", "u1", "u2"], rank=0, world=2, min_bucket_bytes="auto")
    with pytest.raises(ValueError, match=r"int >= 0 \(bytes\), 'auto' or None, got 'big'"):
        build_plan(infos, [], ["u0", "u1", "u2"], rank=0, world=2, min_bucket_bytes="big")


def test_auto_fuses_many_small_blocks_and_leaves_large_ones_alone():
    from fsdpfn.layout.autobucket import LinkCost
    from fsdpfn.layout.plan import ParamInfo, build_plan

    def plan(n_blocks, numel):
        names = [f"b{i}" for i in range(n_blocks)]
        infos = [ParamInfo(f"{n}.w", (numel,), torch.float32, True, n) for n in names]
        return build_plan(infos, [], names, rank=0, world=2, min_bucket_bytes="auto", link=LinkCost(2e-4, 2e9))

    small = plan(48, 33088)  # the bench's overhead model: 48 blocks of 132 KB
    assert [len(small.members(g.name)) for g in small.groups] == [3] * 16  # 1/8 of this rank's bytes
    large = plan(12, 885_888)  # the ln_mlp model's blocks (3.5 MB): already past the latency target
    assert large.groups == large.units and large.bucket_bytes is None
