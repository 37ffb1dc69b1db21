"""Smoke tests of the benchmarks (bench/step.py, bench/pipeline_step.py and the tools beside them): they run,
check the losses, and write the documented JSON. Tiny models, a few steps; no timing assertions
(performance is a benchmark, not a test)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP_KEYS = {"device", "world", "torch_version", "model", "date", "host", "steps", "warmup", "variants", "check"}
MEASURED_KEYS = {"step_s", "step_s_min", "step_s_max", "peak_mib", "final_loss"}
SHARDED_KEYS = {"comm_s", "step_vs_torch", "peak_vs_torch", "step_vs_floor", "collectives"}


def _env() -> dict[str, str]:
    """This environment without torchrun's rank variables: a child process starts a world of its own."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def _run(tmp_path: pathlib.Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out.json"
    env = _env()
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
        assert 0 < r["opt_cpu_s"] <= by_thread["main"] + 0.01  # the update, on the main thread
    for name in ("torch", "functional"):
        assert SHARDED_KEYS <= variants[name].keys(), (name, variants[name].keys())
    assert variants["torch"]["step_vs_torch"] == 1.0
    # every variant starts from the same weights and sees the same data
    losses = [variants[n]["final_loss"] for n in ("torch", "functional", "local")]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    assert MEASURED_KEYS | SHARDED_KEYS <= variants["compat"].keys()
    assert "step ms median" in proc.stdout  # the printed table


def test_step_benchmark_with_torchs_fused_adamw(tmp_path):
    # --torch-foreach fused: torch.optim.AdamW(fused=True) in torch, compat and local; the check still holds
    _, result = _run(tmp_path, "--check", "--variants", "torch,compat,local", "--torch-foreach", "fused")
    assert result["torch_foreach"] == "fused" and result["check"]["ok"]
    assert list(result["variants"]) == ["torch", "compat", "local"]


def test_step_benchmark_runs_a_batchnorm_cnn_shape(tmp_path):
    # a 'cnn:...' shape (BatchNorm buffers, convolutions, a classifier): every eager variant agrees with
    # the global-batch reference when torch's side runs the fused AdamW kernel fsdpfn.optim.adamw runs
    _, result = _run(tmp_path, "--model", "cnn:blocks=2,width=4,seq=4,vocab=3,batch=2", "--check", "--torch-foreach", "fused")
    assert result["model"] == "cnn:blocks=2,width=4,seq=4,vocab=3,batch=2" and result["check"]["ok"]
    assert list(result["variants"]) == ["torch", "functional", "local", "compat"]


def test_step_benchmark_runs_an_lstm_shape(tmp_path):
    # an 'rnn:...' shape (nn.LSTM blocks, whose parameters also live in the module's own cache): every
    # variant agrees with the global-batch reference
    _, result = _run(tmp_path, "--model", "rnn:blocks=2,width=6,seq=3,batch=2", "--check", "--variants", "torch,functional,local,compat")
    assert result["model"] == "rnn:blocks=2,width=6,seq=3,batch=2" and result["check"]["ok"]


def test_step_benchmark_runs_a_unet_shape(tmp_path):
    # a 'unet:...' shape (1-D convs and GroupNorm; skip connections hold each down level's output until its
    # up level runs, and the units are the levels): every variant agrees with the global-batch reference
    _, result = _run(tmp_path, "--model", "unet:blocks=2,width=2,seq=8,batch=2", "--check", "--variants", "torch,functional,local,compat")
    assert result["model"] == "unet:blocks=2,width=2,seq=8,batch=2" and result["check"]["ok"]


def test_step_benchmark_variant_subset(tmp_path):
    _, result = _run(tmp_path, "--variants", "functional,local,functional_kept,compat_kept", "--check")
    assert list(result["variants"]) == ["functional", "local", "functional_kept", "compat_kept"]
    losses = [v["final_loss"] for v in result["variants"].values()]  # keeping blocks gathered changes no number
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    assert "step_vs_torch" not in result["variants"]["functional"]  # no torch run: no ratio to it
    assert result["variants"]["functional"]["step_vs_floor"] > 0


