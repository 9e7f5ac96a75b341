"""`hybrid-build serve` stops what it started on SIGINT, SIGTERM and SIGHUP alike, also when it was
started with SIGINT ignored (what a shell does to a job it starts in the background, where Python
would never raise KeyboardInterrupt). vLLM is a stand-in on PATH that serves the OpenAI stand-in."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from test_multinode import CliRun, _processes_mentioning, free_port

STANDIN = Path(__file__).resolve().parent / "standin_server.py"

FAKE_VLLM = '''#!{python}
import os, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("0.0.0-standin")
    sys.exit(0)
opt = lambda name: args[args.index(name) + 1]
os.execv(sys.executable, [sys.executable, {standin!r}, "--port", opt("--port"), "--model", opt("--served-model-name")])
'''


def _ignore_sigint() -> None:
    """What a shell does to a job it starts in the background of a script."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def local_env(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text(FAKE_VLLM.format(python=sys.executable, standin=str(STANDIN)))
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # check_prerequisites looks for a GPU
    for f in bindir.iterdir():
        f.chmod(0o755)
    port = free_port()
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    marks = [f"--port {port}"]
    yield {"env": env, "port": port, "marks": marks, "cwd": tmp_path}
    left = _processes_mentioning(marks)
    for line in left:
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"the server outlived the command: {left}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_serve_stops_its_server_on_every_stop_signal_with_sigint_ignored(tiny_artifact, local_env, sig):
    c = local_env
    argv = ["serve", str(tiny_artifact), "--profile", "dense", "--port", str(c["port"]), "--ready-timeout", "120",
            "--log", str(c["cwd"] / "serve.log")]
    run = CliRun(argv, c["env"], c["cwd"], preexec_fn=_ignore_sigint)
    try:
        run.wait_for("READY", 120)
        assert _processes_mentioning(c["marks"]), "the stand-in server runs"
        run.proc.send_signal(sig)
        assert run.proc.wait(timeout=60) == 128 + sig
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    # the fixture asserts that the server is gone
