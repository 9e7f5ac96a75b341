"""`hybrid-build serve` stops what it started on SIGINT, SIGTERM and SIGHUP alike, also when it was
started with SIGINT ignored (what a shell does to a job it starts in the background, where Python
would never raise KeyboardInterrupt). vLLM is a stand-in on PATH that serves the OpenAI stand-in."""
from __future__ import annotations

import signal

import pytest
from serve_cli import CliRun, _processes_mentioning


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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_while_vllm_starts_still_stops_it(tiny_artifact, serve_env, monkeypatch, sig):
    """The signal comes after vLLM's process exists and before serve holds it (here: inside
    ``start``, right after the real one returns; a `docker stop` or a daemon manager can land
    there). serve exits 128 + the signal and the server it started is stopped: without the hold
    around ``start`` the server outlived the command (the fixture's check)."""
    import os

    from hybrid_build.pipeline.cli import main
    from hybrid_build.serve.launch import launcher

    c = serve_env
    started = []
    real_start = launcher.start

    def start_then_signal(plan, log_path, **kw):
        server = real_start(plan, log_path, **kw)
        started.append(server)
        os.kill(os.getpid(), sig)  # delivered to Python's handler at the next bytecode
        return server

    monkeypatch.setattr(launcher, "start", start_then_signal)
    for k, v in c["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(c["cwd"])
    rc = main(["serve", str(tiny_artifact), "--profile", "dense", "--port", str(c["port"]), "--ready-timeout", "120",
               "--log", str(c["cwd"] / "serve.log"), "--quiet"])
    assert rc == 128 + sig
    assert started and started[0].process.poll() is not None, "the server serve started is stopped"