def test_fake_world_runs_every_variant_in_one_process_with_traces(tmp_path):
    # --fake-world: rank 0 of a fake 4-rank world in one process (what a one-GPU machine does for world 8)
    proc, result = _run(tmp_path, "--fake-world", "4", "--variants", "torch,functional,compat", "--trace", str(tmp_path / "tr"))
    assert result["world"] == 4 and result["fake_world"] is True
    assert "check" in result and result["check"]["failures"] == []  # no reference to compare with
    for name in ("torch", "functional", "compat"):
        r = result["variants"][name]
        assert MEASURED_KEYS <= r.keys() and r["peak_mib"] > 0
        trace = r["trace"]
        assert pathlib.Path(trace["path"]).is_file() and trace["path"].endswith(".json.gz")
        assert trace["compute_stream"] is None and trace["side"] == {}  # CPU: no GPU streams in the trace
    shards = result["variants"]["functional"]["peak_mib"]
    assert shards < result["variants"]["torch"]["peak_mib"] * 1.5  # both sharded over 4 fake ranks


def test_fake_world_refuses_check_and_torchrun(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import step

    with pytest.raises(SystemExit) as exc:
        step.parse_args(["--fake-world", "4", "--check"])
    assert exc.value.code == 2 and "--check needs real collectives" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        step.parse_args(["--fake-world", "4"])
    assert exc.value.code == 2 and "not torchrun" in capsys.readouterr().err


def test_trace_overlap_measures_side_streams_against_the_busiest_stream():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from trace_overlap import stream_overlap
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def kernel(stream, ts, dur, name="k"):
        return {"cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    events = [
        kernel(7, 0, 100, "gemm"), kernel(7, 150, 50, "gemm"),       # compute: 150 us busy
        kernel(20, 90, 20, "copy"), kernel(20, 95, 30, "copy"),     # side: [90, 125) -> 35 busy, 10 with compute
        kernel(21, 300, 10, "nccl"),                                  # side: after compute, no overlap
        {"cat": "cpu_op", "ts": 0, "dur": 1000, "name": "aten::mm"},  # CPU events are not GPU work
    ]
    s = stream_overlap(events)
    assert s["compute_stream"] == "7" and s["compute_ms"] == 0.15
    assert s["side"]["20"]["busy_ms"] == 0.035 and abs(s["side"]["20"]["overlap_ms"] - 0.010) < 1e-12
    assert s["side"]["20"]["events"] == 2 and s["side"]["20"]["names"] == ["copy"]
    assert s["side"]["21"]["overlap_ms"] == 0.0 and s["side"]["21"]["overlap_share"] == 0.0
    assert stream_overlap([{"cat": "cpu_op", "ts": 0, "dur": 5}]) == {"compute_stream": None, "compute_ms": 0.0, "side": {}}


def test_gpu_session_script_parses_and_refuses_an_unknown_stage(tmp_path):
    script = ROOT / "bench" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    proc = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 2 and "stage must be 'all', 'tests', 'bench', 'compiled', 'profile', 'streams', 'sanitizer' or 'suite'" in proc.stdout
    assert (tmp_path / "device.txt").is_file()  # what ran where is recorded first


@pytest.mark.parametrize("fake", [0, 4])
def test_profile_script_runs_and_reports_its_step(fake):
    # bench/prof_step.py, as the GPU session's 'profile' stage runs it (there on cuda, bf16), on a tiny model
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "bench" / "prof_step.py"), "--model", "gpt1b", "--tiny", "--variant", "compat",
           "--dtype", "bf16", "--fake-world", str(fake), "--steps", "2", "--warmup", "1", "--top", "3", "--sort", "tottime"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    where = f"rank 0 of a fake world of {fake}" if fake else "world 1"
    assert f"compat on gpt1b (cpu, bf16), {where}:" in proc.stdout and "ms/step plain" in proc.stdout, proc.stdout
    assert "Ordered by: internal time" in proc.stdout


def test_emulated_link_delays_every_collective_of_a_fake_world(tmp_path):
    # bench/emulate_link.py: in a fake world each collective first spends the emulated link's time; here we
    # check that every library's collectives went through it (counts), not how long they took
    proc, result = _run(tmp_path, "--fake-world", "4", "--emulate-link", "2,50")
    link = result["emulated_link"]
    assert link["gbps"] == 2.0 and abs(link["latency_us"] - 50) < 1e-6
    assert link["calls"].get("gather", 0) > 0 and link["calls"].get("reduce", 0) > 0, link
    assert link["emulated_s"] > 0


