"""Secrets never leak: a recognisable fake secret is planted in every place a user could
give one (the Hub token in ``HF_TOKEN`` and in the token file; a client's API key in
``OPENAI_API_KEY`` and ``--api-key``; the served API's key in ``VLLM_API_KEY``, ``--api-key`` and
``--api-key-file``; the Ray token in ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names and the
file ``--ray-token-file`` names)
and every output is searched for it, and for its first 8 characters (a partial print): stdout and
stderr with ``-vv``, ``--json`` and ``--dry-run``, every file written (the output folder with its
``.hybrid-build`` work folder, provenance, model card and reports; the serve log; bench's result;
the folder the commands ran in).

Commands: the demo build (``hybrid-build run -o OUT`` on the embedded tiny default, once for the
module), ``validate``, ``publish --dry-run``, ``serve --dry-run`` (local, docker, ``--nodes``),
``serve`` itself (vLLM is the stand-in on PATH), and ``verify`` and ``bench`` against that server.
The last test shows that the search can fail: a canary planted in a searched file is found.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_cli import CliRun

from hybrid_build.pipeline.cli import main

HF_ENV = "hf_LEAKCANARYhubenv0123456789abcdefgh"
HF_FILE = "hf_LEAKCANARYhubfile0123456789abcdef"
CLIENT_ENV = "sk-LEAKCANARYclientenv0123456789ab"
CLIENT_FLAG = "sk-LEAKCANARYclientflag0123456789a"
SERVE_ENV = "hbk_LEAKCANARYserveenv0123456789ab"
SERVE_FLAG = "hbk_LEAKCANARYserveflag0123456789a"
SERVE_FILE = "hbk_LEAKCANARYservefile0123456789a"
RAY_ENV = "LEAKCANARYrayenv0123456789abcdefgh"
RAY_FILE = "LEAKCANARYrayfile0123456789abcdefg"
RAY_OPTION = "LEAKCANARYrayoption0123456789abcde"
CANARIES = (HF_ENV, HF_FILE, CLIENT_ENV, CLIENT_FLAG, SERVE_ENV, SERVE_FLAG, SERVE_FILE, RAY_ENV, RAY_FILE, RAY_OPTION)
NEEDLES = sorted(set(CANARIES) | {c[:8] for c in CANARIES})  # the whole secret, and a partial print
CLI = [sys.executable, "-c", "import sys; from hybrid_build.pipeline.cli import main; sys.exit(main())"]

pytestmark = pytest.mark.slow


def found(data: str | bytes) -> list[str]:
    """The needles in ``data``."""
    raw = data.encode("utf-8", "replace") if isinstance(data, str) else data
    return [n for n in NEEDLES if n.encode() in raw]


def leaks_in_tree(root: Path) -> dict[str, list[str]]:
    """Every file under ``root`` (binary ones too) that holds a needle: path -> needles."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            hits = found(path.read_bytes())
            if hits:
                out[str(path.relative_to(root))] = hits
    return out


