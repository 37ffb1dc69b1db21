"""Never hang, never silently wrong: divergent ranks are reported, waits time out with an explanation,
a failing rank makes its peers exit, and non-finite gradients are caught on every rank."""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import fsdpfn
from fsdpfn.debug import CollectivePlanError, CollectiveTimeout
from fsdpfn.testing import spmd

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Skippy(nn.Module):
    """Four blocks; ranks listed in ``skip_on`` skip block 1 (data-dependent control flow gone wrong)."""

    def __init__(self, skip_on):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.skip_on = skip_on

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if i == 1 and torch.distributed.get_rank() in self.skip_on:
                continue
            x = torch.tanh(b(x))
        return x


def _divergent(skip_on, timeout):
    model = Skippy(skip_on)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[f"blocks.{i}" for i in range(4)])
    params.plan.comm.guard.timeout = timeout
    apply = fsdpfn.fsdp(model)
    with fsdpfn.debug.check_collectives():
        fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 4)).sum())(params)


@pytest.mark.parametrize("world", [2, 3])
def test_divergent_control_flow_is_reported_naming_each_ranks_unit(world):
    start = time.monotonic()
    with pytest.raises(CollectivePlanError) as info:
        spmd(world, _divergent, {1}, 30.0)
    assert time.monotonic() - start < 15  # reported within seconds, not after a watchdog
    text = str(info.value)
    assert "ranks diverged" in text
    for rank in range(world):  # every rank's view is listed, and every rank raised
        assert f"rank {rank}: #" in text
    lines = {r: next(line for line in text.splitlines() if line.strip().startswith(f"rank {r}: #")) for r in range(world)}
    assert "unit 'blocks.1'" in lines[0]  # rank 0 needs blocks.1 again in backward ...
    assert "unit 'blocks.1'" not in lines[1]  # ... which rank 1 skipped: it is already at another unit
    assert not fsdpfn.debug.checking()  # the context manager restored the switch


def _stalls(timeout, min_bucket_bytes=None):
    import torch.distributed as dist

    model = Skippy(set())
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[f"blocks.{i}" for i in range(4)], min_bucket_bytes=min_bucket_bytes)
    params.plan.comm.guard.timeout = timeout
    apply = fsdpfn.fsdp(model)
    if dist.get_rank() == 1:
        time.sleep(timeout + 0.8)  # alive, but not taking part: the others must not wait forever
        return "slept"
    fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 4)).sum())(params)
    return "finished"


def test_a_wait_times_out_with_the_unit_and_the_last_completed_collective():
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        spmd(2, _stalls, 2.0, timeout=30)
    assert time.monotonic() - start < 20
    errors = info.value.rank_errors
    assert set(errors) == {0}  # rank 1 returned normally; rank 0 did not wait forever
    assert "did not complete within 2 s" in errors[0] and "all_gather of unit 'blocks.0'" in errors[0]
    assert "last completed collective: none yet" in errors[0]


def _stalls_on_a_group_with_a_short_timeout(seconds):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=seconds))
    model = Skippy(set())
    params = fsdpfn.shard(model, DeviceMesh.from_group(group, "cpu"), units=[f"blocks.{i}" for i in range(4)])
    assert params.plan.comm.guard.timeout == 600  # FSDPFN_TIMEOUT's default: gloo's timeout fires first
    apply = fsdpfn.fsdp(model)
    if dist.get_rank() == 1:
        time.sleep(seconds + 1.5)
        return "slept"
    fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 4)).sum())(params)
    return "finished"


def test_a_wait_the_process_groups_own_timeout_ends_says_how_long_it_waited():
    # the message said "within 600 s" (the guard's timeout) when gloo had given up after the group's timeout
    with pytest.raises(CollectiveTimeout) as info:
        spmd(2, _stalls_on_a_group_with_a_short_timeout, 1.0, timeout=30)
    errors = info.value.rank_errors
    assert set(errors) == {0}
    assert "collective #1 " in errors[0] and "did not complete within 1 s (the process group's timeout)" in errors[0]


