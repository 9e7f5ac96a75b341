"""`hybrid-build serve` talks only to the engine it started, and its engine ends with it.

vLLM is the stand-in on PATH (a real child process), told at start or at run time to behave as the
attacks of a careless user or another program would: the port already taken, a daemon that starts
answering on the port while the engine loads, an engine that dies leaving a forked child holding
the listening socket, a worker of the engine's group that ignores SIGTERM, a server without
``/metrics``. Each case is ordered by events (serve's lines, the stand-in's log lines, a process's
end seen through a pidfd), never by sleeps."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_cli import GRACE, LOOK, SLACK, STALL, CliRun, _cleanup, _end, _event, _knobs, _serve

from hybrid_build.core.artifact import SERVE_RECORD


def _ends(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` ends within ``timeout`` seconds (its pidfd turns readable at its end)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    _ends(pid, 10)


def _log_pid(log: Path, what: str, run: CliRun | None = None) -> int:
    """The pid the stand-in wrote into the serve log as ``stand-in: WHAT pid N``."""
    m = re.search(rf"stand-in: {what} pid (\d+)", log.read_text(errors="replace"))
    assert m, f"no {what} pid in the log: {log.read_text(errors='replace')[-2000:]}"
    return int(m[1])


def _error(run: CliRun) -> list[str]:
    return [ln for ln in run.output().splitlines() if ln.startswith("error:")]


def test_a_taken_port_is_refused_before_the_engine_starts_naming_its_holder(tiny_artifact, serve_env):
    c = serve_env
    launches = c["cwd"] / "launches"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", c["port"]))
        squatter.listen()
        run = _serve(tiny_artifact, c, env={"HB_STANDIN_LAUNCHES": str(launches)})
        assert _end(run) == 3
        err = _error(run)
    assert len(err) == 1, err
    assert f"port {c['port']} is taken by pid {os.getpid()} (" in err[0] and "the engine was not started" in err[0]
    assert not launches.exists(), "no engine was started"
    assert not [ln for ln in run.seen if ln.startswith("READY")]
    print(f"\ntaken port (exit 3): {err[0]}")


def test_a_server_that_appears_on_the_port_while_the_engine_loads_is_never_announced(tiny_artifact, serve_env):
    """The engine forks a daemon (its own session, its parent gone: outside the engine's tree) that
    answers on the port, and never serves itself: /v1/models answers 200, but the listening socket is
    not the engine's, so serve stops the engine and exits 3 before verify, smoke test and READY."""
    c = serve_env
    log = c["cwd"] / "serve.log"
    run = _serve(tiny_artifact, c, flags="--squat")
    squatter = None
    try:
        assert _end(run) == 3
        squatter = _log_pid(log, "squatter")
        err = _error(run)
        assert len(err) == 1 and f"port {c['port']} answers, but pid {squatter} (" in err[0], err
        assert "not the engine serve started" in err[0] and "nothing was verified or announced" in err[0], err
        assert not [ln for ln in run.seen if ln.startswith(("READY", "smoke test", "verify"))], run.seen
        assert _alive(squatter), "the other server is not serve's to stop"
        print(f"\nforeign server (exit 3): {err[0]}")
    finally:
        _cleanup(run)
        _kill(squatter)


def test_a_port_still_held_after_the_engine_died_is_named_and_not_restarted_against(tiny_artifact, serve_env):
    """The engine dies leaving a forked child in a session of its own that keeps the listening socket
    and answers: serve names it and gives up (exit 1) with restarts left, instead of verifying it."""
    c = serve_env
    launches = c["cwd"] / "launches"
    run = _serve(tiny_artifact, c, "--restart", "2", "--restart-backoff", "0",
                 env={"HB_STANDIN_LAUNCHES": str(launches)})
    heir = None
    try:
        run.wait_for("READY", 120)
        _knobs(c, die="heir")
        line, _ = _event(run, "exit")
        assert "EngineDeadError" in line, line
        gave_up, _ = _event(run, "gave-up")
        heir = _log_pid(c["cwd"] / "serve.log", "heir")
        assert f"port {c['port']} is still held by pid {heir} (" in gave_up and "no restart against it" in gave_up
        assert _end(run) == 1
        assert len(launches.read_text().splitlines()) == 1, "no engine was started against the held port"
        assert not [ln for ln in run.seen if " restart: " in ln], run.seen
        print(f"\nheld after death (exit 1): {gave_up}")
    finally:
        _cleanup(run)
        _kill(heir)


def _engine_pid(art: Path) -> int:
    return json.loads((art / SERVE_RECORD.format(profile="dense")).read_text())["engine_pid"]


def test_kill_9_of_serve_ends_the_engine_and_its_whole_group(tiny_artifact, serve_env):
    """A worker of the engine's group ignores SIGTERM (an engine core stuck in a CUDA call): after
    `kill -9` of serve, the engine (SIGTERM from the kernel and the keeper) and the worker (SIGKILL
    from the keeper after the grace) end, and the port is free."""
    c = serve_env
    run = _serve(tiny_artifact, c, flags="--control --worker")
    worker = engine = None
    try:
        run.wait_for("READY", 120)
        engine, worker = _engine_pid(tiny_artifact), _log_pid(c["cwd"] / "serve.log", "worker")
        assert _alive(engine) and _alive(worker)
        assert os.getpgid(worker) == engine, "the worker is in the engine's group"
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGKILL)
        assert run.proc.wait(30) == -signal.SIGKILL
        assert _ends(engine, SLACK), "the engine outlived serve"
        t_engine = time.monotonic() - t0
        assert _ends(worker, GRACE + SLACK), "a worker of the engine's group outlived serve"
        print(f"\nkill -9 of serve: engine (pid {engine}) ended after {t_engine:.2f} s, its SIGTERM-proof worker "
              f"(pid {worker}) after {time.monotonic() - t0:.2f} s (grace {GRACE:g} s)")
        from hybrid_build.serve.launch.listener import taken_by

        assert taken_by("127.0.0.1", c["port"]) is None, "the port is free again"
    finally:
        _cleanup(run)
        _kill(worker)
        _kill(engine)


