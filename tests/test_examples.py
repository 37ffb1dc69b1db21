"""The examples run, and the training example's loss falls clearly (a short run, world 1 and 2)."""

import importlib.util
import pathlib

import pytest

from fsdpfn.testing import spmd

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["--steps", "60", "--dim", "64", "--batch", "8", "--seq", "32", "--log-every", "10", "--no-progress", "--lr", "1e-2", "--warmup", "5"]


def _run_example(name, argv):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv) if argv is not None else mod.main()


@pytest.mark.parametrize("world", [1, 2])
def test_training_example_loss_falls(world):
    for result in spmd(world, _run_example, "train", SHORT):
        losses = [loss for _, loss in result["losses"]]
        assert losses[0] > 3.0  # about log(vocab) at the start
        assert losses[-1] < 0.75 * losses[0], losses
        assert result["tokens_per_s"] > 0 and result["peak_mib"] > 0 and result["world"] == world


def test_training_example_ranks_agree_on_the_logged_loss():
    a, b = spmd(2, _run_example, "train", SHORT[:1] + ["5"] + SHORT[2:])
    assert a["losses"] == b["losses"]  # the logged loss is the mean over ranks


def test_layout_demo_runs():
    for rank, lines in enumerate(spmd(2, _run_example, "layout_demo", None)):
        assert lines[0].startswith(f"rank {rank}: ")
        assert any("unshard reproduces the model exactly: True" in line for line in lines)
