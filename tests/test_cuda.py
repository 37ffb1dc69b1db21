"""The CUDA half (issue #16): each check of tests/scripts/cuda_checks.py in a fresh process.

On a machine with a GPU every check runs: world-1 NCCL property tests against single-process autograd,
mixed precision, activation checkpointing, the compat layer against torch's ``fully_shard``, two ranks
sharing the GPU over gloo (skipped, saying why, where gloo lacks a collective on CUDA tensors) and, in a
fake world on the one GPU, stream ordering and buffer lifetimes under a deliberately slow stream. Without
a GPU the CUDA runs are skipped, and the world-1 checks run on CPU instead with a few examples, so the
script a GPU session will run is kept working by CI.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "cuda_checks.py"
WORLD1 = [
    "step_world1", "mixed_precision_world1", "checkpoint_world1", "compat_world1", "gloo_world2_step",
    "nested_root_world1", "compiled_blocks_world1", "loss_scale_fp16_world1", "recurrent_world1",
]  # fmt: skip
FAKE = [
    "fake_gather_waits_for_inputs", "fake_result_waits_for_gather", "fake_reduce_keeps_its_input",
    "fake_bucket_pack_waits_for_shards", "fake_bucket_pack_keeps_its_shards", "fake_flat_gather_waits_for_shards",
    "fake_span_gather_keeps_its_shards", "fake_step_memory", "fake_parked_memory",
]  # fmt: skip
STREAMS = FAKE[:-2]  # the stream checks: each has a mutant it must catch
NO_GPU = "CUDA path: needs a GPU (run on the lent GPU machine: bench/gpu_session.sh)"



def _env() -> dict[str, str]:
    """This environment without torchrun's rank variables: a child process starts a world of its own."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def _run(*checks: str, **env: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *checks], capture_output=True, text=True, timeout=900, env={**_env(), **env}
    )
    if proc.returncode == 3 and "unsupported" in proc.stdout:  # this torch's gloo lacks a collective on CUDA tensors
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{checks} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    for check in checks:
        assert f"{check}: ok" in proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("check", WORLD1 + FAKE)
def test_cuda(check):
    _run(check)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("check", STREAMS)
def test_cuda_stream_check_catches_its_mutant(check):
    # the core without the wait (or the kept input) that this check guards: the check must fail, with
    # its own assertion (wrong numbers), not a crash
    proc = subprocess.run([sys.executable, str(SCRIPT), check], capture_output=True, text=True, timeout=300,
                          env={**_env(), "FSDPFN_MUTANT": check})
    assert proc.returncode != 0 and f"{check}: ok" not in proc.stdout, f"{check} passed without its ordering"
    assert "AssertionError" in proc.stderr, proc.stderr[-4000:]


def test_the_cuda_checks_own_logic_on_cpu():
    # the same world-1 checks on CPU tensors (gloo), in one process: what a GPU session runs must not rot
    _run(*WORLD1, FSDPFN_CHECK_DEVICE="cpu", FSDPFN_EXAMPLES="3")


def test_the_script_names_its_checks_and_refuses_unknown_ones():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import cuda_checks
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert list(cuda_checks.CHECKS) == WORLD1 + FAKE
    with pytest.raises(SystemExit, match="checks: " + ", ".join(WORLD1 + FAKE)):
        cuda_checks.main(["no_such_check"])
    with pytest.raises(SystemExit, match="run it alone"):
        cuda_checks.main(["step_world1", FAKE[0]])
    assert list(cuda_checks.MUTANTS) == STREAMS
