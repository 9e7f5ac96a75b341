"""Start a server from a ``LaunchPlan``, wait until it answers, and smoke-test it.

READY means ``GET /v1/models`` returns 200. While waiting, a server process that exits ends the
wait at once with the tail of its log; a server that is not ready in time is stopped, with the
same tail. The smoke test asks for the capital of France and requires "Paris" in the answer.
With a served API key (``served_key``) the server gets it in its environment and every request
here sends it; a server that refuses it ends the wait at once (``KeyRefused``).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybrid_build.core.errors import ArtifactError, CannotRun, ErrorStatus, ExternalToolError, KeyRefused, UserError
from hybrid_build.core.http_client import HttpClient
from hybrid_build.recipes.profiles import SMOKE_EXPECT, SMOKE_PROMPT

from .engine import LaunchPlan
from .served_key import SERVER_ENV

log = logging.getLogger(__name__)



def serve_hint(sent: bool) -> str:
    """What a 401 to serve's own request means: vLLM has another key than the one serve gave it, or
    one serve did not give it."""
    if sent:
        return "serve sends the key it gave vLLM; does a profile's extra_args hold its own --api-key?"
    return f"serve gave vLLM no key; is {SERVER_ENV} set where vLLM runs, or --api-key in a profile's extra_args?"


def plan_key(plan: LaunchPlan) -> str | None:
    """The key the plan's server wants (None: none)."""
    return plan.secret_env.get(SERVER_ENV)


def http_json(url: str, payload: dict | None = None, timeout: float = 10.0, api_key: str | None = None) -> dict:
    """One request through ``core/http_client`` (a deadline for the whole request, no redirect, the
    body-size cap); a 401/403 is ``KeyRefused`` with serve's hint."""
    with HttpClient(api_key=api_key, timeout=timeout, refused_hint=serve_hint(bool(api_key))) as c:
        return c.get_json(url) if payload is None else c.post_json(url, payload)


def check_prerequisites(plan: LaunchPlan) -> None:
    """One clear line when the engine's tool or a GPU is missing."""
    tool = plan.argv[0]
    if shutil.which(tool) is None:
        hint = ("install vLLM (pip install vllm) or use --engine docker" if tool == "vllm"
                else "install Docker, or use --engine local" if tool == "docker" else "")
        raise CannotRun(f"{tool!r} was not found on PATH" + (f": {hint}" if hint else ""))
    if tool in ("vllm", "docker") and shutil.which("nvidia-smi") is None and not Path("/dev/nvidiactl").exists():
        raise CannotRun("no NVIDIA GPU found (no nvidia-smi, no /dev/nvidiactl): vLLM needs a CUDA GPU")


def local_vllm_version(tool: str = "vllm") -> str | None:
    """``vllm --version`` of the vLLM on PATH; None when it cannot be read."""
    from hybrid_build.serve.runtime.fixes import version_in

    try:
        r = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return version_in(r.stdout) if r.returncode == 0 else None


