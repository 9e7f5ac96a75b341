"""Fetch and unpack the vLLM sources the serve tests check against (CI helper and fixture code).

The wheels are downloaded once with ``pip download --no-deps`` into ``~/.cache/hybrid-build/wheels``
and only their Python files are unpacked into ``~/.cache/hybrid-build/vllm-src/<version>/``. The
few pure-Python packages vLLM's quantization modules import at module level go into
``~/.cache/hybrid-build/vllm-cpu-deps`` (a ``--target`` folder, never the project's venv): with
those on ``PYTHONPATH`` a CPU-only torch can import vLLM's config classes in a subprocess.

Run ``python tests/serve/vllm_sources.py`` (or ``.ci/vllm_sources.sh``) to prepare everything.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import IO

VERSIONS = ("0.23.0", "0.25.1", "0.26.0", "0.33.0", "0.34.0")
# imported at module level by vllm's platform / distributed / config modules; pure Python or small
CPU_IMPORT_DEPS = ("pyzmq", "cbor2", "aiohttp", "openai_harmony", "openai", "pybase64", "einops", "cachetools",
                   "msgspec", "cloudpickle", "uvloop", "prometheus_client", "fastapi", "partial_json_parser")
# imported too, but their dependencies would pull a CUDA torch into the folder: no deps for these
CPU_IMPORT_NODEPS = ("xgrammar", "llguidance", "apache-tvm-ffi", "gguf", "ijson")


def cache_root() -> Path:
    return Path(os.environ.get("HYBRID_BUILD_CACHE", Path.home() / ".cache" / "hybrid-build"))


def wheel_path(version: str) -> Path | None:
    wheels = cache_root() / "wheels"
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    return found[-1] if found else None


def download_wheel(version: str) -> Path:
    wheel = wheel_path(version)
    if wheel:
        return wheel
    dest = cache_root() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                    "-d", str(dest), f"vllm=={version}"], check=True)
    wheel = wheel_path(version)
    if wheel is None:
        raise RuntimeError(f"pip download left no vllm-{version} wheel in {dest}")
    return wheel


def source_dir(version: str) -> Path:
    return cache_root() / "vllm-src" / version


def unpacked(version: str) -> Path | None:
    """The unpacked source root (it holds ``vllm/``), or None when it is not prepared yet."""
    root = source_dir(version)
    return root if (root / ".complete").exists() else None


def unpack(version: str) -> Path:
    root = source_dir(version)
    if unpacked(version):
        return root
    wheel = download_wheel(version)
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                z.extract(name, tmp)
    (tmp / ".complete").write_text(wheel.name + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def deps_dir() -> Path:
    return cache_root() / "vllm-cpu-deps"


def _deps_line() -> str:
    return " ".join(CPU_IMPORT_DEPS) + " | " + " ".join(CPU_IMPORT_NODEPS) + "\n"


def install_deps() -> Path:
    """The dependency folder; a cached one made for another list of packages gets what is missing
    (the marker names the lists it was made for)."""
    target = deps_dir()
    marker = target / ".complete"
    if not marker.exists() or marker.read_text() != _deps_line():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                        *CPU_IMPORT_DEPS], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        *CPU_IMPORT_NODEPS], check=True)
        marker.write_text(_deps_line())
    return target


def cache_env(version: str) -> dict[str, str]:
    """The environment a probe of ``version`` runs vLLM with beside PYTHONPATH: its own
    ``VLLM_CACHE_ROOT``. vLLM keeps what it learns of a model class there (``modelinfos/``, one file per
    class, keyed by its source's hash); in one folder shared by every version each version's entry
    replaces the last, and each probe re-inspects its classes in a child process of its own (a second
    vLLM import). It also keeps the probes out of the user's ``~/.cache/vllm``."""
    return {"VLLM_CACHE_ROOT": str(cache_root() / "vllm-cache" / version)}


def cpu_pythonpath(version: str) -> str | None:
    """PYTHONPATH that imports vLLM ``version`` on CPU, or None if not prepared."""
    src = unpacked(version)
    if src is None or not (deps_dir() / ".complete").exists():
        return None
    return os.pathsep.join([str(src), str(deps_dir())])



_SERVERS: dict[tuple, tuple[subprocess.Popen, IO[bytes]]] = {}


def _server(version: str, env: dict[str, str]) -> tuple[subprocess.Popen, IO[bytes]]:
    """This process's fork server (``vllm_forkserver.py``) for ``version`` and the ``VLLM_*`` variables of
    ``env`` (vLLM reads some at import), started on first use with ``env``, with its stderr in an unnamed
    temporary file; it ends with this process (at exit, or when its stdin closes)."""
    import atexit
    import tempfile

    key = (version, tuple(sorted((k, v) for k, v in env.items() if k.startswith("VLLM_"))))
    got = _SERVERS.get(key)
    if got is not None and got[0].poll() is None:
        return got
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("vllm_forkserver.py"))], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    if not _SERVERS:
        atexit.register(_end_servers)
    _SERVERS[key] = (proc, err)
    return proc, err


