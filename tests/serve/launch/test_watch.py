"""`hybrid-build serve` keeps watching after READY. vLLM is the stand-in on PATH (a real child
process serving /v1/models, /health, /metrics and completions), told at run time to fail
(``POST /standin/config``): exit 0 mid-request with vLLM's EngineDeadError line, die by a signal,
hold its requests (counters frozen, /health 200), ignore SIGTERM; the host's memory is a meminfo
file the test writes. Each fault ends serve with exit 1 and one line with its time, within its
bound: an exit at once (serve waits on the process), a stall after --stall-timeout plus one look,
low memory at the next look. A request in flight gets an error, never a hang. The order comes
from events (serve's lines, the stand-in's answers), never sleeps; the bounds are small so the
tests are fast."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from meminfo_file import write_meminfo
from serve_cli import GRACE, LOOK, SLACK, STALL, CliRun, _cleanup, _end, _event, _knobs, _serve

UNIFIED_SMI = "#!/bin/sh\necho 'NVIDIA GB10, [N/A], [N/A]'\n"  # what nvidia-smi says on a DGX Spark


def _unified(c: dict) -> None:
    smi = c["bin"] / "nvidia-smi"
    smi.write_text(UNIFIED_SMI)
    smi.chmod(0o755)


class InFlight:
    """A streaming chat request on a thread: ``started`` once its first token arrived; ``outcome``
    what ended it (the exception's type name, or "done")."""

    def __init__(self, port: int, model: str) -> None:
        self.port, self.model, self.started, self.ended = port, model, threading.Event(), queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.started.wait(30), "the request got no first token"

    def _run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 50}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(120)) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.started.set()
            self.ended.put("done")
        except httpx.HTTPError as e:
            self.ended.put(type(e).__name__)

    def outcome(self) -> str:
        return self.ended.get(timeout=30)  # an error at once when the engine goes, never the 120 s timeout


def _model(run: CliRun) -> str:
    return next(line.split("model: ")[1].strip() for line in run.seen if line.startswith("READY"))


def test_an_engine_that_exits_0_mid_request_ends_serve_with_1_naming_engine_dead(tiny_artifact, serve_env):
    c = serve_env
    run = _serve(tiny_artifact, c)
    try:
        run.wait_for("READY", 120)
        _knobs(c, hold=True)
        req = InFlight(c["port"], _model(run))
        t0 = time.time()
        _knobs(c, die="exit0")
        line, at = _event(run, "exit")
        assert "exited with status 0" in line and "EngineDeadError" in line, line
        assert at - t0 <= LOOK + SLACK, f"detected {at - t0:.2f} s after the exit"
        print(f"\nexit 0: seen {at - t0:.3f} s after the fault was asked for (bound {LOOK + SLACK:g} s): {line}")
        assert req.outcome() in ("RemoteProtocolError", "ReadError"), "the request in flight got an error"
        assert _end(run) == 1
    finally:
        _cleanup(run)
    assert "hybrid-build serve: " in (c["cwd"] / "serve.log").read_text(), "the event is in the serve log"


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_an_engine_killed_by_a_signal_is_named(tiny_artifact, serve_env, sig):
    c = serve_env
    run = _serve(tiny_artifact, c)
    try:
        run.wait_for("READY", 120)
        t0 = time.time()
        _knobs(c, die=sig)
        line, at = _event(run, "exit")
        assert f"killed by {sig}" in line, line
        assert at - t0 <= LOOK + SLACK
        print(f"\n{sig}: seen {at - t0:.3f} s after the fault was asked for (bound {LOOK + SLACK:g} s): {line}")
        assert _end(run) == 1
    finally:
        _cleanup(run)


def test_a_held_engine_with_health_200_is_a_stall_stopped_by_sigkill(tiny_artifact, serve_env):
    """Requests run, the token counters do not move, /health says 200, SIGTERM is ignored: serve
    says stall after --stall-timeout, SIGKILLs the engine after --stop-grace, exits 1."""
    c = serve_env
    run = _serve(tiny_artifact, c)
    try:
        run.wait_for("READY", 120)
        _knobs(c, hold=True, ignore_term=True)
        req = InFlight(c["port"], _model(run))
        t0 = time.time()  # the last token came before this
        assert httpx.get(f"http://127.0.0.1:{c['port']}/health", timeout=10).status_code == 200
        line, at = _event(run, "stall")
        assert "1 requests running and no token generated" in line, line
        assert f"SIGKILL after {GRACE:g} s" in line, line
        assert STALL <= at - t0 + 0.5 and at - t0 <= STALL + GRACE + LOOK + SLACK, f"stall seen after {at - t0:.2f} s"
        print(f"\nstall: line {at - t0:.3f} s after the last token (stall-timeout {STALL:g} s + grace {GRACE:g} s; "
              f"bound {STALL + GRACE + LOOK + SLACK:g} s): {line}")
        assert req.outcome() in ("RemoteProtocolError", "ReadError")
        assert _end(run) == 1
    finally:
        _cleanup(run)


def test_memory_below_the_reserve_stops_the_engine_naming_a_utilization_that_fits(tiny_artifact, serve_env):
    c = serve_env
    _unified(c)
    write_meminfo(c["meminfo"], available_gb=120, total_gb=128)
    run = _serve(tiny_artifact, c)
    try:
        budget = run.wait_for("memory budget:", 120)
        assert budget.endswith("fits"), budget
        run.wait_for("READY", 120)
        t0 = time.time()
        write_meminfo(c["meminfo"], available_gb=10, total_gb=128)
        line, at = _event(run, "memory")
        # the engine's 0.3 of 128 GB less the 4 GB missing: 0.26 of it would have left 14 GB free
        assert "MemAvailable 10.00 GB < reserve 14.00 GB" in line, line
        assert "gpu_memory_utilization 0.26 would fit (the profile's is 0.30" in line, line
        assert "stopped by SIGTERM" in line, line
        assert at - t0 <= 2 * LOOK + SLACK
        print(f"\nmemory: seen {at - t0:.3f} s after the file changed (bound {2 * LOOK + SLACK:g} s): {line}")
        assert _end(run) == 1
    finally:
        _cleanup(run)