def assert_clean(label: str, data: str | bytes) -> None:
    hits = found(data)
    assert not hits, f"{label} shows {hits}"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """The secrets' own files (never searched) and the environment that carries the rest."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    hf_home = secrets_dir / "hf_home"
    hf_home.mkdir()
    (hf_home / "token").write_text(HF_FILE)
    files = {"hf": hf_home / "token", "serve": secrets_dir / "serve.key", "ray": secrets_dir / "ray.token",
             "ray_option": secrets_dir / "ray-option.token"}
    files["serve"].write_text(SERVE_FILE + "\n")
    files["ray"].write_text(RAY_FILE + "\n")
    files["ray_option"].write_text(RAY_OPTION + "\n")
    for f in files.values():
        f.chmod(0o600)
    env = {"HF_TOKEN": HF_ENV, "OPENAI_API_KEY": CLIENT_ENV, "VLLM_API_KEY": SERVE_ENV, "RAY_AUTH_TOKEN": RAY_ENV}
    return {"dir": secrets_dir, "hf_home": hf_home, "files": files, "env": env,
            "state": secrets_dir / "state"}  # where a generated served key would go


@pytest.fixture(scope="module")
def demo(planted, tmp_path_factory) -> dict:
    """The demo build and a ``validate`` of it, each a process of its own with every secret in its
    environment (the Hub token in HF_TOKEN for the build, in the token file alone for validate)."""
    work = tmp_path_factory.mktemp("work")
    out = work / "demo-out"
    env = dict(os.environ, **planted["env"], HF_HOME=str(planted["hf_home"]), HF_HUB_OFFLINE="1",
               XDG_STATE_HOME=str(planted["state"]), PYTHONUNBUFFERED="1")
    outputs = {}
    for label, argv, extra in (("run -o OUT -vv", ["run", "-o", str(out), "-vv"], {}),
                               ("validate OUT -vv --json", ["validate", str(out), "-vv", "--json"], {"HF_TOKEN": ""})):
        r = subprocess.run(CLI + argv, cwd=work, env=dict(env, **extra), capture_output=True, timeout=1200)
        assert r.returncode == 0, f"{label} exited {r.returncode}: {r.stderr.decode(errors='replace')[-2000:]}"
        outputs[label] = r.stdout + r.stderr
    return {"work": work, "out": out, "outputs": outputs}


@pytest.fixture
def secrets_env(planted, monkeypatch):
    """This process's environment with every secret in it, for commands run in process."""
    for k, v in planted["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("XDG_STATE_HOME", str(planted["state"]))
    return planted


def test_the_demo_build_and_validate_leak_nothing(demo):
    for label, data in demo["outputs"].items():
        assert_clean(label, data)
    assert b"DEBUG hybrid_build" in demo["outputs"]["run -o OUT -vv"]  # -vv was on: its lines were searched
    out = demo["out"]
    assert (out / ".hybrid-build" / "demo-source").is_dir() and (out / "hybrid_build" / "card.md").is_file()
    assert leaks_in_tree(demo["work"]) == {}


def test_publish_dry_run_leaks_nothing(demo, secrets_env, capfd, monkeypatch):
    from huggingface_hub import constants

    base = ["publish", str(demo["out"]), "--repo-id", "me/tiny-hybrid", "--dry-run", "-vv"]
    assert main(base) == 0
    assert_clean("publish --dry-run (HF_TOKEN)", "".join(capfd.readouterr()))
    monkeypatch.delenv("HF_TOKEN")  # the token in the file `hf auth login` writes
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(secrets_env["files"]["hf"]))
    assert main(base + ["--json"]) == 0
    captured = capfd.readouterr()
    assert json.loads(captured.out)["dry_run"] is True
    assert_clean("publish --dry-run --json (token file)", captured.out + captured.err)
    assert leaks_in_tree(demo["work"]) == {}


def test_serve_dry_runs_leak_nothing(demo, secrets_env, capfd, monkeypatch):
    """Local and docker engine, text and JSON, the served key from the environment, the flag and the
    file; several nodes (the head here, and elsewhere: its vLLM then listens beyond loopback) with the
    Ray token from its variable, the file its variable names and the file --ray-token-file names."""
    base = ["serve", str(demo["out"]), "--profile", "dense", "--host", "0.0.0.0", "--dry-run", "-vv"]
    keyfile = str(secrets_env["files"]["serve"])
    runs = 0
    for engine in ("local", "docker"):
        for key in ([], ["--api-key", SERVE_FLAG], ["--api-key-file", keyfile]):
            for fmt in ([], ["--json"]):
                argv = base + ["--engine", engine, *key, *fmt]
                assert main(argv) == 0, argv
                captured = capfd.readouterr()
                assert "VLLM_API_KEY" in captured.out  # the key is in the plan, by name
                assert_clean(" ".join("KEY" if a in CANARIES else a for a in argv[2:]), captured.out + captured.err)
                runs += 1
    base = ["serve", str(demo["out"]), "--profile", "dense", "--ifname", "lo", "--dry-run", "-vv"]
    heads = {"head here": base + ["--nodes", "127.0.0.2,198.51.100.12"],
             "head elsewhere": base + ["--nodes", "me@198.51.100.12,127.0.0.2"]}
    for where, nodes in heads.items():
        for fmt in ([], ["--json"]):
            assert main(nodes + fmt) == 0  # RAY_AUTH_TOKEN and VLLM_API_KEY in the environment
            captured = capfd.readouterr()
            assert "RAY_AUTH" in captured.out and "VLLM_API_KEY" in captured.out
            assert_clean(f"serve --nodes --dry-run, {where} (RAY_AUTH_TOKEN)", captured.out + captured.err)
            runs += 1
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(secrets_env["files"]["ray"]))
    option = ["--ray-token-file", str(secrets_env["files"]["ray_option"])]
    for where, nodes in heads.items():
        for token, key in (([], ["--api-key-file", keyfile]), (option, ["--api-key", SERVE_FLAG]), (option, [])):
            for fmt in ([], ["--json"]):
                assert main(nodes + token + key + fmt) == 0
                captured = capfd.readouterr()
                # the file was the token's source: the option's, else the variable's
                assert str(secrets_env["files"]["ray_option" if token else "ray"]) in captured.out
                source = "--ray-token-file" if token else "RAY_AUTH_TOKEN_PATH"
                assert_clean(f"serve --nodes --dry-run, {where} ({source})", captured.out + captured.err)
                runs += 1
    assert runs == 28 and not secrets_env["state"].exists()  # a key was always given: none generated
    assert leaks_in_tree(demo["work"]) == {}


