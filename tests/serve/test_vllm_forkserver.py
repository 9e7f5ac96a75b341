"""The probes' fork server (``vllm_forkserver.py``, through ``vllm_sources.run_python``) runs each probe as
its own process would run: its argv, environment, folder, output and exit status, and nothing left by
the probe before it. Run with nothing preloaded (the server's behaviour does not depend on what it
imported), under a version key of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_sources  # noqa: E402

KEY = "forkserver-test"


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, HYBRID_BUILD_FORKSERVER_PRELOAD="", PYTHONPATH=str(tmp_path / "lib"))


def run(argv, env, timeout=60):
    return vllm_sources.run_python(KEY, argv, env, timeout)


def test_a_probe_gets_its_argv_environment_folder_output_and_status(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = ("import os, sys; print(sys.argv, os.environ['PROBE_WORD'], os.getcwd(), sys.path[0] == '', "
            "sys.stdin.read() == ''); print('to stderr', file=sys.stderr); sys.exit(3)")
    r = run(["-c", code, "a", "b c"], dict(env, PROBE_WORD="w1"))
    assert (r.returncode, r.stderr) == (3, "to stderr\n")
    assert r.stdout == f"['-c', 'a', 'b c'] w1 {tmp_path} True True\n"
    # a script: its folder first on sys.path, run as __main__ with its own __file__; PYTHONPATH after it
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_mod.py").write_text("WORD = 'from PYTHONPATH'\n")
    script = tmp_path / "probe.py"
    script.write_text("import sys, helper_mod\nprint(__name__, __file__, sys.path[0], helper_mod.WORD)\n")
    r = run([str(script)], env)
    assert (r.returncode, r.stdout) == (0, f"__main__ {script} {tmp_path} from PYTHONPATH\n"), r.stderr


def test_nothing_a_probe_does_reaches_the_next(env):
    first = run(["-c", "import json, os; json.left_behind = 1; os.environ['LEFT'] = '1'; print(os.getpid())"], env)
    second = run(["-c", "import json, os; print(os.getpid(), hasattr(json, 'left_behind'), 'LEFT' in os.environ)"],
                 env)
    pid, left, env_left = second.stdout.split()
    assert first.returncode == second.returncode == 0
    assert pid != first.stdout.strip() and (left, env_left) == ("False", "False")


def test_an_uncaught_exception_and_an_exit_message_end_as_in_python(env):
    r = run(["-c", "raise KeyError('gone')"], env)
    assert r.returncode == 1 and r.stderr.rstrip().endswith("KeyError: 'gone'") and "Traceback" in r.stderr
    r = run(["-c", "import sys; sys.exit('a message')"], env)
    assert (r.returncode, r.stderr) == (1, "a message\n")


def test_a_probe_out_of_time_is_killed_and_the_server_serves_on(env):
    assert run(["-c", "pass"], env).returncode == 0  # the server is up: the deadline below is the probe's alone
    with pytest.raises(subprocess.TimeoutExpired):
        run(["-c", "import time; time.sleep(600)"], env, timeout=2)
    # the server answers a probe only after it reaped the one before: the sleeper was killed
    assert run(["-c", "print('next')"], env).stdout == "next\n"


def test_a_probe_exits_as_python_does(env, tmp_path):
    """Its non-daemon threads finish, a file it left open is flushed, and what it defines pickles (its own
    ``__main__``); PYTHONPATH comes first, in the order given."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "which_mod.py").write_text("WHERE = 'a'\n")
    (tmp_path / "b" / "which_mod.py").write_text("WHERE = 'b'\n")
    left = tmp_path / "left-open.txt"
    code = (f"import pickle, threading, time, which_mod\n"
            f"class Point:\n    pass\n"
            f"pickle.dumps(Point())\n"
            f"f = open({str(left)!r}, 'w'); f.write('kept')\n"
            f"def late():\n    time.sleep(0.2); print('thread done', flush=True)\n"
            f"threading.Thread(target=late).start()\n"
            f"print(which_mod.WHERE, flush=True)\n")
    order = os.pathsep.join([str(tmp_path / "b"), str(tmp_path / "a")])
    r = run(["-c", code], dict(env, PYTHONPATH=order))
    assert (r.returncode, r.stdout) == (0, "b\nthread done\n"), r.stderr
    assert left.read_text() == "kept"
