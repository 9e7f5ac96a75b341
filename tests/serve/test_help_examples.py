"""Every example in a ``--help`` epilog runs as written on the demo output.

A fresh folder gets ``out/`` from the README's quick start (``hybrid-build run -o out``, with
``-vv``, whose log is checked too); ``./int4`` and ``./ckpt`` are the INT4 checkpoint that run
built (the demo source), ``hybrid/`` a copy of ``out/`` and ``ray-token`` a Ray token file of the
user's (0600). Each example then runs there through the shell, as a user would paste it, and must
exit 0. Examples that would start a server get
``--dry-run``; ``bench`` examples measure the stdlib stand-in server on their port (skipped if
that port is taken); those that need the network, a real 122B checkpoint or a Hub upload are
skipped with the reason.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
STANDIN = Path(__file__).resolve().parent / "standin_server.py"


# An example line: optional environment assignments (VAR=word or VAR="..."), then the command.
EXAMPLE_LINE = re.compile(r'^\s+(?:[A-Z_][A-Z0-9_]*=(?:"[^"]*"|\S+)\s+)*(hybrid-build\s.*?)\s*(#.*)?$')


def epilog_examples() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(command whose help shows it, example command line) for every example of every epilog, and
    the indented lines of an examples block that are not an example (which would hide the rest)."""
    from hybrid_build.pipeline.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found, unparsed = [], []
    for name, p in [("hybrid-build", parser), *sub.choices.items()]:
        in_block = False
        for line in (p.epilog or "").splitlines():
            if re.match(r"^examples?:\s*$", line):
                in_block = True
                continue
            m = EXAMPLE_LINE.match(line) if in_block else None
            if m:
                found.append((name, m.group(1)))
            elif in_block and line.strip():
                if line[:1].isspace():
                    unparsed.append((name, line))
                in_block = False
    return found, unparsed


EXAMPLES, UNPARSED = epilog_examples()


def test_every_indented_example_line_is_read():
    """An examples block ends at its first unindented line; an indented line the parser cannot
    read would silently drop every example after it from the checks below."""
    assert UNPARSED == []


def why_not(cmd: str, cwd: Path) -> str | None:
    """Why an example cannot run on the demo output here, or None if it must."""
    args = shlex.split(cmd.split(">")[0])[1:]
    verb = args[0]
    if verb == "publish" and "--dry-run" not in args:
        return "uploads to the Hub"
    for i, a in enumerate(args):
        if HUB_ID.match(a) and (i == 0 or args[i - 1] != "--repo-id") and not (cwd / a).exists():
            return f"reads the Hub repo {a} (network)"
        if a.startswith("./") and verb != "demo-checkpoint" and not (cwd / a).exists():
            return f"needs the checkpoint {a}"
    if "--recipe" in args and args[args.index("--recipe") + 1].startswith("qwen3.5-122b"):
        return "the 122B recipe refuses the 4-layer demo model"
    if "--engine" in args and args[args.index("--engine") + 1] == "vllm" and verb == "validate":
        return "runs both models in vLLM: needs a GPU"
    if verb == "verify":
        return ("checks a running server against the artifact's reference "
                "(hybrid-build serve; tests/validate/test_verify.py)")
    if verb == "eval" and any("://" in a for a in args):
        return "evaluates running OpenAI-compatible servers (hybrid-build serve)"
    remote = next((a for a in args if "://" in a and not a.startswith("http://127.0.0.1:")), None)
    if remote:
        return f"talks to the server at {remote} (network)"
    if "--trace" in args:
        trace = args[args.index("--trace") + 1]
        if not trace.startswith("agent-synthetic") and not (cwd / trace).exists():
            return f"replays the user's trace {trace} (tests/serve/bench/test_bench_trace.py makes small ones)"
        if "--duration" in args:
            return "a soak of --duration seconds (tests/serve/bench/test_bench_trace.py runs short ones)"
    if "--trust-key" in args and not (cwd / args[args.index("--trust-key") + 1]).exists():
        return (f"needs the publisher's public key {args[args.index('--trust-key') + 1]} "
                "(tests/pipeline/test_bound_artifact.py signs and checks with a key made in the test)")
    if "--texts" in args and not (cwd / args[args.index("--texts") + 1]).exists():
        return f"reads the user's texts file {args[args.index('--texts') + 1]}"
    return None


