"""What ``serve`` watches once the server is READY, and how it stops an engine that went wrong.

Three faults end the watch, each reported in one line with its time:

- **exit**: the engine's process ended, whatever its status. vLLM's API server exits 0 after an
  ``EngineDeadError`` (vLLM 48966), so a clean exit is a failure too; the cause is the last error
  line this engine wrote to its log since it started (``EngineDeadError``, a CUDA error, out of
  memory; serve's own event lines, which share the file, never count) or the signal that killed it
  (SIGKILL is what the kernel's OOM killer sends).
- **stall**: requests are running (``vllm:num_requests_running`` on ``/metrics``) and neither the
  generated nor the prompt tokens counter has moved for ``stall_timeout_s``. ``/health`` checks
  process flags, not progress: a deadlocked engine keeps answering it (vLLM 39863, 37729). A
  ``/metrics`` that stops answering counts as no progress too. Where ``/metrics`` did not answer at
  READY (``blind_warning``: one line says so), a 1-token generation probe stands in for the
  counters (``Prober``): none answered for ``stall_timeout_s`` is a stall.
- **memory**: the host's ``MemAvailable`` (``/proc/meminfo``: on unified memory, a GB10, the figure
  the GPU draws from too) fell below the reserve. A GB10 out of memory freezes instead of raising an
  error (vLLM 46307), so the engine is stopped before that, naming the ``gpu_memory_utilization``
  that would have left the reserve free.

The engine is stopped with SIGTERM to its process group, then SIGKILL after ``stop_grace_s``.
``HYBRID_BUILD_MEMINFO`` names another meminfo file (tests, or a container that mounts the host's).
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hybrid_build.core.byte_units import human_bytes

MEMINFO_ENV = "HYBRID_BUILD_MEMINFO"
# the public DGX Spark recipe keeps ~14 GB for the OS and its start-up monitor stops the container
# below it; a GB10 with less free stalls or freezes (vLLM 46307, dgx-spark-playbooks 97)
MEMORY_RESERVE_GB = 14.0
# no token for this long while requests run is a hang: the longest prefill the shipped profiles
# admit (262,144 tokens) at a pessimistic 500 prefill tokens/s on a GB10 moves no counter for ~9 min
STALL_TIMEOUT_S = 600.0
# vLLM's own shutdown (engine core, workers, NCCL) ends within seconds; one stuck in a CUDA call
# never ends on SIGTERM
STOP_GRACE_S = 30.0
POLL_S = 5.0

# lines of vLLM's log that say why the engine died, most telling first when several are there
_CAUSE = re.compile(r"EngineDeadError|CUDA error|out of memory|OutOfMemory|\bKilled\b|Error\b|error:|FATAL",
                    re.IGNORECASE)


@dataclass(frozen=True)
class WatchLimits:
    poll_s: float = POLL_S
    stall_timeout_s: float = STALL_TIMEOUT_S
    memory_reserve: int = int(MEMORY_RESERVE_GB * 1e9)  # bytes
    stop_grace_s: float = STOP_GRACE_S
    gpu_memory_utilization: float | None = None  # the profile's, to name one that fits


@dataclass
class WatchEvent:
    kind: str  # exit | stall | memory | node
    at: float  # time.time() when serve saw it
    detail: str  # the cause, in words
    onset: float | None = None  # time.time() of the last progress seen (stall) or None

    def line(self) -> str:
        return f"{stamp(self.at)} {self.kind}: {self.detail}"

    def to_json(self) -> dict:
        return asdict(self)


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


# ----------------------------------------------------------------------------- host memory

def meminfo_path() -> Path:
    return Path(os.environ.get(MEMINFO_ENV) or "/proc/meminfo")


def read_meminfo(path: Path | None = None) -> dict[str, int]:
    """``/proc/meminfo``'s fields in bytes (its kB are KiB)."""
    out = {}
    for line in (path or meminfo_path()).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def fitting_utilization(utilization: float, total: int, available: int, reserve: int) -> float:
    """The ``gpu_memory_utilization`` (two decimals, rounded down) that would have left ``reserve``
    free: the engine's claim (``utilization`` of ``total``, vLLM's budget) less what was missing."""
    missing = reserve - available
    return max(0.0, math.floor((utilization * total - missing) / total * 100) / 100)


def memory_words(available: int, reserve: int, total: int | None, utilization: float | None) -> str:
    words = f"MemAvailable {human_bytes(available)} < reserve {human_bytes(reserve)}"
    if total and utilization:
        words += (f"; gpu_memory_utilization {fitting_utilization(utilization, total, available, reserve):.2f} "
                  f"would fit (the profile's is {utilization:.2f} of {human_bytes(total)})")
    return words


# ----------------------------------------------------------------------------- progress

