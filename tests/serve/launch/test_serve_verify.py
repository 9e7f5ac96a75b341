"""`hybrid-build serve` checks the server against the artifact's reference before it says READY:
a correct server passes (the prompt log-probabilities, then the cache, concurrency and decode
paths) and is served, a corrupt one or one broken on a path is stopped (exit 1), ``--no-verify``
skips the check, an artifact without a reference is served with one line saying why it was not
checked. vLLM
is a stand-in on PATH serving the OpenAI stand-in, which answers prompt log-probabilities from the
reference of the artifact it is asked to serve (flags from ``HB_STANDIN_FLAGS``)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
from serve_cli import CliRun


def _serve(art: Path, c: dict, flags: str = "", *extra: str) -> CliRun:
    argv = ["serve", str(art), "--profile", "dense", "--port", str(c["port"]), "--ready-timeout", "120",
            "--log", str(c["cwd"] / "serve.log"), *extra]
    return CliRun(argv, dict(c["env"], HB_STANDIN_FLAGS=flags), c["cwd"])


def _stop(run: CliRun) -> int:
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
    try:
        return run.proc.wait(timeout=60)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


@pytest.mark.slow
def test_a_correct_server_is_verified_before_ready(referenced_artifact, serve_env):
    run = _serve(referenced_artifact, serve_env, "--logprob-noise 0.01")
    try:
        verdict = run.wait_for("verify ", 120)
        assert verdict.startswith("verify passed: KL mean") and "lower bound" in verdict
        assert any(line.startswith("all ") for line in run.seen), run.seen  # the per-text table came first
        paths = [line.split()[1:3] for line in run.seen if line.startswith("path ")]
        assert paths == [["cache", "passed:"], ["concurrency", "passed:"], ["decode", "passed:"]], run.seen
        assert "paths checked: cache (hit " in verdict  # the stand-in caches, though the tiny dense profile claims not
        run.wait_for("READY", 60)
    finally:
        assert _stop(run) == 130


@pytest.mark.slow
def test_a_corrupt_server_is_stopped_and_serve_exits_1(referenced_artifact, serve_env):
    run = _serve(referenced_artifact, serve_env, "--corrupt")
    try:
        verdict = run.wait_for("verify ", 120)
        assert verdict.startswith("verify FAILED: ") and "same top-1 0.0" in verdict
        assert run.proc.wait(timeout=60) == 1
        err = [ln for ln in run.proc.stderr.read().splitlines() if not ln.startswith("WARNING ")]  # untested vLLM
        assert len(err) == 1 and err[0].startswith("error: the server does not reproduce the artifact's reference")
        assert not any(line.startswith("READY") for line in run.seen)
    finally:
        _stop(run)
    # the fixture asserts that the stand-in server is gone


@pytest.mark.slow
def test_a_server_broken_on_the_decode_path_is_stopped(referenced_artifact, serve_env):
    run = _serve(referenced_artifact, serve_env, "--decode-fault")
    try:
        verdict = run.wait_for("verify ", 120)
        assert verdict.startswith("verify FAILED: decode: decode token 1: top-1")
        assert run.proc.wait(timeout=60) == 1
        assert not any(line.startswith("READY") for line in run.seen)
    finally:
        _stop(run)


@pytest.mark.slow
def test_no_verify_serves_even_a_corrupt_server(referenced_artifact, serve_env):
    run = _serve(referenced_artifact, serve_env, "--corrupt", "--no-verify")
    try:
        run.wait_for("READY", 120)
        assert not any(line.startswith("verify") for line in run.seen)
    finally:
        assert _stop(run) == 130


@pytest.mark.slow
def test_an_artifact_without_a_reference_is_served_with_one_line_saying_why(tiny_artifact, serve_env):
    run = _serve(tiny_artifact, serve_env)  # validated without the end-to-end forward: no reference
    try:
        line = run.wait_for("could not verify", 120)
        assert "no current reference" in line and "hybrid-build validate" in line
        assert line.endswith("serving without the check")
        run.wait_for("READY", 60)
    finally:
        assert _stop(run) == 130
