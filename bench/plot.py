"""Plot bench/step.py results: per model, step time and peak memory per variant, a group of bars per run.

    python bench/plot.py results/compute_w2.json results/overhead_w2.json --png step.png

Needs matplotlib (the optional ``bench`` extra): ``pip install -e .[bench]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

COLORS = {"torch": "#4c72b0", "functional": "#dd8452", "local": "#55a868", "compat": "#c44e52"}


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The JSON results, in the order given."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def run_label(r: dict[str, Any]) -> str:
    """Short label of one run: world, device (threads per rank on CPU), dtype and unit fusion."""
    dev = f"cpu, {r.get('threads', '?')} thr/rank" if r["device"] == "cpu" else r["device"].replace("NVIDIA ", "")
    mbb = r.get("min_bucket_bytes")
    fused = f", fused {mbb // 1024} KiB" if isinstance(mbb, int) and mbb else (f", fused {mbb}" if mbb else "")
    return f"world {r['world']}\n{dev}\n{r.get('dtype', 'float32')}{fused}"


def _bars(ax: Any, runs: list[dict[str, Any]], names: list[str], key: str) -> None:
    """One group of bars per run, one bar per variant; step bars get min-max whiskers and every
    non-torch bar its ratio to torch."""
    width = 0.8 / max(1, len(names))
    scale = 1e3 if key == "step_s" else 1.0
    for j, name in enumerate(names):
        for i, r in enumerate(runs):
            v = r["variants"].get(name)
            if not v or "skipped" in v:
                continue
            x = i + (j - (len(names) - 1) / 2) * width
            val = v[key] * scale
            err = None
            top = val
            if key == "step_s":
                err = [[val - v["step_s_min"] * scale], [v["step_s_max"] * scale - val]]
                top = v["step_s_max"] * scale
            ax.bar([x], [val], width, color=COLORS[name], yerr=err, capsize=2, error_kw={"lw": 0.8},
                   label=name if i == 0 or not ax.get_legend_handles_labels()[1].count(name) else None)
            ratio = v.get("step_vs_torch" if key == "step_s" else "peak_vs_torch")
            if ratio is not None and name != "torch":
                ax.annotate(f"{ratio:.2f}x", (x, top), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([run_label(r) for r in runs], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)


def plot(runs: list[dict[str, Any]], png: str) -> None:
    """One row per model, two panels per row (step time ms, peak MiB), each run a group of bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        models.setdefault(r["model"], []).append(r)
    names = [n for n in COLORS if any(n in r["variants"] and "skipped" not in r["variants"][n] for r in runs)]
    most = max(len(rs) for rs in models.values())
    fig, axes = plt.subplots(len(models), 2, figsize=(max(8.0, 2.2 * most + 4), 3.6 * len(models)), squeeze=False)
    for row, (model, rs) in enumerate(models.items()):
        _bars(axes[row][0], rs, names, "step_s")
        _bars(axes[row][1], rs, names, "peak_mib")
        axes[row][0].set_title(f"{model}: step time (ms, median, min-max whiskers)", fontsize=10)
        axes[row][1].set_title(f"{model}: peak memory per rank (MiB)", fontsize=10)
        axes[row][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"fsdpfn vs torch FSDP2 (fully_shard), torch {runs[0]['torch_version']}; labels = ratio to torch", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="result files written by bench/step.py --json")
    p.add_argument("--png", required=True, help="where to write the figure")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench/plot.py needs matplotlib, the optional 'bench' extra: pip install -e .[bench]", file=sys.stderr)
        return 1
    plot(load(args.json), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
