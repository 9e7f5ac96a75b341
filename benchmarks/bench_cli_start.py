"""How long the CLI takes to answer `--version` and `--help` (top level and every command's),
against a bare `python -c pass` measured in the same run: seconds and the ratio.

    python benchmarks/bench_cli_start.py [--repeat 9] [--json]

Each command line runs --repeat times, alternating with a bare start, and the figure is the median
of each (the best is shown beside it: the run least disturbed by other work on a shared machine);
the ratio is the command's median over the bare start's median, both from the same run. The CLI is
started the way a user starts it: the `hybrid-build` script beside this interpreter (else
`python -m`).

Two settings: `cached`, with hybrid-build's bytecode written once into a temporary cache (what an
installed copy runs with after its first start), and `uncompiled`, with PYTHONDONTWRITEBYTECODE=1
and no cache besides the interpreter's own (a checkout never run without that variable compiles
hybrid-build's modules at every start).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import best_of, measure  # noqa: E402


def cli() -> list[str]:
    script = Path(sys.executable).parent / "hybrid-build"
    if script.exists():
        return [str(script)]
    found = shutil.which("hybrid-build")
    return [found] if found else [sys.executable, "-m", "hybrid_build.pipeline.cli"]


def commands() -> list[str]:
    from hybrid_build.pipeline.cli import COMMANDS  # a plain dict: importing cli builds no parser

    return list(COMMANDS)


def one_setting(lines: list[list[str]], repeat: int, env: dict) -> dict:
    base = cli()
    measure(base + ["--help"], env)  # fills the bytecode cache where there is one
    bare_runs, runs = [], {" ".join(a): [] for a in lines}
    for _ in range(repeat):
        for a in lines:
            bare_runs.append(measure([sys.executable, "-c", "pass"], env))
            runs[" ".join(a)].append(measure(base + a, env))
    bare = _median(bare_runs)
    rows = {k: _median(v) for k, v in runs.items()}
    return {"python_c_pass_s": bare, "python_c_pass_best_s": best_of(bare_runs)["seconds"],
            "commands": {k: {"seconds": s, "best_s": best_of(runs[k])["seconds"], "ratio": round(s / bare, 1)}
                         for k, s in rows.items()},
            "worst_ratio": round(max(rows.values()) / bare, 1)}


def _median(runs: list[dict]) -> float:
    return round(statistics.median(r["seconds"] for r in runs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lines = [["--version"], ["--help"]] + [[name, "--help"] for name in commands()]
    with tempfile.TemporaryDirectory(prefix="hb-bench-pyc-") as cache:
        settings = {
            "cached": {"PYTHONPYCACHEPREFIX": cache, "PYTHONDONTWRITEBYTECODE": ""},
            "uncompiled": {"PYTHONPYCACHEPREFIX": "", "PYTHONDONTWRITEBYTECODE": "1"},
        }
        result = {"repeat": args.repeat,
                  **{name: one_setting(lines, args.repeat, env) for name, env in settings.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in settings:
        r = result[name]
        print(f"{name}: python -c pass {r['python_c_pass_s'] * 1000:.0f} ms (median of {args.repeat * len(lines)})")
        width = max(map(len, r["commands"]))
        for k, row in r["commands"].items():
            print(f"  hybrid-build {k:<{width}}  {row['seconds'] * 1000:6.0f} ms  {row['ratio']:5.1f}x")
        print(f"  worst: {r['worst_ratio']}x a bare Python start (medians)")


if __name__ == "__main__":
    main()