@pytest.mark.parametrize("bad", ["0", "x", "1,-2", "1,2,3"])
def test_emulated_link_refuses_a_bad_link(bad):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from emulate_link import parse_link
    finally:
        sys.path.remove(str(ROOT / "bench"))
    with pytest.raises(ValueError, match="GBPS"):
        parse_link(bad)


def test_emulated_link_refuses_a_real_world():
    env = _env()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step.py"), "--model", "overhead", "--tiny", "--device", "cpu",
                           "--emulate-link", "1"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "--emulate-link needs --fake-world" in proc.stderr


def test_the_cpu_floor_counts_each_variants_own_optimizer_update(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from bench_measure import add_ratios

    def variants(functional_opt):
        local = {"step_s": 0.10, "cpu_s": 0.10, "opt_cpu_s": 0.03, "peak_mib": 10.0}
        functional = {"step_s": 0.12, "cpu_s": 0.11, "comm_s": 0.05, "comm_cpu_s": 0.04, "peak_mib": 9.0}
        if functional_opt is not None:
            functional["opt_cpu_s"] = functional_opt
        return {"local": local, "functional": functional}

    timed = variants(0.01)
    add_ratios(timed, ("functional",), cores_per_rank=1.0)
    r = timed["functional"]
    assert r["cpu_floor_compute_s"] == pytest.approx(0.10 - 0.03 + 0.01)  # local's forward + backward, its own update
    assert r["cpu_floor_s"] == pytest.approx(0.08 + 0.04)
    assert r["step_vs_cpu_floor"] == pytest.approx(0.12 / 0.12)
    untimed = variants(None)  # a traced step compiles its update in: local's whole step stands in
    add_ratios(untimed, ("functional",), cores_per_rank=1.0)
    assert untimed["functional"]["cpu_floor_compute_s"] == pytest.approx(0.10)
    assert untimed["functional"]["cpu_floor_s"] == pytest.approx(0.14)


def test_pipeline_benchmark_runs_both_libraries_and_counts_their_gathers(tmp_path):
    # bench/pipeline_step.py at pp 2 x dp 2 on a tiny stage: both libraries step, and the JSON says how
    # often each gathers (compat keeps copies as FSDP2 keeps unsharded parameters: never more often)
    out = tmp_path / "pp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(ROOT / "bench" / "pipeline_step.py"),
           "--blocks", "2", "--width", "8", "--steps", "1", "--warmup", "1", "--microbatches", "2",
           "--schedules", "Schedule1F1B", "--reshard", "false,true", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["schedule"], r["reshard"]) for r in results] == [("Schedule1F1B", "false"), ("Schedule1F1B", "true")]
    for r in results:
        assert r["torch_ms"] > 0 and r["compat_ms"] > 0
        assert 0 < r["compat_all_gathers_per_step"] <= r["torch_all_gathers_per_step"], r
        assert r["compat_reduce_scatters_per_step"] > 0


@pytest.mark.parametrize("dtype, recipes", [("fp32", None), ("bf16", "accum_rs")])
def test_recipe_benchmark_runs_every_recipe_and_checks_the_losses(tmp_path, dtype, recipes):
    # bench/recipe_step.py at world 2 on a tiny GPT: both libraries train under every recipe, their losses
    # agree (the script exits non-zero, naming the recipe, beyond its tolerance), peaks are measured, and it
    # exits cleanly (it frees the models before the process group: see its gc.collect())
    out = tmp_path / "recipes.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "bench" / "recipe_step.py"),
           "--model", "gpt:blocks=2,width=16,hidden=32,heads=2,seq=8,vocab=40,batch=2",
           "--steps", "1", "--warmup", "1", "--dtype", dtype, "--json", str(out)] + (["--recipes", recipes] if recipes else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    want = recipes.split(",") if recipes else ["plain", "titan", "ac", "lora", "eval", "accum", "accum_rs", "shape_check", "dpo"]
    assert [r["recipe"] for r in results] == want
    for r in results:
        assert r["torch_ms"] > 0 and r["compat_ms"] > 0 and r["torch_peak_mib"] > 0 and r["compat_peak_mib"] > 0, r
        assert r["loss_rel_diff"] <= (2e-2 if dtype == "bf16" else 1e-4), r