def test_a_peer_missing_from_the_first_calls_fusion_agreement_times_out():
    # min_bucket_bytes="auto": the first call exchanges the ranks' batch sizes and settles its fusion before any gather
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        spmd(2, _stalls, 2.0, "auto", timeout=30)
    assert time.monotonic() - start < 20
    errors = info.value.rank_errors
    assert set(errors) == {0}
    assert "did not complete within 2 s" in errors[0] and "all_reduce of fsdpfn's values of the ranks" in errors[0]  # (batch sizes)


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_failing_mid_backward_makes_its_peer_exit_with_a_message():
    # two plain processes (not torchrun, whose agent would kill the survivor before it could explain)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests/scripts/rank_failure.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert time.monotonic() - start < 60
    assert procs[1].returncode != 0 and "rank 1 fails in the middle of backward" in outs[1]
    # rank 0 does not hang: it exits non-zero naming the failed collective and the unit it was in
    assert procs[0].returncode != 0
    assert "CollectiveError" in outs[0] or "CollectiveTimeout" in outs[0], outs[0][-3000:]
    assert "of unit" in outs[0]
    assert "FSDPFN_DEBUG=1" in outs[0]  # the way to tell a divergence from a peer that failed on its own


def _nan_worker():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["1"])
    apply = fsdpfn.fsdp(model)
    x = torch.ones(2, 3)
    if dist.get_rank() == 1:
        x[0, 0] = float("nan")
    fsdpfn.value_and_grad(lambda p: apply(p, x).sum(), check_finite=True)(params)


def test_non_finite_gradients_are_caught_on_every_rank_naming_leaf_and_rank():
    with pytest.raises(FloatingPointError) as info:
        spmd(2, _nan_worker)
    text = str(info.value)
    assert "non-finite gradient in '0.weight' on rank 0" in text  # the NaN reached rank 0's shard too
    assert "'0.weight' on rank 1" in text
    assert "raised" in text and "rank(s) 0" in text and "1 (FloatingPointError)" in text  # every rank raised


def test_bad_debug_and_timeout_settings_are_refused_naming_the_variable(monkeypatch):
    from fsdpfn.core.guard import Guard, env_switch

    for off in ("", "0", "false", "No", " off "):
        assert env_switch("FSDPFN_DEBUG", off) is False
    for on in ("1", "TRUE", "yes", "on"):
        assert env_switch("FSDPFN_DEBUG", on) is True
    with pytest.raises(ValueError, match="FSDPFN_DEBUG='maybe' is neither on nor off"):
        env_switch("FSDPFN_DEBUG", "maybe")
    for bad in ("abc", "0", "-5", "nan", "inf"):  # (read by each Guard: no fresh process needed)
        monkeypatch.setenv("FSDPFN_TIMEOUT", bad)
        with pytest.raises(ValueError, match=re.escape(f"FSDPFN_TIMEOUT={bad!r}: a collective's timeout must be")):
            Guard(0)
    monkeypatch.delenv("FSDPFN_TIMEOUT")
    with pytest.raises(ValueError, match="timeout=0"):
        Guard(0, timeout=0)
    assert Guard(0, timeout=2).timeout == 2.0
    # FSDPFN_DEBUG is read when fsdpfn is imported: a typo stops the import, saying what to write
    proc = subprocess.run([sys.executable, "-c", "import fsdpfn"], env={**os.environ, "FSDPFN_DEBUG": "ture"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "set it to 1 (on) or 0 (off)" in proc.stderr, proc.stderr[-2000:]


class _WritesThroughData(torch.nn.Module):
    """Halves its weight through ``.data`` in training forwards (an EMA codebook's update, say): no
    version counter moves, so outside debug mode the write to the gathered copy is lost, silently (as with
    torch's fully_shard)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        if self.training:
            self.lin.weight.data.mul_(0.5)
        return self.lin(x)


def _data_write(layer, debug):
    import contextlib

    import fsdpfn.debug

    torch.manual_seed(0)
    model = torch.nn.Sequential(_WritesThroughData(), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    try:
        with fsdpfn.debug.check_collectives() if debug else contextlib.nullcontext():
            if layer == "functional":
                params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0"])
                apply = fsdpfn.fsdp(model)
                fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 3)).sum())(params)
            else:
                from fsdpfn.compat import fully_shard

                fully_shard(model[0])
                fully_shard(model)
                model(torch.ones(2, 3)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("layer", ["functional", "compat"])
def test_debug_mode_finds_writes_through_data_to_gathered_parameters(layer):
    assert spmd(2, _data_write, layer, False) == [None, None]  # not without debug mode: no counter moved
    for message in spmd(2, _data_write, layer, True):
        assert message is not None and "changed a parameter of unit '0' ('0.lin.weight', '0.lin.bias') in place" in message
