"""Tests for fsdpfn.testing.pool: the persistent SPMD worker pools behind ``spmd``."""

from __future__ import annotations

import collections
import os
import pickle
import re
import signal
import socket
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from fsdpfn.testing import pool as pool_mod
from fsdpfn.testing._worker import TIDY_ABOVE
from fsdpfn.testing.pool import SpmdError, SpmdTimeout, shutdown_pools, spmd

Pair = collections.namedtuple("Pair", ["a", "b"])


# --- functions run on the workers (module level, so they pickle by reference) -------------


def _rank_world_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _pid() -> int:
    return os.getpid()


def _add(x: torch.Tensor, k: int) -> torch.Tensor:
    return x + k * dist.get_rank()


def _tensors() -> dict:
    w = torch.ones(3, requires_grad=True)
    return {"leaf": w, "nonleaf": [w * 2], "pair": Pair(torch.arange(2), (w.sum(),)), "n": 7}


def _raise_on_rank1(msg: str) -> None:
    if dist.get_rank() == 1:
        raise ValueError(msg)
    dist.all_reduce(torch.ones(1))  # rank 0 is stuck here until the pool notices


def _raise_alone_on_rank1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("only rank 1")


def _send_then_raise(value: float) -> None:
    """Rank 0 sends ``value`` (tag 7) that rank 1 never receives; both raise."""
    if dist.get_rank() == 0:
        dist.isend(torch.tensor([value]), dst=1, tag=7)
    raise ValueError("after sending")


def _exchange_tag7(value: float) -> float:
    """Rank 0 sends ``value`` with tag 7 to rank 1; every rank returns what rank 1 received."""
    t = torch.tensor([value if dist.get_rank() == 0 else -1.0])
    if dist.get_rank() == 0:
        dist.send(t, dst=1, tag=7)
    else:
        dist.recv(t, src=0, tag=7)
    dist.broadcast(t, src=1)
    return t.item()


def _raise_different_types() -> None:
    raise (KeyError if dist.get_rank() == 0 else ValueError)("boom")