@dataclass(frozen=True)
class Progress:
    running: float  # vllm:num_requests_running, every engine
    tokens: float  # vllm:generation_tokens_total + vllm:prompt_tokens_total, every engine


def progress_of(metrics) -> Progress:
    """``core.http_client.Metrics`` (prometheus_client's parse of vLLM's ``/metrics``) -> ``Progress``,
    each family summed over engines and models."""
    running = sum(v for _, v in metrics.samples("vllm:num_requests_running"))
    tokens = (metrics.counter("vllm:generation_tokens") or 0.0) + (metrics.counter("vllm:prompt_tokens") or 0.0)
    return Progress(running, tokens)


def scrape(client, metrics_url: str) -> Progress | None:
    """One ``/metrics`` reading; None when it does not answer, or not with Prometheus text."""
    from hybrid_build.core.errors import HybridBuildError

    try:
        got = client.metrics(metrics_url)
    except HybridBuildError:
        return None
    return None if got is None else progress_of(got)


# ----------------------------------------------------------------------------- the engine

def exit_cause(returncode: int, log_path: Path | None, lines: int = 200, start: int = 0, when: str = "") -> str:
    """Why the engine ended (``when``: words after its status, e.g. " before READY"): its status or
    signal, and the last error line it wrote to its log from byte ``start`` on (this start's own
    lines; serve's event lines, which share the file, never)."""
    from .serve_record import engine_lines

    killed = returncode < 0 and -returncode in signal.valid_signals()
    how = f"was killed by {signal.Signals(-returncode).name}" if killed else f"exited with status {returncode}"
    if returncode == -signal.SIGKILL:
        how += " (what the kernel's OOM killer sends)"
    how += when
    last = None
    if log_path is not None:
        text = engine_lines(log_path, start)[-lines:]
        found = [ln.strip() for ln in text if _CAUSE.search(ln)]
        if found:
            dead = [ln for ln in found if "EngineDeadError" in ln or "CUDA error" in ln or "out of memory" in ln]
            last = (dead or found)[-1]
    return how + (f": {last[:300]}" if last else " (no error line in its log)")


def stop_engine(process: subprocess.Popen, grace: float, group: int | None = None) -> str:
    """SIGTERM to the engine's process group (vLLM's API server, its engine core and workers), then
    SIGKILL after ``grace`` seconds. ``group``: the group the engine leads (``launcher.start``), whose
    last members get SIGKILL too once the leader has ended (a worker stuck in a CUDA call outlives
    its API server). Says how it ended."""
    if process.poll() is not None:
        if group is not None:
            _kill_group(group)
        return "already ended"
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(grace)
        how = f"stopped by SIGTERM (status {process.returncode})"
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait()
        how = f"SIGKILL after {grace:g} s without ending on SIGTERM"
    if group is not None:
        _kill_group(group)
    return how


def _kill_group(group: int) -> None:
    """SIGKILL to what is left of a group whose leader has ended (the group id stays taken while a
    member lives, so it names no other process's group)."""
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(process.pid) == process.pid:  # started in a session of its own (launcher.start)
            os.killpg(process.pid, sig)
            return
    except OSError:
        pass
    try:
        process.send_signal(sig)
    except OSError:
        pass


def blind_warning(metrics_url: str, limits: WatchLimits) -> str | None:
    """At READY: None when ``/metrics`` answers vLLM's Prometheus text (the stall watch reads its
    counters); else the warning line naming what the stall watch uses instead (``Prober``)."""
    from hybrid_build.core.http_client import HttpClient

    with HttpClient(timeout=max(limits.poll_s, 5.0), connections=1) as client:
        if scrape(client, metrics_url) is not None:
            return None
    return (f"warning: {metrics_url} serves no Prometheus metrics (404, or not vLLM's text): the stall watch cannot "
            f"read the token counters, so it sends a 1-token generation every {probe_every(limits):g} s instead and "
            f"calls a stall when none has been answered for --stall-timeout {limits.stall_timeout_s:g} s")


def probe_every(limits: WatchLimits) -> float:
    """Seconds between two generation probes of a blind watch: four to a stall timeout, never more
    often than the watch looks."""
    return max(limits.poll_s, limits.stall_timeout_s / 4)


class Prober:
    """The stall watch without ``/metrics``: one small generation at a time on a thread (``probe``:
    raises unless the engine answered), a new one ``every`` seconds after the last ended. ``silent_for``:
    seconds since a probe was last answered (or the watch began), while one runs or failed."""

    def __init__(self, probe: Callable[[], None], every: float, clock: Callable[[], float]):
        import threading

        self.probe, self.every, self.clock = probe, every, clock
        self.lock = threading.Lock()
        self.answered = self.ended = clock()
        self.running = False

    def tick(self) -> None:
        import threading

        with self.lock:
            if self.running or self.clock() - self.ended < self.every:
                return
            self.running = True
        threading.Thread(target=self._run, daemon=True, name="stall-probe").start()

    def _run(self) -> None:
        ok = False
        try:
            self.probe()
            ok = True
        except Exception:  # noqa: BLE001  (any failure is no answer: the stall clock runs on)
            pass
        with self.lock:
            self.running = False
            self.ended = self.clock()
            if ok:
                self.answered = self.ended

    def silent_for(self) -> float:
        with self.lock:
            return self.clock() - self.answered


