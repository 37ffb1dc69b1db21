"""Exact resume: an interrupted, resumed run of the training example ends bit-for-bit where an
uninterrupted run ends (CPU)."""

import importlib.util
import pathlib

import pytest
import torch

from fsdpfn.testing import spmd

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--steps", "8", "--dim", "32", "--layers", "2", "--batch", "4", "--seq", "16", "--log-every", "4", "--no-progress"]


def _train(argv):
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(argv)
    return result["first_step"], result["params"]


@pytest.mark.parametrize("world", [1, 2])
def test_resume_after_interruption_is_bit_exact(world, tmp_path):
    straight = spmd(world, _train, ARGS)
    ckpt = str(tmp_path / "ckpt")
    common = ARGS + ["--ckpt", ckpt, "--save-every", "3"]
    spmd(world, _train, common + ["--stop-after", "5"])  # saved at step 3, "killed" after step 5
    resumed = spmd(world, _train, common + ["--resume"])  # continues from step 3
    for (first_a, a), (first_b, b) in zip(straight, resumed):
        assert (first_a, first_b) == (1, 4)  # the second run really resumed after step 3
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