def served_vllm_version(plan: LaunchPlan) -> str | None:
    """The vLLM version the plan would serve: ``vllm --version`` (local), or the image's (a tested
    image by its name, any other by asking it); None when it cannot be read."""
    from hybrid_build.serve.runtime.fixes import tested_image, version_in

    if plan.engine == "docker":
        known = tested_image(plan.image or "")
        if known is not None:
            return known.version
        argv = ["docker", "run", "--rm", "--entrypoint", "python3", plan.image or "", "-c",
                "from importlib.metadata import version; print(version('vllm'))"]
    else:
        argv = [plan.argv[0], "--version"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return version_in(r.stdout) if r.returncode == 0 else None


def warn_if_untested(plan: LaunchPlan, version: str | None = None) -> str | None:
    """Log one warning line when the vLLM to be served (``version``, else asked) is outside the
    tested set; serving goes on (``hybrid-build verify`` is what checks its numerics). Returns the
    line, if any."""
    from hybrid_build.serve.runtime.fixes import untested_warning

    line = untested_warning(version or served_vllm_version(plan))
    if line:
        log.warning(line)
    return line


def tail(path: Path, lines: int = 30, start: int = 0) -> str:
    """The last ``lines`` lines the engine wrote to its log from byte ``start`` on (this start's own),
    without serve's event lines (``serve_record.SERVE_MARK``)."""
    from .serve_record import engine_lines

    return "\n".join(engine_lines(path, start)[-lines:])


class EngineEnded(ExternalToolError):
    """The engine ended (``code``; None: stopped after the ready timeout) before it was ready."""

    def __init__(self, message: str, code: int | None):
        super().__init__(message)
        self.code = code


@dataclass
class Server:
    process: subprocess.Popen
    plan: LaunchPlan
    log_path: Path
    log_from: int = 0  # where this engine's lines begin in the log (it is appended to)
    keeper: subprocess.Popen | None = None  # ends the engine's group if serve dies (``keeper``)
    keeper_pipe: int | None = None
    stopped: str | None = None  # how ``stop`` ended it: a second stop signals nothing (the group id may be free)

    def stop(self, grace: float = 10.0) -> str:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds (the group's last
        members too, after its leader ended); says how it ended. Its keeper then leaves. Once only:
        a later call returns the first one's answer."""
        from .keeper import stand_down
        from .watch import stop_engine

        if self.stopped is not None:
            return self.stopped
        self.stopped = stop_engine(self.process, grace, group=self.process.pid)
        if self.keeper is not None and self.keeper_pipe is not None:
            stand_down(self.keeper, self.keeper_pipe)
            self.keeper = self.keeper_pipe = None
        return self.stopped


def start(plan: LaunchPlan, log_path: Path, keeper_grace: float = 10.0) -> Server:
    """Start the plan's server in a session of its own (a stop reaches vLLM's engine core and workers
    too: ``watch.stop_engine``), bound to this process: it gets SIGTERM when this process dies, and
    a keeper (``keeper``) ends its whole group then, SIGKILL included, after ``keeper_grace``."""
    from .keeper import die_with_parent
    from .keeper import start as start_keeper

    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_from = log_path.stat().st_size if log_path.exists() else 0
    out = open(log_path, "ab")
    env = {**os.environ, **plan.env, **plan.secret_env}  # the key last: it wins over an inherited one
    # the kernel's parent-death signal follows the thread that forks: serve starts engines from its main thread
    proc = subprocess.Popen(plan.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=die_with_parent())
    out.close()
    try:
        keeper, pipe = start_keeper(proc.pid, keeper_grace)
    except OSError as e:  # the engine still has its parent-death signal
        log.warning("no keeper for the engine's process group (%s): if serve is killed, only vLLM's API server is "
                    "told", e)
        keeper, pipe = None, None
    log.info("started %s (pid %d), log %s", plan.argv[0], proc.pid, log_path)
    return Server(proc, plan, log_path, log_from, keeper, pipe)


def wait_ready(server: Server, timeout: float, poll: float = 1.0,
               on_tick: Callable[[float], None] | None = None) -> float:
    """Seconds until ``/v1/models`` answered 200; raises ExternalToolError on exit or timeout."""
    t0 = time.monotonic()
    url = server.plan.base_url + "/models"
    key = plan_key(server.plan)
    while True:
        code = server.process.poll()
        if code is not None:
            server.stop()  # the rest of its group, and its keeper
            raise EngineEnded(f"the server exited with code {code} before it was ready; last log lines:\n"
                              + tail(server.log_path, start=server.log_from), code)
        try:
            http_json(url, timeout=min(5.0, poll * 5), api_key=key)
            return time.monotonic() - t0
        except (KeyRefused, UserError):  # up, and refusing us (or redirecting): waiting longer changes nothing
            server.stop()
            raise
        except (CannotRun, ErrorStatus):  # not up yet: no answer, 503 while loading, a half-started server
            pass
        elapsed = time.monotonic() - t0
        if on_tick:
            on_tick(elapsed)
        if elapsed > timeout:
            server.stop()
            raise EngineEnded(f"the server was not ready after {timeout:.0f} s (stopped it); last log lines:\n"
                              + tail(server.log_path, start=server.log_from), None)
        time.sleep(poll)


def probe_generation(base_url: str, model: str, api_key: str | None, timeout: float) -> None:
    """One token of a tiny chat completion, the stall watch's probe where ``/metrics`` is not served
    (``watch.Prober``); raises unless the engine answered with a completion."""
    r = http_json(base_url + "/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1, "temperature": 0},
        timeout=timeout, api_key=api_key)
    if not isinstance(r, dict) or not isinstance(r.get("choices"), list) or not r["choices"]:
        raise ExternalToolError(f"the probe got no completion: {json.dumps(r)[:200]}")


def smoke_test(base_url: str, model: str, timeout: float = 120.0, expect: str | None = SMOKE_EXPECT,
               api_key: str | None = None) -> str:
    """Ask for the capital of France; the answer must contain ``expect`` (case-insensitive), or,
    with ``expect=None`` (the recipe says the weights are random), be non-empty. Returns it.
    ``api_key`` is sent as a Bearer token; a refused one is ``KeyRefused`` with serve's hint."""
    try:
        r = http_json(base_url + "/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": SMOKE_PROMPT}],
            "max_tokens": 64, "temperature": 0}, timeout=timeout, api_key=api_key)
    except (ErrorStatus, CannotRun) as e:  # an error status, no answer, an answer that is not JSON
        raise ArtifactError(f"smoke test: {e}")
    try:
        msg = r["choices"][0]["message"]
        text = (msg.get("content") or "") + (msg.get("reasoning_content") or msg.get("reasoning") or "")
    except (KeyError, IndexError, TypeError):
        raise ArtifactError(f"smoke test: malformed chat completion: {json.dumps(r)[:300]}")
    if expect is None and not text.strip():
        raise ArtifactError("smoke test failed: asked for the capital of France, got an empty answer")
    if expect is not None and expect.lower() not in text.lower():
        raise ArtifactError(f"smoke test failed: asked for the capital of France, got {text.strip()[:200]!r} "
                            f"(the recipe's serve.smoke_expect is {expect!r})")
    return text.strip()