def _keeper_of(engine: int) -> int:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(part.endswith(b"keeper.py") for part in cmd) and str(engine).encode() in cmd:
                return int(d.name)
    pytest.fail(f"no keeper for engine {engine}")


def test_status_names_an_engine_that_outlived_its_serve(tiny_artifact, serve_env):
    """The one case left: serve and its keeper both killed, and an engine that ignores SIGTERM (the
    parent-death signal): `status` says that serve is gone and its engine still runs, with its pid."""
    c = serve_env
    run = _serve(tiny_artifact, c)
    engine = None
    try:
        run.wait_for("READY", 120)
        engine = _engine_pid(tiny_artifact)
        _knobs(c, ignore_term=True)
        keeper = _keeper_of(engine)
        os.kill(keeper, signal.SIGKILL)
        assert _ends(keeper, 30)
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(30)
        assert _alive(engine)
        said = subprocess.run([sys.executable, "-c", "import sys; from hybrid_build.pipeline.cli import main; "
                               "sys.exit(main())", "status", str(tiny_artifact)], capture_output=True, text=True,
                              env=c["env"], timeout=120).stdout
        line = next(ln for ln in said.splitlines() if ln.startswith("serve    dense:"))
        assert f"serve is gone and its engine (pid {engine}) still runs" in line, line
        print(f"\nstatus: {line}")
    finally:
        _cleanup(run)
        if engine is not None:
            try:
                os.killpg(engine, signal.SIGKILL)
            except OSError:
                pass
            _ends(engine, 10)


