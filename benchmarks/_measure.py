"""Shared by the benchmark scripts: run a command in a child process and report its wall time
and peak resident memory (from the kernel's rusage of that child alone)."""
from __future__ import annotations

import os
import subprocess
import time


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