def test_a_start_the_memory_cannot_hold_is_refused_in_one_line_exit_3(tiny_artifact, serve_env):
    c = serve_env
    _unified(c)
    write_meminfo(c["meminfo"], available_gb=40, total_gb=128)
    launches = c["cwd"] / "launches"
    run = _serve(tiny_artifact, c, env={"HB_STANDIN_LAUNCHES": str(launches)})
    assert _end(run) == 3
    err = [ln for ln in run.proc.stderr.read().strip().splitlines() if ln.startswith("error:")]
    # 40 GB less the 14 GB reserve is 0.20 of 128 GB; the profile's 0.3 would take 38.4 GB of it
    assert len(err) == 1 and "does not fit; gpu_memory_utilization 0.20 fits (the profile's is 0.30)" in err[0], err
    assert not launches.exists(), "nothing was started"
    print(f"\nrefused (exit 3): {err[0]}")


def test_restart_waits_for_memory_starts_again_reverifies_and_is_in_status(tiny_artifact, serve_env):
    """--restart 1: the engine is killed; serve backs off, waits for MemAvailable to be back above
    the start budget (the test gives it back once serve says it waits), starts the engine again,
    READY again; the record `status` reads has the restart and its cause; the second fault, with no
    restart left, ends serve with 1."""
    from hybrid_build.core.artifact import SERVE_RECORD

    c = serve_env
    _unified(c)
    write_meminfo(c["meminfo"], available_gb=120, total_gb=128)
    launches = c["cwd"] / "launches"
    run = _serve(tiny_artifact, c, "--restart", "1", "--restart-backoff", "0", "--memory-wait", "60",
                 env={"HB_STANDIN_LAUNCHES": str(launches)})
    try:
        run.wait_for("READY", 120)
        write_meminfo(c["meminfo"], available_gb=20, total_gb=128)  # above the reserve, below the start budget
        _knobs(c, die="SIGKILL")
        fault, t_fault = _event(run, "exit")
        waiting, _ = _event(run, "restart")
        assert "waiting for MemAvailable >= 52.40 GB" in waiting, waiting  # 0.3 x 128 GB + the 14 GB reserve
        write_meminfo(c["meminfo"], available_gb=120, total_gb=128)
        back, t_back = _event(run, "restart")
        assert back.split(" restart: ")[1].startswith("memory back: MemAvailable 120.00 GB"), back
        started, _ = _event(run, "restart")
        assert "engine started again" in started
        up, _ = _event(run, "restart")
        assert "engine up after" in up
        verified, _ = _event(run, "restart")
        assert "verify could not run" in verified  # the tiny artifact holds no reference (the slow test has one)
        ready, t_ready = _event(run, "ready")
        assert "READY again after restart 1 of 1" in ready
        assert len(launches.read_text().splitlines()) == 2
        record = json.loads((tiny_artifact / SERVE_RECORD.format(profile="dense")).read_text())
        assert record["restarts"] == 1 and record["state"] == "ready"
        assert "killed by SIGKILL" in record["last_fault"]["detail"]
        said = subprocess.run([sys.executable, "-c", "import sys; from hybrid_build.pipeline.cli import main; "
                               "sys.exit(main())", "status", str(tiny_artifact)], capture_output=True, text=True,
                              env=c["env"], timeout=120).stdout
        line = next(ln for ln in said.splitlines() if ln.startswith("serve    dense:"))
        assert line.startswith("serve    dense: ready; 1 restart(s) of 1"), line
        assert "exit: the engine was killed by SIGKILL" in line, line
        print("timeline:", *[ln for ln in (fault, waiting, back, started, up, verified, ready)], sep="\n  ")
        _knobs(c, die="exit0")
        _event(run, "exit")
        gave_up, _ = _event(run, "gave-up")
        assert "1 restarts used (--restart 1)" in gave_up
        assert _end(run) == 1
    finally:
        _cleanup(run)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_during_a_restart_tears_everything_down(tiny_artifact, serve_env, sig):
    c = serve_env
    _unified(c)
    write_meminfo(c["meminfo"], available_gb=120, total_gb=128)
    run = _serve(tiny_artifact, c, "--restart", "3", "--restart-backoff", "0", "--memory-wait", "600")
    try:
        run.wait_for("READY", 120)
        write_meminfo(c["meminfo"], available_gb=20, total_gb=128)
        _knobs(c, die="SIGKILL")
        _event(run, "exit")
        _event(run, "restart")  # waiting for memory
        run.proc.send_signal(sig)
        assert _end(run) == 128 + sig
    finally:
        _cleanup(run)
    # the fixture asserts that no stand-in outlived serve


@pytest.mark.slow
def test_an_engine_that_comes_back_with_other_numerics_is_refused(referenced_artifact, serve_env):
    c = serve_env
    run = _serve(referenced_artifact, c, "--restart", "1", "--restart-backoff", "0", flags="--control",
                 env={"HB_STANDIN_LAUNCHES": str(c["cwd"] / "launches"), "HB_STANDIN_RESTART_FLAGS": "--corrupt"})
    try:
        run.wait_for("READY", 180)
        _knobs(c, die="exit0")
        _event(run, "exit")
        run.wait_for("verify FAILED", 180)
        assert _end(run) == 1
    finally:
        _cleanup(run)
    assert "does not reproduce the artifact's reference" in run.output()