def _end_servers() -> None:
    for proc, err in _SERVERS.values():
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        err.close()
    _SERVERS.clear()


def _answer(proc: subprocess.Popen, err: IO[bytes], deadline: float | None) -> dict:
    """The server's next answer line, read from its pipe unbuffered (a buffered reader could hold the
    next answer where ``select`` cannot see it)."""
    import select
    import time

    fd, line = proc.stdout.fileno(), b""
    while not line.endswith(b"\n"):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        byte = os.read(fd, 1)
        if not byte:
            err.seek(0)
            raise RuntimeError(f"the vLLM fork server ended: {err.read().decode(errors='replace')[-3000:]}")
        line += byte
    return json.loads(line)


def run_python(version: str, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python ARGV`` (a script and its arguments, or ``-c CODE ARGS``) with ``env``, which holds vLLM
    ``version``'s PYTHONPATH, as ``subprocess.run(..., capture_output=True, text=True)`` would run it; forked
    from a server that imported vLLM's heavy modules once (``vllm_forkserver.py``), or a plain subprocess
    with ``HYBRID_BUILD_TEST_FORKSERVER=0``."""
    import tempfile
    import time

    args = [sys.executable, *argv]
    if os.environ.get("HYBRID_BUILD_TEST_FORKSERVER", "1") == "0":
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    proc, err_file = _server(version, env)
    with tempfile.TemporaryDirectory(prefix="vllm-probe-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "cwd": os.getcwd(),
                                     "stdout": str(out), "stderr": str(err)}) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = None
        try:
            pid = _answer(proc, err_file, deadline)["pid"]
            rc = _answer(proc, err_file, deadline)["rc"]
        except TimeoutError:
            if pid is None:  # still importing: this server is of no use
                proc.kill()
            else:  # the probe ran out of time: the server answers its end and serves on
                os.kill(pid, 9)
                _answer(proc, err_file, None)
            raise subprocess.TimeoutExpired(args, timeout, _text(out), _text(err)) from None
        return subprocess.CompletedProcess(args, rc, _text(out), _text(err))


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run_kv_cases(version: str, cases: list[dict], tmp: Path) -> list[dict]:
    """``kv_probe.py --cases``: every case of one vLLM version in one process on its own code (a probe that
    crashed on a case fails the caller); skips the test where the version's sources are not prepared."""
    import pytest

    pp = cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    here = Path(__file__).resolve().parent
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, **cache_env(version), VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([pp, str(here), os.environ.get("PYTHONPATH", "")]))
    r = run_python(version, [str(here / "kv_probe.py"), "--cases", str(tmp / "cases.json"), str(tmp / "out.json")],
                   env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp / "out.json").read_text())
    assert not [x for x in results if "crash" in x], [x.get("trace") for x in results if "crash" in x]
    return results

def main() -> int:
    for v in VERSIONS:
        print(f"vllm {v}: {unpack(v)}")
    print(f"cpu import deps: {install_deps()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