def offline_env(cwd: Path) -> dict:
    # module-scoped: the autouse offline-Hub fixture is not active yet, so the same isolation here
    # (and a generated API key, `serve --host 0.0.0.0`, lands in the test's folder, not the user's)
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(cwd / ".hf_home"), PYTHONUNBUFFERED="1",
                XDG_STATE_HOME=str(cwd / ".state"))


def readme_usage() -> list[str]:
    """The command lines of README.md's Usage block (comments dropped)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"^## Usage\n.*?```bash\n(.*?)\n```", readme, re.S | re.M)
    assert block, "README has no Usage block"
    return [re.sub(r"\s+#.*$", "", ln).strip() for ln in block.group(1).splitlines() if ln.startswith("hybrid-build ")]


README_USAGE = readme_usage()


def readme_why_not(cmd: str, cwd: Path) -> str | None:
    """Why a README line cannot run on the demo here: what ``why_not`` says, plus the lines that
    need a running server or more context than the demo model has."""
    args = shlex.split(cmd)[1:]
    if args[0] == "bench":
        return "measures a running server (bench's --help examples run against the stand-in)"
    if "--context" in args:
        import json

        limit = json.loads((cwd / "int4" / "config.json").read_text())
        limit = limit.get("text_config", limit).get("max_position_embeddings")
        if limit and int(args[args.index("--context") + 1]) > limit:
            return f"a context beyond the demo model's {limit} tokens (the README says so)"
    return why_not(cmd, cwd)


def as_run(cmd: str) -> str:
    """The example as the test runs it: ``serve`` only prints the command it would start."""
    if shlex.split(cmd)[1] == "serve" and "--dry-run" not in cmd:
        return cmd + " --dry-run"
    return cmd


# the demo folder's names: `out/` (the demo output) and `hybrid/` (a copy of it), `./int4` and `./ckpt`
# (the demo source, one folder): the same command on either name is one command
SAME_FOLDER = {"./hybrid": "out", "hybrid/": "out", "hybrid": "out", "out/": "out", "./ckpt": "./int4"}
RAN: dict[str, subprocess.CompletedProcess] = {}  # one command -> its run, shared by the tests that paste it


def run_once(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` as a user pastes it, run through the shell in ``cwd``; a command a --help example and
    a README line both hold (the eval and validate runs take minutes) runs once for both."""
    key = " ".join(SAME_FOLDER.get(a, a) for a in shlex.split(as_run(cmd)))
    if key not in RAN:
        RAN[key] = subprocess.run(["bash", "-c", as_run(cmd)], cwd=cwd, capture_output=True, text=True, timeout=900,
                                  env=offline_env(cwd))
    return RAN[key]


