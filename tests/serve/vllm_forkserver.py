"""A fork server for the vLLM probes: imports one vLLM version's heavy modules once, then runs each probe
in a forked child, as ``python SCRIPT ARGS`` or ``python -c CODE ARGS`` would (test helper).

Importing vLLM's config and scheduler modules (with torch and transformers) is 7-9 s of CPU on this
machine and most of every probe's time; the suite starts dozens of probes. The child of a fork starts
from the imported modules and nothing else: no probe's state reaches another, each gets the
environment, working folder, ``sys.path``, ``sys.argv``, stdin (``/dev/null``), stdout and stderr
(files) of its own, and its exit status is the probe's. Started by ``vllm_sources.run_python`` with the
version's PYTHONPATH and the caller's ``VLLM_*`` variables (those vLLM reads at import), one server per
version and set of them, per test process. What a child shares with the server, unlike a fresh process: what
the preloaded modules read from the environment at import (the first caller's; only ``VLLM_*`` is keyed on),
the hash seed, and the import-time lines they printed (into the server's stderr, not the probe's).

Protocol, one JSON object per line: requests on stdin ``{"argv", "env", "cwd", "stdout", "stderr"}``;
answers on stdout ``{"pid": N}`` when the child starts, then ``{"rc": N}`` (negative: the signal that
ended it). End of stdin ends the server.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys
import threading
import traceback
import types

# what every probe imports first (present in every tested version); a module a version lacks is skipped.
# HYBRID_BUILD_FORKSERVER_PRELOAD (names joined by commas) replaces the list: the server's own tests
PRELOAD = ("torch", "transformers", "vllm.config", "vllm.v1.core.sched.scheduler", "vllm.v1.request")


# a probe's sys.path is its own: not this server's folder (first on it, as for any script)
if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]
_OWN_PATH = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


def _preload() -> None:
    names = os.environ.get("HYBRID_BUILD_FORKSERVER_PRELOAD")
    for name in PRELOAD if names is None else [n for n in names.split(",") if n]:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _run(request: dict) -> int:
    """In the child: become the probe's process and run it; its exit status."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    # sys.path in a fresh interpreter's order: the script's folder ('' for -c), then PYTHONPATH as given (an
    # empty entry is the working folder), then the interpreter's own; this server's PYTHONPATH folders that the
    # probe's lacks are left out
    wanted = [p or os.getcwd() for p in request["env"].get("PYTHONPATH", "").split(os.pathsep)] \
        if request["env"].get("PYTHONPATH") else []
    rest = [p for p in sys.path if p not in _OWN_PATH and p not in wanted]
    first = "" if argv[0] == "-c" else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *dict.fromkeys(wanted), *rest]
    sys.path_importer_cache.clear()  # folders made since the server started are seen, as by a new process
    importlib.invalidate_caches()
    sys.argv = ["-c", *argv[2:]] if argv[0] == "-c" else list(argv)
    code = 0
    try:
        if argv[0] == "-c":  # a __main__ module of its own, as python -c has (what it defines pickles by it)
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the probe's uncaught exception, printed as the interpreter would
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what an interpreter's exit does first: join the probe's non-daemon threads
    atexit._run_exitfuncs()
    if argv[0] == "-c":  # then its modules go: a file the probe left open is flushed and closed
        sys.modules["__main__"].__dict__.clear()
    import gc

    gc.collect()
    return code


def main() -> int:
    _preload()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # nothing but answers on the answer pipe: stray prints go to stderr
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(answers.fileno())
                code = _run(request)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code & 0xFF)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
