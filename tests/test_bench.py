"""Smoke test of the step benchmark (bench/step.py): it runs, checks the losses, and writes the documented
JSON. Tiny model, world 1, a few steps; no timing assertions (performance is a benchmark, not a test)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP_KEYS = {"device", "world", "torch_version", "model", "date", "host", "steps", "warmup", "variants", "check"}
MEASURED_KEYS = {"step_s", "step_s_min", "step_s_max", "peak_mib", "final_loss"}
SHARDED_KEYS = {"comm_s", "step_vs_torch", "peak_vs_torch", "step_vs_floor", "collectives"}


def _run(tmp_path: pathlib.Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, str(ROOT / "bench" / "step.py"), "--model", "overhead", "--tiny", "--steps", "2",
           "--warmup", "1", "--device", "cpu", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_step_benchmark_smoke(tmp_path):
    proc, result = _run(tmp_path, "--check")
    assert TOP_KEYS <= result.keys()
    assert result["world"] == 1 and result["device"] == "cpu" and result["model"] == "overhead"
    assert result["check"]["ok"]
    variants = result["variants"]
    assert list(variants) == ["torch", "functional", "local", "compat"]
    for name in ("torch", "functional", "local"):
        r = variants[name]
        assert MEASURED_KEYS <= r.keys(), (name, r.keys())
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
        assert r["peak_mib"] > 0
        by_thread = r["cpu_by_thread_s"]  # where the step's CPU went: the Python thread computes
        assert set(by_thread) == {"main", "gloo", "other"} and by_thread["main"] > 0
        assert sum(by_thread.values()) <= 1.5 * r["cpu_s"] + 0.01, (by_thread, r["cpu_s"])
    for name in ("torch", "functional"):
        assert SHARDED_KEYS <= variants[name].keys(), (name, variants[name].keys())
    assert variants["torch"]["step_vs_torch"] == 1.0
    # every variant starts from the same weights and sees the same data
    losses = [variants[n]["final_loss"] for n in ("torch", "functional", "local")]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    compat = variants["compat"]
    if "skipped" in compat:
        assert compat["skipped"] == "fsdpfn.compat not available"
        assert "fsdpfn.compat not available" in proc.stdout
    else:
        assert MEASURED_KEYS | SHARDED_KEYS <= compat.keys()
    assert "step ms median" in proc.stdout  # the printed table


def test_step_benchmark_variant_subset(tmp_path):
    _, result = _run(tmp_path, "--variants", "functional,local")
    assert list(result["variants"]) == ["functional", "local"]
    assert "step_vs_torch" not in result["variants"]["functional"]  # no torch run: no ratio to it
    assert result["variants"]["functional"]["step_vs_floor"] > 0