@pytest.fixture(scope="module")
def demo_cwd(tmp_path_factory):
    """A folder holding the demo output ``out/`` built by the README's command (``-vv``), the
    demo source as ``int4`` and ``ckpt``, ``hybrid/``, a copy of ``out/``, and ``ray-token`` (0600)."""
    cwd = tmp_path_factory.mktemp("examples")
    proc = subprocess.run(["hybrid-build", "run", "-o", "out", "-vv"], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=offline_env(cwd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = Path("out/.hybrid-build/demo-source")
    assert (cwd / source / "config.json").is_file()
    for name in ("int4", "ckpt"):
        (cwd / name).symlink_to(source, target_is_directory=True)
    shutil.copytree(cwd / "out", cwd / "hybrid", symlinks=True)
    (cwd / "ray-token").write_text("example-ray-token-0123456789abcdef\n")
    (cwd / "ray-token").chmod(0o600)
    return cwd, proc


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    """The stand-in OpenAI server on the port the bench examples name, or None if it is taken."""
    from hybrid_build.serve.launch.engine import LaunchPlan
    from hybrid_build.serve.launch.launcher import start, wait_ready

    ports = {int(m) for _, e in EXAMPLES for m in re.findall(r"http://127\.0\.0\.1:(\d+)/", e)}
    assert len(ports) == 1, ports
    port = ports.pop()
    with socket.socket() as s:
        # as the stand-in binds (ThreadingHTTPServer reuses the address): an earlier server's
        # connections in TIME_WAIT do not make the port taken, a listening process does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            yield None
            return
    # max_model_len the 122B's: the synthetic agent trace's contexts (to 100,000 tokens) fit, as on its server
    plan = LaunchPlan([sys.executable, str(STANDIN), "--port", str(port), "--tokens", "8", "--max-model-len", "262144"],
                      {}, "qwen", port, "127.0.0.1", "base", "local", "stand-in")
    server = start(plan, tmp_path_factory.mktemp("standin") / "server.log")
    try:
        wait_ready(server, timeout=60, poll=0.1)
        yield server
    finally:
        server.stop()


def test_epilogs_have_examples():
    commands = {name for name, _ in EXAMPLES}
    assert {"hybrid-build", "run", "serve", "validate", "publish", "plan", "inspect", "bench",
            "demo-checkpoint"} <= commands
    assert ("hybrid-build", "hybrid-build serve out/ --profile dense --dry-run") in EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("command, example", EXAMPLES, ids=[f"{c}: {e}" for c, e in EXAMPLES])
def test_example_runs_on_the_demo_output(demo_cwd, request, command, example):
    cwd, _ = demo_cwd
    reason = why_not(example, cwd)
    if reason:
        pytest.skip(reason)
    if shlex.split(example)[1] == "bench" and request.getfixturevalue("bench_server") is None:
        pytest.skip("the bench examples' port is taken on this machine")
    proc = run_once(example, cwd)
    assert proc.returncode == 0, \
        f"`{example}` (from `{command} --help`) exited {proc.returncode}:\n{proc.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("line", README_USAGE)
def test_readme_usage_runs_on_the_demo_output(demo_cwd, line):
    """README's Usage block, with ``./int4`` the demo source and ``./hybrid`` a built demo output."""
    cwd, _ = demo_cwd
    reason = readme_why_not(line, cwd)
    if reason:
        pytest.skip(reason)
    proc = run_once(line, cwd)
    assert proc.returncode == 0, f"`{line}` (README) exited {proc.returncode}:\n{proc.stderr[-2000:]}"


def test_readme_usage_lines_that_must_run_are_not_skipped(demo_cwd):
    cwd, _ = demo_cwd
    runnable = {ln.split()[1] for ln in README_USAGE if readme_why_not(ln, cwd) is None}
    assert {"plan", "run", "status", "validate", "eval", "serve"} <= runnable, runnable


def test_examples_that_must_run_are_not_skipped(demo_cwd):
    cwd, _ = demo_cwd
    runnable = {e for _, e in EXAMPLES if why_not(e, cwd) is None}
    assert {"hybrid-build serve out/ --profile dense --dry-run", "hybrid-build run -o out/",
            "hybrid-build validate out/",
            "hybrid-build publish out/ --repo-id my-org/Qwen3.5-122B-A10B-hybrid --dry-run",
            "hybrid-build serve out/ --engine docker --profile dense"} <= runnable


def test_vv_shows_hybrid_builds_debug_lines_and_not_the_libraries(demo_cwd):
    cwd, proc = demo_cwd
    lines = proc.stderr.splitlines()
    ours = [ln for ln in lines if ln.startswith("DEBUG hybrid_build.")]
    assert ours, proc.stderr[-2000:]
    foreign = [ln for ln in lines if ln.startswith("DEBUG ") and not ln.startswith("DEBUG hybrid_build.")]
    assert not foreign, foreign[:5]
    assert not any("matplotlib" in ln or "PIL" in ln for ln in lines), [ln for ln in lines if "matplotlib" in ln][:5]
    # matplotlib did draw (with text, which is where its font manager logs) in this process
    png = cwd / "out" / "hybrid_build" / "validation.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(lines) < 50, f"{len(lines)} lines on stderr"


def test_readme_test_command_is_what_ci_runs():
    """The README's test command fetches the vLLM sources first, and .ci/run runs the same steps."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    block = re.search(r"Run the tests.*?```bash\n(.*?)\n```", readme, re.S)
    assert block, "README has no test command"
    steps = [s.strip() for s in block.group(1).split("&&")]
    pytest_line = "python -m pytest -q -n auto --dist loadfile"
    assert steps == [". .venv/bin/activate", "bash .ci/vllm_sources.sh", pytest_line]
    ci = [ln.strip() for ln in (root / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci.index("bash .ci/vllm_sources.sh") < ci.index(pytest_line)
