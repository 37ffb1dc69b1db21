"""Print a Markdown table of bench/step.py results, one row per run (for bench/RESULTS.md).

    python bench/table.py bench/results/run3/*.json --machine "2-core CPU (this dev machine)"
"""

from __future__ import annotations

import argparse
import json
from typing import Any

VARIANTS = ("torch", "functional", "local", "compat")


def _ms(v: dict[str, Any] | None, key: str = "step_s") -> str:
    return f"{v[key] * 1e3:.1f}" if v and key in v else "–"


def _x(v: dict[str, Any] | None, key: str) -> str:
    return f"{v[key]:.2f}" if v and v.get(key) is not None else "–"


def _threads(v: dict[str, Any] | None) -> str:
    by = (v or {}).get("cpu_by_thread_s")
    return f"{by['main'] * 1e3:.0f}+{by['gloo'] * 1e3:.0f}" if by else "–"


def row(r: dict[str, Any], machine: str) -> str:
    """One table row: run metadata, then step ms / peak MiB per variant, then the sharded ratios."""
    vs = r["variants"]
    load = r.get("load", {})
    psi = "/".join(f"{load[k]['cpu_pressure_avg60']:.0f}" for k in ("before", "after") if "cpu_pressure_avg60" in load.get(k, {}))
    cells = [r["date"][:16].replace("T", " "), machine, r["device"], str(r["world"]), str(r.get("threads", "?")),
             r["torch_version"], r.get("fsdpfn_commit", "?"), r["model"], r.get("dtype", "float32"),
             str(r.get("min_bucket_bytes") or "–"), str(r["steps"]), psi or "–"]
    for n in VARIANTS:
        v = vs.get(n)
        cells.append("skipped" if v and "skipped" in v else (f"{_ms(v)} / {v['peak_mib']:.1f}" if v else "–"))
    cells.append(" / ".join(_ms(vs.get(n), "cpu_s") for n in VARIANTS))
    for n in ("torch", "functional"):
        cells.append(_ms(vs.get(n), "comm_s"))
    for n in ("functional", "compat"):
        v = vs.get(n)
        cells.append("–" if not v or "skipped" in v else f"{_x(v, 'step_vs_torch')} / {_x(v, 'peak_vs_torch')}")
    cells += [_x(vs.get(n), "step_vs_floor") for n in ("torch", "functional", "compat")]
    cells.append(" / ".join(_x(vs.get(n), "step_vs_cpu_floor") for n in ("functional", "compat")))
    cells.append(" / ".join(_threads(vs.get(n)) for n in ("torch", "functional", "compat")))
    cells.append("ok" if r["check"]["ok"] else "FAIL")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| date | machine | device | world | threads | torch | fsdpfn | model | dtype | fused bytes | steps | CPU PSI % before/after "
          "| torch ms / MiB | functional ms / MiB | local ms / MiB | compat ms / MiB | CPU ms per step torch / functional / local / compat "
          "| torch comm ms | functional comm ms | functional step / peak vs torch | compat step / peak vs torch "
          "| torch step vs floor | functional step vs floor | compat step vs floor | functional / compat step vs CPU floor "
          "| CPU ms main+gloo threads torch / functional / compat | check |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+")
    p.add_argument("--machine", default="2-core CPU (this dev machine)")
    args = p.parse_args(argv)
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for path in args.json:
        with open(path) as f:
            print(row(json.load(f), args.machine))


if __name__ == "__main__":
    main()