def watch(process: subprocess.Popen | None, metrics_url: str, limits: WatchLimits, log_path: Path | None = None,
          meminfo: Path | None = None, clock: Callable[[], float] = time.monotonic,
          others: Callable[[], tuple[str, int, Path] | None] | None = None, log_from: int = 0,
          probe: Callable[[], None] | None = None) -> WatchEvent:
    """Watch a READY engine until one of the faults (module docstring); returns it. The engine is
    still running when a stall or memory event returns (the caller stops it: ``stop_engine``). A stop
    signal raises ``Interrupted`` out of the wait, as anywhere in the main thread. ``others``: the
    processes of several nodes (None while all run, else what ended: its words naming the node, its
    status, its log), watched as the engine is; ``process`` None then. ``log_from``: where this
    engine's lines begin in its log. ``probe``: where ``/metrics`` did not answer at READY
    (``blind_warning``), the small generation the stall watch sends instead (``Prober``)."""
    from hybrid_build.core.http_client import HttpClient

    client = HttpClient(timeout=max(limits.poll_s, 2.0), connections=1)
    prober = Prober(probe, probe_every(limits), clock) if probe is not None else None
    try:
        return _watch(process, metrics_url, limits, log_path, meminfo, clock, client, others, log_from, prober)
    finally:
        client.close()


def _watch(process, metrics_url, limits, log_path, meminfo, clock, client, others, log_from, prober) -> WatchEvent:
    last_tokens: float | None = None
    moved = clock()  # when the counters last moved, or no request was running
    moved_wall = time.time()
    answered = False
    while True:
        code = None
        if process is None:
            time.sleep(limits.poll_s)
        else:
            try:
                code = process.wait(limits.poll_s)
            except subprocess.TimeoutExpired:
                pass
        if code is not None:
            return WatchEvent("exit", time.time(), "the engine " + exit_cause(code, log_path, start=log_from))
        ended = others() if others is not None else None
        if ended is not None:
            what, code, log = ended
            return WatchEvent("exit", time.time(), f"{what} " + exit_cause(code, log) + "; stopping every node")
        try:
            mem = read_meminfo(meminfo)
        except OSError:
            mem = {}
        available = mem.get("MemAvailable")
        if available is not None and limits.memory_reserve and available < limits.memory_reserve:
            return WatchEvent("memory", time.time(), memory_words(available, limits.memory_reserve,
                                                                  mem.get("MemTotal"), limits.gpu_memory_utilization))
        if prober is not None:
            prober.tick()
            silent = prober.silent_for()
            if silent >= limits.stall_timeout_s:
                return WatchEvent("stall", time.time(), f"no answer to a 1-token generation for {silent:.1f} s "
                                  f"(--stall-timeout {limits.stall_timeout_s:g} s; /metrics is not served, so the "
                                  "watch probes generation; /health may still say 200)",
                                  onset=time.time() - silent)
            continue
        got = scrape(client, metrics_url)
        now = clock()
        answered = answered or got is not None
        if not answered or (got is not None and (got.running == 0 or got.tokens != last_tokens)):
            # a server whose /metrics never answered (not vLLM's): no stall can be told
            if got is not None:
                last_tokens = got.tokens
            moved, moved_wall = now, time.time()
            continue
        if now - moved >= limits.stall_timeout_s:
            what = (f"{got.running:g} requests running and no token generated" if got is not None
                    else "/metrics did not answer")
            return WatchEvent("stall", time.time(), f"{what} for {now - moved:.1f} s (--stall-timeout "
                              f"{limits.stall_timeout_s:g} s; /health may still say 200)", onset=moved_wall)


def wait_for_memory(need: int, timeout: float, poll: float, meminfo: Path | None = None,
                    clock: Callable[[], float] = time.monotonic) -> tuple[bool, int]:
    """Wait until ``MemAvailable`` is at least ``need`` bytes (after a kill a GB10 gives memory back
    over ~60 s): (whether it came back within ``timeout``, the last figure read)."""
    t0 = clock()
    while True:
        try:
            available = read_meminfo(meminfo).get("MemAvailable", need)
        except OSError:
            available = need  # no meminfo (not Linux): nothing to wait for
        if available >= need:
            return True, available
        if clock() - t0 >= timeout:
            return False, available
        time.sleep(poll)