class _TwoArgError(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")
        self.a, self.b = a, b

    def __reduce__(self) -> tuple:  # unpickles, but cannot be built from one message
        return (type(self), (self.a, self.b))


def _raise_two_arg_error() -> None:
    raise _TwoArgError("x", "y")


def _sleep_on_rank0() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


def _lonely_all_reduce() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


def _exit3_on_rank1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _unpicklable_result() -> threading.Lock:
    return threading.Lock()


def _groups_then_new_group() -> tuple[int, int]:
    """How many process groups this worker holds on entry, and after making one more."""
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    group = dist.new_group(list(range(dist.get_world_size())))
    dist.all_reduce(torch.ones(1), group=group)
    return before, len(c10d._world.pg_map)


_CACHED: dict = {}  # per worker process: a group and a mesh kept across calls, as a test may cache them


def _cached_group_and_mesh_still_work() -> float:
    """Sum over a group and over a mesh's groups made by the first call, after a throwaway group."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _CACHED:
        _CACHED["group"] = dist.new_group([0, 1])
        _CACHED["mesh"] = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    dist.new_group([0, 1])  # made and dropped: what the pool tidies
    t = torch.ones(1)
    assert dist.get_process_group_ranks(_CACHED["group"]) == [0, 1]  # raises for a destroyed group
    dist.all_reduce(t, group=_CACHED["group"])
    for dim in ("a", "b"):
        dist.all_reduce(t, group=_CACHED["mesh"].get_group(dim))
    return t.item()


def _hsdp_full_tensor(lib: str) -> float:
    """A 2-D mesh, parameters sharded on it, gathered back: a later call builds an equal mesh, which
    DTensor's caches (keyed by mesh equality) must not answer with the destroyed groups of this one."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    importlib.import_module(lib).fully_shard(model, mesh=mesh)
    return model.weight.detach().full_tensor().sum().item()  # the seeded weight, whole again


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_per_rank(world: int) -> None:
    total = world * (world + 1) / 2
    assert spmd(world, _rank_world_sum) == [(r, world, total) for r in range(world)]


def test_pool_is_reused_and_args_are_passed() -> None:
    pids = spmd(2, _pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    t0 = time.monotonic()
    assert spmd(2, _pid) == pids
    assert time.monotonic() - t0 < 5
    out = spmd(2, _add, torch.zeros(2), 5)
    assert [o.tolist() for o in out] == [[0.0, 0.0], [5.0, 5.0]]


def test_tensors_come_back_detached() -> None:
    out = spmd(2, _tensors)
    for res in out:
        assert torch.equal(res["leaf"], torch.ones(3)) and not res["leaf"].requires_grad
        assert torch.equal(res["nonleaf"][0], torch.full((3,), 2.0))
        assert not res["nonleaf"][0].requires_grad
        assert isinstance(res["pair"], Pair)
        assert torch.equal(res["pair"].a, torch.arange(2)) and res["pair"].b[0].item() == 3.0
        assert res["n"] == 7


def _collective_on_rank0_alone() -> int:
    """Rank 0 starts an all-reduce nobody joins and returns; rank 1 returns at once."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)
    return dist.get_rank()


def test_a_call_that_left_the_ranks_collectives_apart_renews_the_groups() -> None:
    # both ranks returned, rank 0 one collective ahead: the next call's first collective would pair with
    # that one (a 60 s gloo timeout, or another call's data); the pool sees the counts differ, says which
    # call left them so, and starts the next call on fresh groups
    apart = r"_collective_on_rank0_alone returned on every rank, but .* different numbers of operations"
    with pytest.warns(UserWarning, match=apart):
        assert spmd(2, _collective_on_rank0_alone) == [0, 1]
    assert spmd(2, _rank_world_sum, timeout=30) == [(0, 2, 3.0), (1, 2, 3.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calls in step: no warning
        assert spmd(2, _rank_world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


def _exchange_tags_on_rank0_alone() -> int:
    """Rank 0 draws two exchange tags of the default group that the others never draw."""
    from fsdpfn.core.exchange import Exchange

    if dist.get_rank() == 0:
        Exchange(dist.group.WORLD, 0, dist.get_world_size()).tags(2)
    return dist.get_rank()


def _exchange_tags_drawn() -> int:
    from fsdpfn.core.exchange import Exchange

    return Exchange(dist.group.WORLD, dist.get_rank(), dist.get_world_size()).tags()


def test_a_call_that_left_the_ranks_exchange_tags_apart_renews_the_groups() -> None:
    # gloo counts no operation for a tag drawn and not sent, so only fsdpfn's own counter shows it: the
    # next exchange would pair rank 0's tag 2 with the others' tag 0 and wait for a message never sent
    apart = r"_exchange_tags_on_rank0_alone returned on every rank, but .* exchange tags on group '\w+' \[(\d+), (\d+), (\d+)\]"
    with pytest.warns(UserWarning, match=apart) as caught:
        assert spmd(3, _exchange_tags_on_rank0_alone) == [0, 1, 2]
    drawn = [int(n) for n in re.search(apart, str(caught[0].message)).groups()]  # (earlier calls drew some alike)
    assert drawn[0] == drawn[1] + 2 == drawn[2] + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # renewed: every rank draws from tag 0 again, in step
        assert spmd(3, _exchange_tags_drawn) == [0, 0, 0]
        assert spmd(3, _exchange_tags_drawn) == [1, 1, 1]


def _raises_after_a_collective_on_rank0_alone(alone: bool) -> None:
    if alone and dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)
    raise ValueError(f"rank {dist.get_rank()} fails")


@pytest.mark.parametrize("alone", [True, False])
def test_a_failed_calls_report_says_whether_the_ranks_had_diverged(alone: bool) -> None:
    # a hang or timeout inside one collective is a divergence or a transport fault: the report tells them apart
    with pytest.raises(ValueError) as info:
        spmd(3, _raises_after_a_collective_on_rank0_alone, alone)
    apart = "the ranks' process groups were apart (operations on group "
    assert (apart in str(info.value)) == alone, str(info.value)
    if alone:
        assert re.search(r"operations on group '\w+' \[(\d+), (\d+), \2\]", str(info.value))
        # and each rank's last operations say which collective rank 0 ran alone, and where
        lone = r"gloop?:?all_?reduce\(\[1\] Float\) \w+ at test_testing_pool\.py:\d+ \(_raises_after_a_collective_on_rank0_alone\)"
        sections = str(info.value).split("rank 1")
        assert re.search(lone, sections[0]) and not re.search(lone, "rank 1".join(sections[1:])), str(info.value)
    assert spmd(3, _rank_world_sum) == [(r, 3, 6.0) for r in range(3)]  # renewed: in step again


def _sends_at_once(conn) -> bool:
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        return bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def _worker_sends_at_once() -> list[bool]:
    import gc
    from multiprocessing.connection import Connection

    return [_sends_at_once(c) for c in gc.get_objects() if isinstance(c, Connection) and not c.closed]


@pytest.mark.parametrize("world", [1, 3])
def test_both_ends_of_every_pool_connection_send_each_message_at_once(world: int) -> None:
    # without TCP_NODELAY the parent's ("tidy",) and the next ("call", ...) met Nagle's algorithm and the
    # worker's delayed acknowledgement: each spmd call took 44 ms longer (the suite, minutes)
    for r, found in enumerate(spmd(world, _worker_sends_at_once)):
        assert found == [True], (r, found)
    assert all(_sends_at_once(c) for c in pool_mod._POOLS[world].conns)


def test_a_call_that_raised_leaves_the_workers_with_fresh_groups() -> None:
    before = spmd(2, _pid)
    with pytest.raises(ValueError, match="only rank 1"):
        spmd(2, _raise_alone_on_rank1)
    assert spmd(2, _pid) == before  # the same workers: no new pool to start
    assert spmd(2, _rank_world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
    # a message the failed call sent and nobody received is not taken by a later receive
    with pytest.raises(ValueError, match="after sending"):
        spmd(2, _send_then_raise, 1.0)
    assert spmd(2, _exchange_tag7, 2.0) == [2.0, 2.0]
    assert spmd(2, _pid) == before


def test_a_hang_discards_the_pool() -> None:
    before = spmd(2, _pid)
    with pytest.raises(SpmdTimeout):
        spmd(2, _lonely_all_reduce, timeout=3)
    after = spmd(2, _pid)
    assert not set(before) & set(after)
    assert spmd(2, _rank_world_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_the_groups_calls_create_are_destroyed_between_calls() -> None:
    held = [spmd(2, _groups_then_new_group) for _ in range(TIDY_ABOVE + 3)]
    assert all(after == before + 1 for call in held for before, after in call), held
    counts = [call[0][0] for call in held]  # groups on entry: the pool's own, those in use, the dropped
    assert any(b < a for a, b in zip(counts, counts[1:])), counts  # without tidying they only grow
    assert max(counts) - min(counts) <= TIDY_ABOVE, counts


def test_groups_and_meshes_kept_across_calls_are_not_destroyed() -> None:
    for i in range(TIDY_ABOVE + 3):  # the throwaway groups make the pool tidy on the way
        assert spmd(2, _cached_group_and_mesh_still_work) == [4.0, 4.0], i


@pytest.mark.parametrize("libs", [("torch.distributed.fsdp", "fsdpfn.compat"), ("fsdpfn.compat",)])
def test_an_equal_mesh_in_a_later_call_gets_live_groups(libs) -> None:
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 6).weight.detach().sum().item()
    for i in range(TIDY_ABOVE // 2 + 2):  # two groups per call: the pool tidies on the way
        assert spmd(4, _hsdp_full_tensor, libs[i % len(libs)]) == pytest.approx([expected] * 4), i


def test_exception_type_preserved_and_rank_named() -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 1: bad weight shape") as info:
        spmd(2, _raise_on_rank1, "bad weight shape")
    assert time.monotonic() - t0 < 30
    msg = str(info.value)
    assert "Traceback" in msg and "_raise_on_rank1" in msg  # rank 1's traceback
    assert "rank 0 did not answer" in msg and "all_reduce" in msg  # rank 0's stack
    assert isinstance(info.value.__cause__, ValueError)
    assert sorted(info.value.rank_errors) == [0, 1]  # type: ignore[attr-defined]


def test_reraise_false_and_mixed_types_give_spmd_error() -> None:
    with pytest.raises(SpmdError, match="rank 1") as info:
        spmd(2, _raise_alone_on_rank1, reraise=False)
    assert isinstance(info.value.original, ValueError)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(SpmdError, match="KeyError") as info2:
        spmd(2, _raise_different_types)
    assert sorted(info2.value.rank_errors) == [0, 1]
    assert "ValueError" in str(info2.value)
    # A type whose constructor does not take one message falls back to SpmdError.
    with pytest.raises(SpmdError, match="x/y") as info3:
        spmd(1, _raise_two_arg_error)
    assert isinstance(info3.value.original, _TwoArgError)


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(TypeError, match="not picklable"):
        spmd(1, _unpicklable_result)


@pytest.mark.parametrize("fn", [_sleep_on_rank0, _lonely_all_reduce])
def test_hang_raises_timeout_with_stack(fn) -> None:
    t0 = time.monotonic()
    with pytest.raises(SpmdTimeout, match="rank 0 did not answer within 3") as info:
        spmd(2, fn, timeout=3)
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 20
    assert isinstance(info.value, TimeoutError)
    assert fn.__name__ in str(info.value)  # the stack dump says where it hangs
    assert list(info.value.rank_errors) == [0]


def test_dead_worker_reported_with_exit_code() -> None:
    with pytest.raises(SpmdError, match="rank 1") as info:
        spmd(2, _exit3_on_rank1)
    assert "exit code 3" in str(info.value) and "died" in info.value.rank_errors[1]
    with pytest.raises(SpmdError, match="SIGKILL"):
        spmd(1, _sigkill_self)


def test_unpicklable_fn_fails_fast_in_parent() -> None:
    pools = dict(pool_mod._POOLS)
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="picklable"):
        spmd(2, lambda: 1)
    with pytest.raises(TypeError, match="picklable"):
        spmd(2, _pid, threading.Lock())
    assert time.monotonic() - t0 < 1
    assert pool_mod._POOLS == pools  # nothing was started or discarded


def test_bad_world_size() -> None:
    for w in (0, 9, 2.0):
        with pytest.raises(ValueError, match="world_size"):
            spmd(w, _pid)  # type: ignore[arg-type]


@pytest.fixture
def own_pools():
    """Pools of the test's own: those earlier tests started are set aside and come back after it, so
    a test that shuts every pool down does not make later tests start theirs again (a world-8 pool is
    eight interpreters importing torch on two cores: ~15 s)."""
    kept = dict(pool_mod._POOLS)
    pool_mod._POOLS.clear()
    try:
        yield
    finally:
        shutdown_pools()
        pool_mod._POOLS.update(kept)


def test_shutdown_pools_then_restart(own_pools) -> None:
    pids = spmd(1, _pid)
    shutdown_pools()
    assert pool_mod._POOLS == {}
    assert spmd(1, _pid) != pids


def test_spmd_error_pickles() -> None:
    err = SpmdTimeout("rank 0 hung", {0: "stack"}, None)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SpmdTimeout and str(back) == "rank 0 hung" and back.rank_errors == {0: "stack"}
