"""Shared by the benchmark scripts: run a command in a child process and report its wall time
and peak resident memory (from the kernel's rusage of that child alone)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

MAKE = r"""
import sys
from hybrid_build.pipeline.generators.synthetic import qwen35_122b_config, write_synthetic_checkpoint
cfg = qwen35_122b_config(compact_extra_config=True)
cfg["text_config"]["mtp_num_hidden_layers"] = 0
write_synthetic_checkpoint(sys.argv[1], cfg, layers=range(int(sys.argv[2])), sparse=False)
"""


def measure(cmd: list[str], env: dict | None = None) -> dict:
    subprocess.run(["sync"], check=False)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()[-2000:]}")
    return {"seconds": round(wall, 3), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def best_of(runs: list[dict]) -> dict:
    """The fastest run: the least disturbed by other work on a noisy machine."""
    return min(runs, key=lambda r: r["seconds"])


def folder_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_synthetic(dest, layers: int) -> None:
    """Random-data checkpoint at the real 122B widths with ``layers`` decoder layers, written by
    a child process: a child forked from a big parent would report the parent's pages as its own
    peak RSS, so this process stays small."""
    measure([sys.executable, "-c", MAKE, str(dest), str(layers)])
