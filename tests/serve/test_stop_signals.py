"""`hybrid-build serve` stops what it started on SIGINT, SIGTERM and SIGHUP alike, also when it was
started with SIGINT ignored (what a shell does to a job it starts in the background, where Python
would never raise KeyboardInterrupt). vLLM is a stand-in on PATH that serves the OpenAI stand-in."""
from __future__ import annotations

import signal

import pytest
from test_multinode import CliRun, _processes_mentioning


def _ignore_sigint() -> None:
    """What a shell does to a job it starts in the background of a script."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_serve_stops_its_server_on_every_stop_signal_with_sigint_ignored(tiny_artifact, serve_env, sig):
    c = serve_env
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
