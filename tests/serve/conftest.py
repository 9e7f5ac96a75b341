"""Serve-test fixtures: a real hybrid artifact built by `hybrid-build run` from the tiny checkpoint, a
stand-in artifact folder for the plans, and the OpenAI stand-in server (as a server, and as `vllm`)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from meminfo_file import write_meminfo  # noqa: E402

# the tests live in one folder per serve sub-package; the helper modules they import by name (stand-in
# servers, vLLM sources, probes, serve_cli) stay here, beside the golden files
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    """The inc-hybrid artifact of the tiny checkpoint (FP8 shared experts, stored int8 head),
    validated without the end-to-end forward: serve accepts it, and it holds no reference."""
    from hybrid_build.pipeline.cli import main

    out = tmp_path_factory.mktemp("artifact") / "out"
    rc = main(["run", str(tiny_checkpoint), "-o", str(out), "--no-validate", "-q"])
    rc = rc or main(["validate", str(out), "--no-e2e", "-q"])
    if rc != 0:
        shutil.rmtree(out, ignore_errors=True)
        pytest.fail(f"hybrid-build run exited {rc}")
    return out


@pytest.fixture
def artifact(tmp_path) -> Path:
    """A stand-in artifact folder for plans and goldens: config.json naming a Hub source, no weights."""
    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "hybrid_build": {
        "format": "inc-hybrid", "source": {"id": "Intel/Qwen3.5-122B-A10B-int4-AutoRound"}, "lm_head": "gptq-int8"}}))
    return art


STANDIN = Path(__file__).resolve().parent / "standin_server.py"


@pytest.fixture
def standin(tmp_path):
    """``standin(*flags, key=None, model="qwen")``: the OpenAI stand-in server, started by the launcher
    as serve starts vLLM (``key``: in its environment as VLLM_API_KEY, and sent by the readiness
    probe); its base URL once it answers. Stopped after the test."""
    from serve_cli import free_port

    from hybrid_build.serve.launch.engine import LaunchPlan
    from hybrid_build.serve.launch.launcher import start, wait_ready
    from hybrid_build.serve.launch.served_key import ApiKey

    servers = []

    def _start(*extra: str, key: str | None = None, model: str = "qwen") -> str:
        port = free_port()
        plan = LaunchPlan([sys.executable, str(STANDIN), "--port", str(port), "--model", model, *extra], {}, model,
                          port, "127.0.0.1", "base", "local", "stand-in",
                          api_key=ApiKey(key, "--api-key") if key else None)
        server = start(plan, tmp_path / f"standin-{port}.log")
        servers.append(server)
        wait_ready(server, timeout=60, poll=0.05)
        return server.plan.base_url

    yield _start
    for s in servers:
        s.stop()

FAKE_VLLM = '''#!{python}
import json, os, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("0.0.0-standin")
    sys.exit(0)
if os.environ.get("HB_STANDIN_RECORD"):  # what serve started vLLM with: its argv and its key variable
    with open(os.environ["HB_STANDIN_RECORD"], "w") as f:
        json.dump({{"argv": sys.argv, "VLLM_API_KEY": os.environ.get("VLLM_API_KEY")}}, f)
flags = os.environ.get("HB_STANDIN_FLAGS", "").split()
if os.environ.get("HB_STANDIN_LAUNCHES"):  # one line per start; from the second on, the restart flags too
    path = os.environ["HB_STANDIN_LAUNCHES"]
    again = os.path.exists(path)
    with open(path, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    flags += os.environ.get("HB_STANDIN_RESTART_FLAGS", "").split() if again else []
opt = lambda name: args[args.index(name) + 1]
ref = ["--reference", args[1]] if os.path.exists(os.path.join(args[1], "hybrid_build", "reference.json")) else []
os.execv(sys.executable, [sys.executable, {standin!r}, "--port", opt("--port"), "--model", opt("--served-model-name"),
                          *ref, *flags])
'''




@pytest.fixture
def serve_env(tmp_path):
    """A bin folder with a stand-in `vllm` (it serves the OpenAI stand-in, answering prompt
    log-probabilities from the artifact's reference when there is one; more flags from
    ``HB_STANDIN_FLAGS``; with ``HB_STANDIN_RECORD=FILE`` it writes its argv and ``VLLM_API_KEY``
    there; with ``HB_STANDIN_LAUNCHES=FILE`` it adds a line there at each start and, from the
    second start on, the flags of ``HB_STANDIN_RESTART_FLAGS``) and `nvidia-smi` first on PATH, a
    free port, a meminfo file serve reads instead of the host's (``meminfo``: plenty available, so
    that no test depends on this machine's memory) and a check that the server does not outlive
    the test."""
    from serve_cli import _processes_mentioning, free_port

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text(FAKE_VLLM.format(python=sys.executable, standin=str(STANDIN)))
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # check_prerequisites looks for a GPU
    for f in bindir.iterdir():
        f.chmod(0o755)
    port = free_port()
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, available_gb=1000, total_gb=1024)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1",
               HYBRID_BUILD_MEMINFO=str(meminfo))
    marks = [f"--port {port}"]
    yield {"env": env, "port": port, "marks": marks, "cwd": tmp_path, "meminfo": meminfo, "bin": bindir}
    left = _processes_mentioning(marks)
    for line in left:
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"the server outlived the command: {left}"
