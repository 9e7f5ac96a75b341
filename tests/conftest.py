"""Shared fixtures: an isolated, offline Hub cache, and the tiny real checkpoint built once.

The tiny checkpoint is built by ``hybrid_build.pipeline.generators.demo`` (transformers + auto-round) once
per machine and cached under ``$HYBRID_BUILD_TEST_CACHE`` (default ``~/.cache/hybrid-build/tests``)
keyed by the builder's source hash, so a changed builder rebuilds it (one worker builds it while
the others wait, when the suite runs in parallel). Tests must not modify it:
copy it (``tiny_copy``) to plant defects.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

# Triton reads this when it is first imported: without a GPU the kernel tests run in Triton's
# interpreter. Set before any test module can import triton; a GPU machine compiles for real.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist every worker runs on a core of its own: torch's OpenMP threads (one per core by default)
# would then outnumber the cores and spin against each other's. Measured under load on 2 cores: the eval
# example's CPU time 88 s with 2 threads a process, 15 s with 1. The children tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402

# Builds record when they were made; a fixed epoch (the reproducible-builds convention the provenance
# honours) keeps two builds of the same input byte-identical across a second's edge. Set at import, so
# session fixtures built before any function fixture see it too.
os.environ.setdefault("SOURCE_DATE_EPOCH", "1764547200")

ROOT = Path(__file__).resolve().parents[1]


_TREE = pytest.StashKey[dict]()


def pytest_sessionstart(session):
    """The repository as it was before the first test (the controller alone under xdist)."""
    if not hasattr(session.config, "workerinput"):
        from repo_tree import snapshot

        session.config.stash[_TREE] = snapshot(ROOT)


def pytest_sessionfinish(session, exitstatus):
    """The run fails if it left the repository with a new, changed or removed file (tests/repo_tree.py)."""
    before = session.config.stash.get(_TREE, None)
    if before is None:
        return
    from repo_tree import changes, snapshot

    left = changes(before, snapshot(ROOT))
    if left:
        more = f" and {len(left) - 20} more" if len(left) > 20 else ""
        line = (f"FAILED: the suite left the repository changed (tests write under pytest's temporary folders and "
                f"the test cache): {', '.join(left[:20])}{more}")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(line, red=True, bold=True)
        else:
            print(line, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _trust_records(tmp_path_factory):
    """This machine's trust records (core.local_trust) in the session's temporary folder, never the
    user's state folder; session-scoped and autouse, so it is in place before any build fixture.
    A test that plays another machine points ``HYBRID_BUILD_TRUST_DIR`` at an empty folder."""
    from hybrid_build.core.local_trust import TRUST_ENV

    os.environ[TRUST_ENV] = str(tmp_path_factory.getbasetemp() / "trust")


@pytest.fixture
def another_machine(tmp_path, monkeypatch) -> Path:
    """This test runs as on a machine that built and validated nothing: its own empty trust records."""
    from hybrid_build.core.local_trust import TRUST_ENV

    folder = tmp_path / "another-machine-trust"
    monkeypatch.setenv(TRUST_ENV, str(folder))
    return folder


@pytest.fixture(autouse=True)
def _isolated_hub(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path_factory, monkeypatch):
    """The user's state folder (``core.state_dir``: serve's logs, a generated key) under the test's
    temp folder, never this user's own; a test that sets XDG_STATE_HOME itself still wins."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.getbasetemp() / "xdg_state"))
    monkeypatch.delenv("HYBRID_BUILD_STATE_DIR", raising=False)


def _builder_key() -> str:
    from hybrid_build.pipeline.generators import demo

    return hashlib.sha256(Path(demo.__file__).read_bytes()).hexdigest()[:12]


def _cache_root() -> Path:
    return Path(os.environ.get("HYBRID_BUILD_TEST_CACHE", Path.home() / ".cache" / "hybrid-build" / "tests"))


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The tiny INT4 AutoRound Qwen3.5-MoE checkpoint (read-only: copy before changing)."""
    from hybrid_build.pipeline.generators.demo import build_demo_checkpoint

    target = _cache_root() / f"tiny-{_builder_key()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # the suite's workers (pytest -n) share the cache: one builds, the others wait for it
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors.index.json").exists():
            shutil.rmtree(target, ignore_errors=True)
            build_demo_checkpoint(target)
    return target


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    return dst


@pytest.fixture(scope="session")
def referenced_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint's artifact built and validated by ``hybrid-build run`` (read-only): it holds
    the reference (``validate/reference.py``) that ``verify`` and ``serve`` compare servers with."""
    from hybrid_build.pipeline.cli import main

    out = tmp_path_factory.mktemp("referenced") / "out"
    rc = main(["run", str(tiny_checkpoint), "-o", str(out), "-q"])
    if rc != 0 or not (out / "hybrid_build" / "reference.json").is_file():
        pytest.fail(f"hybrid-build run exited {rc} and left no reference in {out}")
    return out


@pytest.fixture
def hostile():
    """``hostile(answer, on="/", location="", record=None) -> base URL``: a real child server
    (tests/serve/hostile_server.py) answering ``answer`` on ``on``; every child is killed after."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "serve" / "hostile_server.py"
    procs = []

    def start(answer: str, on: str = "/", location: str = "", record: Path | None = None) -> str:
        argv = [sys.executable, str(script), "--answer", answer, "--on", on, "--location", location]
        if record is not None:
            argv += ["--record", str(record)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()  # blocks until the port is bound
        assert line.startswith("READY "), line
        return f"http://127.0.0.1:{int(line.split()[1])}"

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)