def test_serve_verify_and_bench_leak_nothing(demo, secrets_env, serve_env, capfd, monkeypatch, tmp_path):
    """serve (the stand-in vLLM) beyond loopback with the key in a file, verify and bench against it
    with the right key (from the environment and the flag) and a wrong one (a client key)."""
    c = serve_env
    env = dict(c["env"], **secrets_env["env"], HF_HOME=str(secrets_env["hf_home"]),
               XDG_STATE_HOME=str(secrets_env["state"]))
    serve_log = c["cwd"] / "serve.log"
    run = CliRun(["serve", str(demo["out"]), "--profile", "dense", "--host", "0.0.0.0", "--port", str(c["port"]),
                  "--api-key-file", str(secrets_env["files"]["serve"]), "--ready-timeout", "120", "--log",
                  str(serve_log), "-vv"], env, c["cwd"])
    bench_out = tmp_path / "bench.json"
    try:
        assert run.wait_for("verify ", 120).startswith("verify passed")  # serve's own check sent the key
        run.wait_for("READY", 60)
        url = f"http://127.0.0.1:{c['port']}/v1"
        verify = ["verify", url, "--artifact", str(demo["out"]), "-vv"]
        monkeypatch.setenv("OPENAI_API_KEY", SERVE_FILE)  # the right key, from the environment
        assert main(verify) == 0
        assert main(verify + ["--json"]) == 0
        assert main(["bench", url, "--runs", "1", "--max-tokens", "8", "--workloads", "prose", "-vv", "--out",
                     str(bench_out)]) == 0
        monkeypatch.setenv("OPENAI_API_KEY", CLIENT_ENV)  # a wrong one in the environment, the right one given
        assert main(verify + ["--api-key", SERVE_FILE, "--json"]) == 0
        assert main(["bench", url, "--runs", "1", "--max-tokens", "8", "--workloads", "prose", "--json",
                     "--api-key", SERVE_FILE]) == 0
        assert main(verify) == 2  # refused: one line, and not the key
        assert main(verify + ["--api-key", CLIENT_FLAG]) == 2
        assert main(["bench", url, "--runs", "1", "--max-tokens", "8", "--workloads", "prose", "-vv",
                     "--api-key", CLIENT_FLAG]) == 2
        captured = capfd.readouterr()
        errors = [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 3 and all("refused the API key (HTTP 401)" in ln for ln in errors), errors
        assert_clean("verify and bench", captured.out + captured.err)
    finally:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
        rc = run.proc.wait(timeout=60)
    assert rc == 130
    assert_clean("serve -vv", run.output())
    assert serve_log.read_text().strip() and bench_out.is_file()
    assert leaks_in_tree(c["cwd"]) == {}  # the serve log, bench's result, the stand-in's record
    assert leaks_in_tree(demo["work"]) == {}


def test_the_search_finds_a_planted_canary(demo, capfd):
    """The searches above can fail: a canary in a searched folder's work files, or its first 8
    characters alone in an output, is found."""
    planted = demo["out"] / ".hybrid-build" / "planted.txt"
    planted.write_text(f"token={SERVE_FILE}\n")
    try:
        hits = leaks_in_tree(demo["work"])
        assert list(hits) == ["demo-out/.hybrid-build/planted.txt"]
        assert {SERVE_FILE, SERVE_FILE[:8]} <= set(hits["demo-out/.hybrid-build/planted.txt"])
    finally:
        planted.unlink()
    assert leaks_in_tree(demo["work"]) == {}
    print(f"partial: {HF_FILE[:8]}...")
    with pytest.raises(AssertionError, match="hf_LEAKC"):
        assert_clean("a print", capfd.readouterr().out)
