"""Helpers the serve tests share: a free port, a `hybrid-build serve` child read line by line (with
the watch's small bounds, its event lines, the stand-in's run-time knobs), the processes that
mention a mark."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import httpx
import pytest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _processes_mentioning(marks: list[str]) -> list[str]:
    """Live processes (not zombies) whose command line holds one of ``marks``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(m in cmd for m in marks):
            found.append(f"{d.name}: {cmd[:160]}")
    return found


class CliRun:
    """``hybrid-build serve`` in a child process, its stdout read line by line on a thread."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, **popen_kw) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from hybrid_build.pipeline.cli import main; sys.exit(main())", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, **popen_kw)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def output(self, timeout: float = 30) -> str:
        """Everything the child printed, stdout then stderr, once it has exited: the lines already
        seen, the rest of what the reader thread took from stdout, then stderr."""
        said = list(self.seen)
        while (line := self.lines.get(timeout=timeout)) is not None:
            said.append(line)
        return "\n".join(said + [self.proc.stderr.read()])

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The first line starting with ``prefix``; fails on exit or after ``timeout`` seconds."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line within {timeout:.0f} s; output so far: {self.seen}")
            if line is None:
                self.proc.wait()
                pytest.fail(f"hybrid-build exited {self.proc.returncode} before {prefix!r}: {self.seen}\n"
                            f"{self.proc.stderr.read()}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line


LOOK = 0.05  # --watch-interval
STALL = 1.0  # --stall-timeout
GRACE = 1.0  # --stop-grace
SLACK = 3.0  # a loaded 2-core machine: a process start, a scheduler tick, the line's trip through a pipe


def _serve(art: Path, c: dict, *extra: str, flags: str = "--control", env: dict | None = None) -> CliRun:
    argv = ["serve", str(art), "--profile", "dense", "--port", str(c["port"]), "--ready-timeout", "120",
            "--log", str(c["cwd"] / "serve.log"), "--watch-interval", str(LOOK), "--stall-timeout", str(STALL),
            "--stop-grace", str(GRACE), *extra]
    return CliRun(argv, dict(c["env"], HB_STANDIN_FLAGS=flags, **(env or {})), c["cwd"])


def _knobs(c: dict, **kw) -> None:
    try:
        httpx.post(f"http://127.0.0.1:{c['port']}/standin/config", json=kw, timeout=10)
    except httpx.HTTPError:
        if "die" not in kw:  # a dying stand-in may close before its answer
            raise


def _event(run: CliRun, kind: str, timeout: float = 60) -> tuple[str, float]:
    """serve's next line of this kind, and the time it carries."""
    while True:
        line = run.wait_for("20", timeout)
        if f" {kind}: " in line:
            return line, datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _end(run: CliRun) -> int:
    """serve's exit status (it must end on its own within a minute)."""
    return run.proc.wait(timeout=60)


def _cleanup(run: CliRun) -> None:
    """After a failed assertion: serve stopped as a user would, so that it stops the stand-in."""
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
        try:
            run.proc.wait(timeout=30)
        except Exception:
            run.proc.kill()
            run.proc.wait()
