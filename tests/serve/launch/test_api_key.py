"""The served API's key: ``serve`` needs one beyond loopback and generates it into a 0600
file under the user's state folder, hands it to vLLM in the environment only (docker: ``-e
VLLM_API_KEY`` without the value) and sends it with its own readiness probe, check and smoke test;
``verify`` and ``eval`` send ``--api-key`` / ``$OPENAI_API_KEY``, and a server that refuses theirs is
one line and exit 2. The stand-in server wants ``$VLLM_API_KEY`` as vLLM's OpenAI server does."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serve_cli import CliRun, free_port

from hybrid_build.core.errors import KeyRefused, UserError
from hybrid_build.pipeline.cli import main
from hybrid_build.serve.launch.engine import LaunchPlan, docker_publish, plan_launch
from hybrid_build.serve.launch.launcher import smoke_test, start, wait_ready
from hybrid_build.serve.launch.served_key import KEY_FILE, ApiKey, is_loopback, resolve

STANDIN = Path(__file__).resolve().parents[1] / "standin_server.py"
sys.path.insert(0, str(STANDIN.parent))
from standin_server import authorized  # noqa: E402

KEY = "sk-right-0123456789abcdef"
WRONG = "sk-wrong-fedcba9876543210"


@pytest.fixture(autouse=True)
def _no_keys_around(monkeypatch, tmp_path):
    """No key of the user's environment, and a state folder of the test's own."""
    for var in ("OPENAI_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


# ----------------------------------------------------------------------------- when, and which key


def test_loopback_or_not():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "192.168.100.11", "10.0.0.1", "spark1", "example.org"):
        assert not is_loopback(host), host


def test_docker_publishes_the_port_where_the_host_says():
    assert docker_publish("127.0.0.1", 8000) == "127.0.0.1:8000:8000"
    assert docker_publish("localhost", 8001) == "127.0.0.1:8001:8000"
    assert docker_publish("127.0.0.2", 8000) == "127.0.0.2:8000:8000"  # was every interface before
    assert docker_publish("::1", 8000) == "[::1]:8000:8000"
    for host in ("0.0.0.0", "192.168.100.11"):  # beyond loopback: every interface, and a key
        assert docker_publish(host, 8000) == "8000:8000"


def test_resolve_order_and_loopback_without_a_key(tmp_path):
    folder = tmp_path / "keys"
    assert resolve("127.0.0.1", environ={}, folder=folder) is None  # as before: no key
    assert not folder.exists()
    keyfile = tmp_path / "given.key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o644)  # a key file others can read is refused, as the Ray token's is
    with pytest.raises(UserError, match=r"--api-key-file .*can be read or written by others \(mode 0644\).*chmod 600"):
        resolve("0.0.0.0", file=keyfile, environ={})
    keyfile.chmod(0o600)
    env = {"VLLM_API_KEY": WRONG}
    assert resolve("127.0.0.1", flag=KEY, environ=env).origin == "--api-key"
    got = resolve("0.0.0.0", file=keyfile, environ=env)
    assert (got.value, got.origin, got.path) == (KEY, "--api-key-file", keyfile.resolve())
    got = resolve("127.0.0.1", environ=env)  # vLLM would take it anyway: serve knows it too
    assert (got.value, got.origin) == (WRONG, "VLLM_API_KEY")
    with pytest.raises(UserError, match="--api-key or --api-key-file"):
        resolve("0.0.0.0", flag=KEY, file=keyfile, environ={})
    for bad in ("", "two words\n", "\n\n"):
        keyfile.write_text(bad)
        with pytest.raises(UserError, match="the key alone, on one line") as e:
            resolve("0.0.0.0", file=keyfile, environ={})
        assert "two" not in str(e.value)
    with pytest.raises(UserError, match="cannot read it"):
        resolve("0.0.0.0", file=tmp_path / "missing", environ={})


def test_a_generated_key_is_0600_reused_and_never_shown(tmp_path):
    folder = tmp_path / "state" / "hybrid-build"
    old = os.umask(0)  # the file's mode must not depend on the umask
    try:
        first = resolve("0.0.0.0", environ={}, folder=folder)
    finally:
        os.umask(old)
    path = folder / KEY_FILE
    assert first.created and first.path == path and path.read_text() == first.value + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first.value) >= 40 and first.value.startswith("hbk_")
    assert sorted(p.name for p in folder.iterdir()) == [KEY_FILE]  # no temporary file left
    again = resolve("192.168.1.5", environ={}, folder=folder)
    assert again.value == first.value and not again.created  # clients set up once keep working
    for text in (repr(first), first.describe(), first.client_hint(), first.shell_line(), json.dumps(first.to_json())):
        assert first.value not in text
    assert str(path) in first.describe() and first.shell_line() == f'export VLLM_API_KEY="$(cat {path})"'
    path.chmod(0o644)
    with pytest.raises(UserError, match="can be read or written by others .*chmod 600") as e:
        resolve("0.0.0.0", environ={}, folder=folder)
    assert first.value not in str(e.value)


def test_a_dry_run_generates_nothing(tmp_path):
    key = resolve("0.0.0.0", environ={}, folder=tmp_path / "k", create=False)
    assert key.pending and key.value == "" and not (tmp_path / "k").exists()
    assert "generated when serving starts" in key.describe()


# ----------------------------------------------------------------------------- the plans


@pytest.mark.parametrize("engine", ["local", "docker"])
def test_the_key_is_in_no_argv_and_no_shown_environment(artifact, engine):
    key = ApiKey(KEY, "--api-key")
    plan = plan_launch(str(artifact), "dense", engine=engine, host="0.0.0.0", recipe="qwen3.5-122b-a10b", api_key=key)
    shown = json.dumps(plan.to_json()) + plan.shell() + repr(plan)
    assert KEY not in shown and "VLLM_API_KEY" not in plan.env
    assert plan.secret_env == {"VLLM_API_KEY": KEY}
    assert plan.to_json()["api_key"] == {"env": "VLLM_API_KEY", "origin": "--api-key", "file": None, "pending": False}
    if engine == "docker":
        i = plan.argv.index("VLLM_API_KEY")  # the name alone: docker takes the value from its environment
        assert plan.argv[i - 1] == "-e" and plan.argv[plan.argv.index("-p") + 1] == "8000:8000"
    assert plan.base_url == "http://127.0.0.1:8000/v1"


def test_dry_run_shows_where_the_key_is_and_its_line_works_as_printed(artifact, tmp_path, capsys):
    base = ["serve", str(artifact), "--profile", "dense", "--recipe", "qwen3.5-122b-a10b", "--dry-run"]
    state = tmp_path / "state" / "hybrid-build"
    assert main(base) == 0  # loopback: as before
    assert "VLLM_API_KEY" not in capsys.readouterr().out
    assert main(base + ["--host", "0.0.0.0"]) == 0
    out = capsys.readouterr().out
    line = f'export VLLM_API_KEY="$(cat {state / KEY_FILE})"'
    assert line in out.splitlines() and "(generated now;" in out
    # pasted into a shell, the line gives vLLM the key serving would use: the file is there, 0600
    shown = subprocess.run(["sh", "-c", f'{line} && printf %s "$VLLM_API_KEY"'], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == (state / KEY_FILE).read_text().strip() and shown.stdout
    assert stat.S_IMODE((state / KEY_FILE).stat().st_mode) == 0o600
    assert main(base + ["--host", "0.0.0.0"]) == 0  # the next run (dry or not) reuses it
    assert "(generated earlier, reused;" in capsys.readouterr().out
    keyfile = tmp_path / "mine.key"
    keyfile.write_text(KEY)
    keyfile.chmod(0o600)
    for extra in (["--api-key", KEY], ["--api-key-file", str(keyfile)], ["--engine", "docker", "--api-key", KEY]):
        assert main(base + ["--host", "0.0.0.0", *extra]) == 0
        out = capsys.readouterr().out
        assert KEY not in out and "VLLM_API_KEY" in out
    assert main(base + ["--host", "0.0.0.0", "--api-key-file", str(keyfile), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["api_key"]["file"] == str(keyfile.resolve()) and KEY not in json.dumps(data)


# ----------------------------------------------------------------------------- the launcher


def _plan(port: int, key: str | None, *extra: str) -> LaunchPlan:
    return LaunchPlan([sys.executable, str(STANDIN), "--port", str(port), *extra], {}, "qwen", port, "127.0.0.1",
                      "base", "local", "stand-in", api_key=ApiKey(key, "--api-key") if key else None)


@pytest.fixture
def keyed(standin):
    """``keyed(*flags, model=...)``: a stand-in server wanting KEY (in its environment, as serve gives
    vLLM its key), ready once it answers the key. Its base URL."""
    return lambda *extra, model="qwen": standin(*extra, key=KEY, model=model)


def _status(url: str, key: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10):
            return 200
    except urllib.error.HTTPError as e:
        assert e.code != 401 or json.loads(e.read()) == {"error": "Unauthorized"}  # vLLM's body
        return e.code


def test_the_standin_wants_the_key_as_vllm_does(keyed):
    assert authorized("/v1/models", None, None) and authorized("/metrics", None, KEY)
    assert authorized("/v1/models", f"bearer {KEY}", KEY) and not authorized("/v1/models", f"Basic {KEY}", KEY)
    url = keyed()
    assert _status(url + "/models", None) == _status(url + "/models", WRONG) == 401
    assert _status(url + "/models", KEY) == 200
    assert _status(url[:-3] + "/metrics", None) == 200  # outside /v1: open, as vLLM's
    assert "Paris" in smoke_test(url, "qwen", api_key=KEY)
    for key, words in ((None, "wants an API key and none was sent"), (WRONG, "refused the API key")):
        with pytest.raises(KeyRefused, match=f"the server at {url} {words} \\(HTTP 401\\)") as e:
            smoke_test(url, "qwen", api_key=key)
        assert KEY not in str(e.value) and WRONG not in str(e.value)


def test_a_server_that_refuses_serves_key_ends_the_wait_at_once(tmp_path):
    """Up, and answering 401 to the key serve gave it: no use waiting out the timeout."""
    port = free_port()
    log = tmp_path / "standin.log"
    with open(log, "wb") as out:  # the server has another key than the plan says
        proc = subprocess.Popen(_plan(port, KEY).argv, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, VLLM_API_KEY=WRONG))
    from hybrid_build.serve.launch.launcher import Server

    server = Server(proc, _plan(port, KEY), log)
    try:
        with pytest.raises(KeyRefused, match="refused the API key \\(HTTP 401\\): serve sends the key") as e:
            wait_ready(server, timeout=600, poll=0.05)
        assert KEY not in str(e.value) and proc.poll() is not None  # stopped
    finally:
        server.stop()


def test_the_docker_engine_gets_the_value_in_its_environment_only(artifact, tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "docker.json"
    (bindir / "docker").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                   f"json.dump({{'argv': sys.argv, 'key': os.environ.get('VLLM_API_KEY')}}, "
                                   f"open({str(record)!r}, 'w'))\n")
    (bindir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    plan = plan_launch(str(artifact), "dense", engine="docker", host="0.0.0.0", recipe="qwen3.5-122b-a10b",
                       api_key=ApiKey(KEY, "--api-key"))
    server = start(plan, tmp_path / "docker.log")
    assert server.process.wait(timeout=60) == 0
    got = json.loads(record.read_text())
    assert got["key"] == KEY and "VLLM_API_KEY" in got["argv"] and not any(KEY in a for a in got["argv"])


# ----------------------------------------------------------------------------- verify and eval


def _one_error(capsys, argv: list[str]) -> tuple[int, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1, captured.err
    for key in (KEY, WRONG):
        assert key not in captured.out + captured.err
    return rc, lines[0]


@pytest.mark.slow
def test_verify_sends_the_key_and_a_refused_one_is_one_line(keyed, referenced_artifact, capsys, monkeypatch):
    url = keyed("--reference", str(referenced_artifact), "--logprob-noise", "0.01")
    argv = ["verify", url, "--artifact", str(referenced_artifact), "--model", "qwen"]
    rc, line = _one_error(capsys, argv)
    assert rc == 2 and line == (f"error: the server at {url} wants an API key and none was sent (HTTP 401): give "
                                "--api-key or OPENAI_API_KEY")
    rc, line = _one_error(capsys, argv + ["--api-key", WRONG])
    assert rc == 2 and line == (f"error: the server at {url} refused the API key (HTTP 401): give --api-key or "
                                "OPENAI_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", WRONG)
    assert _one_error(capsys, argv)[0] == 2
    assert main(argv + ["--api-key", KEY, "-q"]) == 0  # the flag wins over the environment
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert main(argv + ["--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["outcome"] == "passed" and KEY not in captured.out + captured.err


@pytest.mark.slow
def test_eval_sends_the_key_to_lm_eval_through_its_environment(keyed, capsys, monkeypatch, tmp_path):
    """lm-eval's chat model, against two stand-ins wanting the key: it reads OPENAI_API_KEY at every
    request, so a run that completes proves the key reached it; the report never holds the key."""
    source, hybrid = keyed("--answer", " 7", model="source"), keyed("--answer", " 12", model="hybrid")
    report = tmp_path / "eval.json"
    argv = ["eval", "--source-url", source, "--hybrid-url", hybrid, "--backend", "chat", "--tasks", "hb_arith_gen",
            "--limit", "2", "--concurrency", "1", "--out", str(report), "-q"]
    rc, line = _one_error(capsys, argv)
    assert rc == 2 and line.startswith(f"error: the server at {source} wants an API key and none was sent (HTTP 401)")
    rc, line = _one_error(capsys, argv + ["--api-key", WRONG])
    assert rc == 2 and line.endswith("refused the API key (HTTP 401): give --api-key or OPENAI_API_KEY")
    assert not report.exists()
    assert main(argv + ["--api-key", KEY]) == 0
    assert "OPENAI_API_KEY" not in os.environ  # given for the run only
    data = json.loads(report.read_text())
    assert data["tasks"][0]["n"] == 2
    assert KEY not in report.read_text() + report.with_suffix(".md").read_text()
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert main(argv) == 0 and os.environ["OPENAI_API_KEY"] == KEY


# ----------------------------------------------------------------------------- serve, end to end


@pytest.mark.slow
def test_serve_beyond_loopback_generates_a_key_and_uses_it(referenced_artifact, serve_env, tmp_path):
    """serve --host 0.0.0.0 without a key: one is generated (0600, its path printed, never the key);
    vLLM (the stand-in) gets it in its environment and not in its argv, and serve's own readiness
    probe, verify and smoke test send it (the stand-in refuses anything else)."""
    c = serve_env
    record = tmp_path / "vllm-call.json"
    state = tmp_path / "xdg-state"
    env = {k: v for k, v in c["env"].items() if k not in ("OPENAI_API_KEY", "VLLM_API_KEY")}
    env.update(XDG_STATE_HOME=str(state), HB_STANDIN_RECORD=str(record), HB_STANDIN_FLAGS="--logprob-noise 0.01")
    run = CliRun(["serve", str(referenced_artifact), "--profile", "dense", "--host", "0.0.0.0",
                  "--port", str(c["port"]), "--ready-timeout", "120", "--log", str(c["cwd"] / "serve.log")],
                 env, c["cwd"])
    keyfile = state / "hybrid-build" / KEY_FILE
    try:
        line = run.wait_for("API key: ", 120)
        assert line.startswith(f"API key: {keyfile} (generated now; readable by its owner only)")
        assert run.wait_for("verify ", 120).startswith("verify passed")
        run.wait_for("READY", 60)
        key = keyfile.read_text().strip()
        assert stat.S_IMODE(keyfile.stat().st_mode) == 0o600
        called = json.loads(record.read_text())
        assert called["VLLM_API_KEY"] == key and not any(key in a for a in called["argv"])
        assert "--api-key" not in called["argv"]
        url = f"http://127.0.0.1:{c['port']}/v1/models"
        assert _status(url, None) == 401 and _status(url, key) == 200
    finally:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
        rc = run.proc.wait(timeout=60)
    assert rc == 130
    shown = run.output()
    assert key not in shown and key not in (c["cwd"] / "serve.log").read_text()