def test_no_metrics_at_ready_is_said_once_and_a_stall_is_still_seen(tiny_artifact, serve_env):
    """/metrics answers 404 and /health 200: one warning at READY names the generation probe the
    stall watch then uses; a held engine (no answer to anything) is a stall after --stall-timeout.
    The log is in the user's state folder (printed at start), none in the current folder."""
    c = serve_env
    argv = ["serve", str(tiny_artifact), "--profile", "dense", "--port", str(c["port"]), "--ready-timeout", "120",
            "--watch-interval", str(LOOK), "--stall-timeout", str(STALL), "--stop-grace", str(GRACE)]
    run = CliRun(argv, dict(c["env"], HB_STANDIN_FLAGS="--control --no-metrics"), c["cwd"])
    try:
        log_line = run.wait_for("log: ", 120)
        run.wait_for("READY", 120)
        _knobs(c, hold=True)
        line, _ = _event(run, "stall")
        assert "no answer to a 1-token generation for" in line and "/metrics is not served" in line, line
        assert _end(run) == 1
    finally:
        _cleanup(run)
    warnings = [ln for ln in run.output().splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "serves no Prometheus metrics" in warnings[0], warnings
    assert "sends a 1-token generation every" in warnings[0]
    log = Path(os.environ["XDG_STATE_HOME"]) / "hybrid-build" / "logs" / "serve-dense-{}.log".format(c["port"])
    assert log_line == f"log: {log}", log_line
    assert "stand-in: loading weights" in log.read_text()
    assert not list(c["cwd"].glob("*.log")), "nothing is written into the current folder"
    print(f"\n{warnings[0]}\n{line}")


def test_the_cause_of_a_death_is_the_engines_own_line_never_serves(tiny_artifact, serve_env):
    """The first engine dies with vLLM's EngineDeadError line (serve's own event line repeats it in
    the shared log); the second is killed by SIGKILL and writes nothing: its cause names no error
    line, not serve's earlier one."""
    c = serve_env
    run = _serve(tiny_artifact, c, "--restart", "1", "--restart-backoff", "0")
    try:
        run.wait_for("READY", 120)
        _knobs(c, die="exit0")
        first, _ = _event(run, "exit")
        assert "EngineDeadError" in first
        _event(run, "ready", 120)
        _knobs(c, die="SIGKILL")
        second, _ = _event(run, "exit")
        assert "killed by SIGKILL" in second and "(no error line in its log)" in second, second
        assert "EngineDeadError" not in second, second
        assert _end(run) == 1
        print(f"\nfirst: {first}\nsecond: {second}")
    finally:
        _cleanup(run)


def test_restart_spends_its_budget_on_engines_that_die_before_ready(tiny_artifact, serve_env):
    """--restart 2: the first engine is READY and dies; each restarted one dies before READY (out of
    memory while loading). Both restarts are spent, each line says how many are left, each cause is
    that engine's own line; serve exits 1 after three starts."""
    c = serve_env
    launches = c["cwd"] / "launches"
    run = _serve(tiny_artifact, c, "--restart", "2", "--restart-backoff", "0",
                 env={"HB_STANDIN_LAUNCHES": str(launches),
                      "HB_STANDIN_RESTART_FLAGS": "--ready-after 600 --exit-after 0"})
    try:
        run.wait_for("READY", 120)
        _knobs(c, die="exit0")
        _event(run, "exit")
        lines = []
        for left in (1, 0):
            planned, _ = _event(run, "restart")
            assert f"({left} left after it)" in planned, planned
            died, _ = _event(run, "exit")
            assert "exited with status 3 before READY: stand-in: CUDA out of memory (simulated)" in died, died
            lines += [planned, died]
        gave_up, _ = _event(run, "gave-up")
        assert "2 restarts used (--restart 2), 0 left" in gave_up
        assert _end(run) == 1
        assert len(launches.read_text().splitlines()) == 3
        print("\n" + "\n".join(lines + [gave_up]))
    finally:
        _cleanup(run)
