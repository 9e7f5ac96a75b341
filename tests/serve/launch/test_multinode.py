"""Serving across several nodes (serve/launch/multinode.py) and its speed model (serve/speed/multinode_plan.py).

The bring-up runs for real here: a Ray head and a worker node on loopback addresses of this
machine (127.0.0.2 and 127.0.0.3, their own ports and temp folders), a stand-in for ``vllm``
(answers ``--version``; for ``serve`` it asks Ray which nodes joined, records what it was given,
then runs the OpenAI stand-in server, which wants the API key it was given), the check, the smoke
test, and Ctrl-C, after which no process of the cluster may be left. While it runs, processes
without the cluster's Ray token try to join it and to run a job on it, and are refused (the job's
task never runs); the token is in no process's command line or environment, the API key only in
vLLM's environment, and the token's files are gone after the teardown. A head over a stand-in
``ssh`` gets the key on stdin into a file of its own. Golden files hold the exact dry-run plan of
the local and docker engines (``HYBRID_BUILD_UPDATE_GOLDEN=1`` rewrites them).
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serve_cli import CliRun, _processes_mentioning, free_port

from hybrid_build.core.errors import ArtifactError, ExternalToolError, UserError
from hybrid_build.pipeline.cli import main
from hybrid_build.serve.launch import multinode as mn
from hybrid_build.serve.launch import ray_auth
from hybrid_build.serve.launch.engine import plan_launch
from hybrid_build.serve.launch.launcher import plan_key
from hybrid_build.serve.launch.served_key import ApiKey
from hybrid_build.serve.speed import bandwidth as bw
from hybrid_build.serve.speed import multinode_plan as mnp

HERE = Path(__file__).resolve().parents[1]
GOLDEN = HERE / "golden"
STANDIN = HERE / "standin_server.py"
NODES = "127.0.0.2,127.0.0.3"


RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A home of the test's own (this machine's token files go under ~/.cache/hybrid-build, and Ray
    looks for ~/.ray/auth_token there) and no Ray token from the environment running the tests."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for k in RAY_AUTH_VARS:
        monkeypatch.delenv(k, raising=False)
    return home


# ----------------------------------------------------------------------------- hosts


def test_parse_nodes_from_the_option_and_a_file(tmp_path):
    assert mn.parse_nodes("a, user@b ,", None) == ["a", "user@b"]
    f = tmp_path / "hosts"
    f.write_text("# the two Sparks\nspark1   # head\n\nuser@spark2\n")
    assert mn.parse_nodes(None, f) == ["spark1", "user@spark2"]
    for bad, match in (("a", "two hosts or more"), ("a,a", "named twice"), ("a,-oProxyCommand=x", "not a host"),
                       ("a,b c", "not a host")):
        with pytest.raises(UserError, match=match):
            mn.parse_nodes(bad, None)
    with pytest.raises(UserError, match="not both"):
        mn.parse_nodes("a,b", f)
    with pytest.raises(UserError, match="missing: no such file"):
        mn.parse_nodes(None, tmp_path / "missing")
    os.mkfifo(tmp_path / "fifo")  # refused before it is opened: reading it would wait for a writer
    with pytest.raises(UserError, match="fifo: a FIFO, not a regular file"):
        mn.parse_nodes(None, tmp_path / "fifo")


def test_local_nodes_are_the_addresses_this_machine_can_bind():
    assert mn.is_local_address("127.0.0.2")
    assert not mn.is_local_address("198.51.100.7")  # TEST-NET-2: never this machine's
    nodes = mn.resolve_nodes(["127.0.0.2", "me@198.51.100.7"])
    assert [(n.ip, n.local, n.role) for n in nodes] == [("127.0.0.2", True, "head"), ("198.51.100.7", False, "worker")]
    with pytest.raises(UserError, match="two nodes resolve to 127.0.0.2"):
        mn.resolve_nodes(["127.0.0.2", "x@127.0.0.2"])


def test_a_dry_run_plans_names_that_do_not_resolve_here(artifact, capsys):
    """README's `--nodes spark1,spark2` shape: a dry run shows the plan with the names (said in a
    note); serving refuses a name that does not resolve. ``.invalid`` never resolves (RFC 6761)."""
    names = "spark1.invalid,me@spark2.invalid"
    argv = ["serve", str(artifact), "--profile", "dense", "--recipe", "qwen3.5-122b-a10b", "--nodes", names,
            "--ifname", "IFACE"]
    assert main(argv + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ray start --block --head --port 6379" in out and "--node-ip-address spark1.invalid" in out
    assert "# spark1.invalid, me@spark2.invalid: not resolved on this machine" in out
    assert main(argv + ["--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [n["ip"] for n in data["nodes"]] == ["spark1.invalid", "spark2.invalid"]
    assert main(argv) == 2  # serving resolves them
    assert "spark1.invalid: cannot resolve 'spark1.invalid'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- plans


def _plan(artifact: Path, engine: str = "local", **kw) -> mn.MultiNodePlan:
    serve = plan_launch(str(artifact), "dense", recipe="qwen3.5-122b-a10b")
    image = "ghcr.io/aeon-7/aeon-vllm-ultimate:2026-06-18-v0.23.0-dflashfix" if engine == "docker" else None
    args = dict(ifname="enp1s0f1np1", ib_hca="rocep1s0f1,roceP2p1s0f1") | kw
    return mn.plan_multinode(serve, ["127.0.0.2", "user@198.51.100.12"], str(artifact), image=image, **args)


def _render(plan: mn.MultiNodePlan, art: Path) -> str:
    from hybrid_build.serve.launch.engine import runtime_dir

    text = json.dumps(plan.to_json(), indent=1, sort_keys=True)
    return (text.replace(str(runtime_dir()), "<RUNTIME>")
                .replace(str(art.resolve()), "<ARTIFACT>").replace(str(Path.home()), "<HOME>")) + "\n"


@pytest.mark.parametrize("engine", ["local", "docker"])
def test_golden_dry_run(engine, artifact):
    got = _render(_plan(artifact, engine), artifact)
    path = GOLDEN / f"multinode-dense-{engine}.json"
    if os.environ.get("HYBRID_BUILD_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text()


def test_plan_commands(artifact):
    plan = _plan(artifact)
    head, worker = plan.ray
    assert head.argv[:4] == ["ray", "start", "--block", "--head"] and head.node.local
    assert worker.argv[worker.argv.index("--address") + 1] == "127.0.0.2:6379"
    assert worker.env["VLLM_HOST_IP"] == "198.51.100.12" and head.env["VLLM_HOST_IP"] == "127.0.0.2"
    for c in plan.ray:
        assert c.env["NCCL_SOCKET_IFNAME"] == c.env["GLOO_SOCKET_IFNAME"] == "enp1s0f1np1"
        assert c.env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1" and c.env["VLLM_PLUGINS"] == "hybrid_build"
    remote = worker.local_argv(plan.remote_venv)
    assert remote[:5] == ["ssh", "-o", "BatchMode=yes", "-tt", "user@198.51.100.12"]
    assert remote[5].startswith("exec env GLOO_SOCKET_IFNAME=enp1s0f1np1 ")
    v = plan.vllm.argv
    assert v[:2] == ["vllm", "serve"] and v[-6:] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
                                                     "--distributed-executor-backend", "ray"]
    assert plan.vllm.env["RAY_ADDRESS"] == "127.0.0.2:6379"
    pp = _plan(artifact, parallel="pp", gpus_per_node=2, remote_venv="/opt/hb")
    assert (pp.tp, pp.pp) == (2, 2)
    assert pp.ray[1].local_argv(pp.remote_venv)[-1].startswith("PATH=/opt/hb/bin:\"$PATH\" exec env ")
    with pytest.raises(UserError, match="--ifname"):
        _plan(artifact, ifname=None)
    two_gpus = _plan(artifact, node_env={None: {"NCCL_P2P_DISABLE": "1"}, 1: {"CUDA_VISIBLE_DEVICES": "0"},
                                         2: {"CUDA_VISIBLE_DEVICES": "1"}})
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in two_gpus.ray] == ["0", "1"]
    assert all(c.env["NCCL_P2P_DISABLE"] == "1" for c in two_gpus.ray + [two_gpus.vllm])
    with pytest.raises(UserError, match="names node 3, but there are 2 nodes"):
        _plan(artifact, node_env={3: {"X": "1"}})


def test_nodes_sharing_this_machine_turn_vllms_custom_all_reduce_off(artifact):
    """Two Ray nodes on one machine (the 2-GPU emulation of two Sparks): vLLM would find their TP ranks
    in one node and set its custom all-reduce up over GPUs the nodes do not have; the plan turns it
    off, says so, and leaves it on where the nodes are separate machines or the TP group stays in one."""
    serve = plan_launch(str(artifact), "dense", recipe="qwen3.5-122b-a10b")
    both = mn.plan_multinode(serve, NODES.split(","), str(artifact), ifname="lo")
    assert both.vllm.argv.count("--disable-custom-all-reduce") == 1
    assert any("share this machine" in n for n in both.notes)
    assert "--disable-custom-all-reduce" not in _plan(artifact).vllm.argv  # one local, one over ssh
    pp = mn.plan_multinode(serve, NODES.split(","), str(artifact), ifname="lo", parallel="pp", gpus_per_node=2)
    assert "--disable-custom-all-reduce" not in pp.vllm.argv  # each TP group inside one node


def test_docker_plan_runs_ray_in_the_patched_image_on_every_node(artifact):
    plan = _plan(artifact, "docker")
    for i, c in enumerate(plan.ray):
        argv = c.argv
        assert argv[:5] == ["docker", "run", "--rm", "--name", f"hybrid-build-ray-{i + 1}"]
        assert ["--network", "host"] == argv[5:7] and "/dev/infiniband" in argv
        assert f"{artifact.resolve()}:/model:ro" in argv and "VLLM_PLUGINS=hybrid_build" not in " ".join(argv)
        assert argv[-1].startswith("python3 /opt/hybrid-build/runtime/patches/apply.py --site-packages")
        assert " && exec ray start --block " in argv[-1]
    assert plan.vllm.argv[:5] == ["docker", "exec", "-e", "RAY_ADDRESS=127.0.0.2:6379", "hybrid-build-ray-1"]
    assert plan.vllm.argv[5:8] == ["vllm", "serve", "/model"]
    # the head's container holds vLLM: it stops last; then the token files go
    assert [w for w, _ in plan.teardown()][1:-2] == [s.what for s in reversed(plan.stops)]


def test_dry_run_cli_text_and_json(artifact, capsys):
    base = ["serve", str(artifact), "--profile", "dense", "--recipe", "qwen3.5-122b-a10b", "--nodes",
            "127.0.0.2,198.51.100.12", "--ifname", "lo", "--dry-run"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 2 nodes, local engine: vLLM with TP=2 x PP=1 over Ray at 127.0.0.2:6379\n")
    assert "\nssh -o BatchMode=yes -tt 198.51.100.12 'exec env GLOO_SOCKET_IFNAME=lo " in out
    assert main(base + ["--json", "--parallel", "pp"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["tensor_parallel_size"], data["pipeline_parallel_size"]) == (1, 2)
    assert main(base[:-3] + ["--dry-run"]) == 2  # no --ifname
    assert "--ifname" in capsys.readouterr().err
    assert main(base + ["--node-env", "2:CUDA_VISIBLE_DEVICES=1", "--node-env", "NCCL_P2P_DISABLE=1"]) == 0
    out = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=1 GLOO_SOCKET_IFNAME=lo NCCL_P2P_DISABLE=1" in out
    assert main(base + ["--node-env", "2:not an assignment"]) == 2
    assert "[N:]KEY=VALUE" in capsys.readouterr().err


# ----------------------------------------------------------------------------- who gets in


def test_every_ray_process_runs_with_the_token_file_of_its_node(artifact, home):
    plan = _plan(artifact)
    head, worker = plan.ray
    mine = str(home / ".cache" / "hybrid-build" / "ray-token-6379-node1")
    assert plan.token_files == [mine, "~/.cache/hybrid-build/ray-token-6379-node2"]
    for c, path in ((head, mine), (worker, plan.token_files[1]), (plan.nodes_query, mine), (plan.vllm, mine)):
        assert (c.env["RAY_AUTH_MODE"], c.env["RAY_AUTH_TOKEN_PATH"]) == ("token", path)
    # the dashboard (and its job API) on the head's loopback; workers have none
    assert head.argv[head.argv.index("--dashboard-host") + 1] == "127.0.0.1" and "--dashboard-host" not in worker.argv
    # on the other node its shell expands the home: the path, never the token, is on the line
    line = worker.local_argv(plan.remote_venv)[-1]
    assert ' RAY_AUTH_TOKEN_PATH="$HOME"/.cache/hybrid-build/ray-token-6379-node2 ' in line
    files = plan.node_files()
    assert [(f.node, f.path, f.holds) for f in files] == [(n, plan.token_files[n.index], "the Ray token")
                                                          for n in plan.nodes]  # no key: none for vLLM either
    assert plan.file_write(files[1]).local_argv(None)[-1] == \
        'exec python3 -m hybrid_build.serve.launch.ray_auth write "$HOME"/.cache/hybrid-build/ray-token-6379-node2'
    assert [w for w, _ in plan.teardown()][-2:] == [plan.file_remove(f).what for f in files]
    docker = _plan(artifact, "docker", ray_port=7000)
    for c in docker.ray:
        assert "RAY_AUTH_MODE=token" in c.argv and f"RAY_AUTH_TOKEN_PATH={ray_auth.CONTAINER_TOKEN}" in c.argv
        assert f"{docker.token_files[c.node.index]}:{ray_auth.CONTAINER_TOKEN}:ro" in c.argv
    assert '-v "$HOME"/.cache/hybrid-build/ray-token-7000-node2:/run/hybrid-build/ray-token:ro ' in \
        docker.ray[1].local_argv(None)[-1]
    with pytest.raises(UserError, match="sets Ray's authentication itself"):
        _plan(artifact, node_env={None: {"RAY_AUTH_MODE": "disabled"}})


def test_the_token_is_never_shown_and_a_given_file_must_be_its_owners_alone(artifact, home, tmp_path, capsys,
                                                                            monkeypatch):
    base = ["serve", str(artifact), "--profile", "dense", "--recipe", "qwen3.5-122b-a10b", "--nodes",
            "127.0.0.2,198.51.100.12", "--ifname", "lo", "--dry-run"]
    assert main(base) == 0
    assert "# Ray token authentication: a token generated for this run" in capsys.readouterr().out
    assert not (home / ".cache").exists()  # a dry run writes no token
    token = "tok-" + "x7" * 20
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    assert main(base) == 0 and main(base + ["--json"]) == 0
    out = capsys.readouterr().out
    assert token not in out and "the token given by $RAY_AUTH_TOKEN" in out and '"origin": "$RAY_AUTH_TOKEN"' in out
    assert "RAY_AUTH_TOKEN" not in mn.child_env()  # the children get the file, not the variable
    monkeypatch.delenv("RAY_AUTH_TOKEN")

    f = tmp_path / "ray-token"
    f.write_text(token + "\n")
    f.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(f))
    assert main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`chmod 600 {f}`" in err and "mode 0644" in err
    f.chmod(0o600)
    assert main(base + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ray_auth"]["origin"] == "$RAY_AUTH_TOKEN_PATH" and data["ray_auth"]["file"] == str(f)
    assert token not in json.dumps(data)
    assert ray_auth.resolve_token().value() == token
    f.write_text("short\n")
    with pytest.raises(UserError, match="5 characters; use 16 or more"):
        ray_auth.resolve_token()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="cannot read it"):
        ray_auth.resolve_token()
    generated = ray_auth.resolve_token(environ={})
    a, b = generated.value(), generated.value()
    assert a != b and len(a) >= 40 and generated.origin == "generated"  # one per run


def test_a_node_file_is_written_owner_only_and_never_replaced(tmp_path):
    path = tmp_path / "cache" / "ray-token-1-node1"
    token = "t" * 43
    old = os.umask(0)  # whatever the umask, the file is 0600 and its new folder 0700
    try:
        ray_auth.write_node_file(path, token)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == token + "\n"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    with pytest.raises(UserError, match="exists: a `serve --nodes` on the same Ray port"):
        ray_auth.write_node_file(path, "u" * 43)
    assert path.read_text() == token + "\n"
    link = tmp_path / "cache" / "ray-token-1-node2"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="exists"):
        ray_auth.write_node_file(link, token)
    assert not (tmp_path / "elsewhere").exists()
    for bad in ("two words", ""):
        with pytest.raises(UserError, match="one word"):
            ray_auth.write_node_file(tmp_path / "x", bad)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))  # nothing, not even a temporary file


FAKE_SSH = """#!/bin/sh
# stand-in for ssh: records its arguments and its stdin, then runs the remote line here
printf '%s\\n' "$@" >> {record}
while [ "$#" -gt 1 ]; do shift; done
tee -a {stdin} | sh -c "$1"
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch) -> dict[str, Path]:
    """``ssh`` first on PATH: a stand-in that runs the remote line here (HOME being the test's),
    recording its arguments (``argv``) and its stdin (``stdin``); ``bin``: its folder."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record, stdin = tmp_path / "ssh-argv", tmp_path / "ssh-stdin"
    (bindir / "ssh").write_text(FAKE_SSH.format(record=record, stdin=stdin))
    (bindir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return {"argv": record, "stdin": stdin, "bin": bindir}


def test_another_node_gets_the_token_on_stdin_and_loses_it_at_teardown(artifact, home, fake_ssh, monkeypatch):
    """The node over ssh: the token reaches its file through stdin, never the command line; ``stop``
    removes the files, but not one that was there before this run."""
    record, stdin = fake_ssh["argv"], fake_ssh["stdin"]
    token = "given-" + "k" * 40
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    plan = _plan(artifact, ray_port=7001)
    cluster = mn.Cluster(plan)
    cluster.write_secrets()
    files = [Path(plan.token_files[0]), home / ".cache" / "hybrid-build" / "ray-token-7001-node2"]
    for f in files:
        assert f.read_text() == token + "\n" and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert token in stdin.read_text() and token not in record.read_text()
    assert "hybrid_build.serve.launch.ray_auth write" in record.read_text()
    cluster.stop()
    assert not any(f.exists() for f in files)
    assert 'exec rm -f "$HOME"/.cache/hybrid-build/ray-token-7001-node2' in record.read_text()

    files[1].write_text("another run's token " * 2)  # node 2's file is there already: refused, and kept
    cluster = mn.Cluster(plan)
    with pytest.raises(ExternalToolError, match="node 2 .*ray-token-7001-node2 exists"):
        cluster.write_secrets()
    cluster.stop()
    assert files[1].exists() and not files[0].exists()


def test_a_head_elsewhere_reads_the_served_key_from_its_file(artifact, home, fake_ssh, tmp_path):
    """A head over ssh, with an API key: the key reaches the head's file through ssh's stdin, the
    head's shell reads it into vLLM's environment (a stand-in `vllm` there records what it got), no
    command line holds it, and ``stop`` removes the file. A key file already there (another run's)
    fails the start, is kept, and the token files written before it are removed."""
    if (Path(sys.executable).parent / "vllm").exists():
        pytest.skip("a real vllm is installed beside this Python: it, not the stand-in, would run")
    called = tmp_path / "vllm-call.json"
    (fake_ssh["bin"] / "vllm").write_text(f"#!{sys.executable}\nimport json, os, sys\njson.dump({{'argv': sys.argv, "
                                          f"'key': os.environ.get('VLLM_API_KEY')}}, open({str(called)!r}, 'w'))\n")
    (fake_ssh["bin"] / "vllm").chmod(0o755)
    key = "sk-head-" + "q" * 30
    serve = plan_launch(str(artifact), "dense", recipe="qwen3.5-122b-a10b", api_key=ApiKey(key, "--api-key"))
    plan = mn.plan_multinode(serve, ["user@198.51.100.12", "127.0.0.2"], str(artifact), ifname="lo", ray_port=7002)
    assert plan.serve.host == "198.51.100.12" and plan_key(plan.serve) == key  # the URL plan keeps the key
    assert plan.key_file == "~/.cache/hybrid-build/api-key-7002-node1" and plan.vllm_env == {}
    assert plan.vllm.local_argv(None)[-1].startswith(
        'VLLM_API_KEY="$(cat "$HOME"/.cache/hybrid-build/api-key-7002-node1)" && export VLLM_API_KEY && exec env ')
    assert key not in json.dumps(plan.to_json()) + plan.render()

    cluster = mn.Cluster(plan)
    cluster.write_secrets()
    keyfile = home / ".cache" / "hybrid-build" / "api-key-7002-node1"
    assert keyfile.read_text() == key + "\n" and stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    assert len(_token_files(home)) == 2 and key in fake_ssh["stdin"].read_text()
    vllm = cluster.start(plan.vllm, tmp_path / "vllm.log")
    assert vllm.process.wait(timeout=60) == 0, (tmp_path / "vllm.log").read_text()
    got = json.loads(called.read_text())
    assert got["key"] == key and got["argv"][1:3] == ["serve", str(artifact.resolve())]
    assert not any(key in a for a in got["argv"]) and key not in fake_ssh["argv"].read_text()
    cluster.stop()
    assert not keyfile.exists() and _token_files(home) == []
    assert 'exec rm -f "$HOME"/.cache/hybrid-build/api-key-7002-node1' in fake_ssh["argv"].read_text()

    keyfile.write_text("another-runs-key\n")
    cluster = mn.Cluster(plan)
    with pytest.raises(ExternalToolError, match="node 1 .*api-key-7002-node1 exists"):
        cluster.write_secrets()
    cluster.stop()
    assert keyfile.read_text() == "another-runs-key\n" and _token_files(home) == []


def test_the_served_key_is_never_shown_and_goes_where_vllm_listens_beyond_loopback(artifact, home, tmp_path, capsys,
                                                                                    monkeypatch):
    """``--nodes`` resolves the key as one node does, for the address the head's vLLM listens on:
    none on a head here on loopback, one (generated, as a dry run does) on a head elsewhere; a given
    one is named by its origin or file in --dry-run and --json, never shown."""
    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    key = "sk-nodes-" + "z" * 30
    keyfile = tmp_path / "api.key"
    keyfile.write_text(key + "\n")
    keyfile.chmod(0o600)
    base = ["serve", str(artifact), "--profile", "dense", "--recipe", "qwen3.5-122b-a10b", "--ifname", "lo",
            "--dry-run"]
    here, elsewhere = base + ["--nodes", "127.0.0.2,198.51.100.12"], base + ["--nodes", "me@198.51.100.12,127.0.0.2"]
    assert main(here) == 0
    assert "# no API key: vLLM listens on loopback (127.0.0.1)\n" in capsys.readouterr().out
    assert main(elsewhere) == 0
    out = capsys.readouterr().out
    assert f"# API key: {state / 'hybrid-build' / 'serve-api-key'} (generated now;" in out
    assert "--host 198.51.100.12 " in out and (state / "hybrid-build" / "serve-api-key").is_file()
    assert main(elsewhere + ["--engine", "docker"]) == 0
    assert ('VLLM_API_KEY="$(cat "$HOME"/.cache/hybrid-build/api-key-6379-node1)" && export VLLM_API_KEY && exec '
            'docker exec -e RAY_ADDRESS=198.51.100.12:6379 -e VLLM_API_KEY hybrid-build-ray-1 vllm serve /model ') \
        in capsys.readouterr().out
    for nodes, head_file in ((here, None), (elsewhere, "~/.cache/hybrid-build/api-key-6379-node1")):
        for given, origin, file in ((["--api-key-file", str(keyfile)], "--api-key-file", str(keyfile.resolve())),
                                    (["--api-key", key, "--engine", "docker"], "--api-key", None)):
            assert main(nodes + given) == 0
            text = "".join(capsys.readouterr())
            assert main(nodes + given + ["--json"]) == 0
            out, err = capsys.readouterr()
            assert key not in text + out + err and "as VLLM_API_KEY in its environment" in text
            assert json.loads(out)["api_key"] == {"env": "VLLM_API_KEY", "origin": origin, "file": file,
                                                  "pending": False, "head_file": head_file}
    monkeypatch.setenv("VLLM_API_KEY", key)  # the caller's: a child gets it only where the plan says
    assert "VLLM_API_KEY" not in mn.child_env() and mn.child_env({"VLLM_API_KEY": key})["VLLM_API_KEY"] == key


def test_a_node_address_that_is_not_private_is_refused_without_force(artifact, capsys, monkeypatch):
    def nodes(*ips):
        return [mn.Node(ip if i == 0 else f"u@{ip}", ip, i == 0, i) for i, ip in enumerate(ips)]

    for ok in ("10.0.0.2", "192.168.100.12", "169.254.3.4", "fe80::1%eth0", "fd12::3", "127.0.0.3"):
        assert mn.check_private_link(nodes("127.0.0.2", ok)) is None, ok
    for public in ("8.8.8.8", "100.64.0.5", "2001:4860::8888"):
        with pytest.raises(UserError, match=f"node 2 is at {re.escape(public)}, not a private or link-local"):
            mn.check_private_link(nodes("127.0.0.2", public))
        assert "(--force: going on)" in mn.check_private_link(nodes("127.0.0.2", public), force=True)
    with pytest.raises(UserError, match="^node 1 is at 8.8.4.4 and node 3 is at 8.8.8.8, not private or link-local "
                                        "addresses: NCCL and Gloo"):
        mn.check_private_link(nodes("8.8.4.4", "10.0.0.3", "8.8.8.8"))
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **kw: [(socket.AF_INET, socket.SOCK_STREAM, 6, "",
                        ("100.64.0.5", 0))] if host == "spark2.example" else real(host, *a, **kw))
    base = ["serve", str(artifact), "--profile", "dense", "--recipe", "qwen3.5-122b-a10b", "--nodes",
            "127.0.0.2,me@spark2.example", "--ifname", "lo", "--dry-run"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "node 2 (me@spark2.example) is at 100.64.0.5" in err and "--force" in err
    assert "NCCL and Gloo traffic between the nodes is not authenticated" in err
    assert main(base + ["--force"]) == 0
    out, err = capsys.readouterr()
    assert "(--force: going on)" in out  # a note of the plan, and a warning
    assert err.startswith("WARNING ") and "node 2 (me@spark2.example) is at 100.64.0.5" in err


# ----------------------------------------------------------------------------- checks


def _answer(**kw) -> dict:
    a = {"hybrid_build": "0.1.0", "runtime": "r" * 64, "ray": "2.60.0", "vllm": "0.25.1",
         "artifact": {"fingerprint": "a" * 64, "problem": None}}
    return a | kw


def test_checks_name_the_node_that_differs():
    nodes = mn.resolve_nodes(["127.0.0.2", "u@198.51.100.12"])
    mn.compare_probes(nodes, [_answer(), _answer()], "local")
    cases = [
        (_answer(artifact={"fingerprint": "b" * 64, "problem": None}), ArtifactError, "another artifact"),
        (_answer(artifact={"fingerprint": "a" * 64, "problem": "model.safetensors is missing"}), ArtifactError,
         "node 2 .*model.safetensors is missing"),
        (_answer(vllm="0.33.0"), ExternalToolError, "another vLLM than the head: 0.33.0 vs 0.25.1"),
        (_answer(vllm=None), ExternalToolError, "no vllm on its PATH"),
        (_answer(runtime="s" * 64), ExternalToolError, "other hybrid-build runtime patches"),
        (_answer(ray="2.59.0"), ExternalToolError, "another Ray"),
    ]
    for second, err, match in cases:
        with pytest.raises(err, match=match):
            mn.compare_probes(nodes, [_answer(), second], "local")
    with pytest.raises(ExternalToolError, match="another image"):
        mn.compare_probes(nodes, [_answer(), _answer(vllm="sha256:other")], "docker")


def test_node_identity_is_the_provenance_and_the_bytes_here(tiny_artifact, tmp_path, monkeypatch):
    from hybrid_build.core import integrity

    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy, ignore=shutil.ignore_patterns(".hybrid-build"))
    # files written just now are not cached (core.integrity.RACY_NS): check as if an hour later
    monkeypatch.setattr(integrity, "now_ns", lambda: time.time_ns() + 3600 * 10**9)
    a, b = mn.node_identity(tiny_artifact), mn.node_identity(copy)
    assert a["fingerprint"] == b["fingerprint"] and a["problem"] is None and b["problem"] is None
    assert (copy / ".hybrid-build" / "artifact-sha256.json").is_file()  # hashed once, then cached
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, other bytes: the cache key (mtime, inode) changes too
    problem = mn.node_identity(copy)["problem"]
    assert problem.startswith(f"{shard.name} has other bytes than hybrid_build/provenance.json")
    assert mn.runtime_fingerprint() == mn.runtime_fingerprint() and len(mn.runtime_fingerprint()) == 64


# ----------------------------------------------------------------------------- the real cluster


FAKE_VLLM = '''#!{python}
"""Stand-in for `vllm`: `--version`, or `serve`: ask Ray which GPU nodes joined, record the call,
then serve the OpenAI stand-in (it exits 3 when Ray has fewer GPU nodes than TP x PP): it wants
$VLLM_API_KEY when set, and answers from the artifact's reference when there is one."""
import json, os, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("0.0.0-standin")
    sys.exit(0)
opt = lambda name: args[args.index(name) + 1]
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 1)
ray.shutdown()
want = int(opt("--tensor-parallel-size")) * int(opt("--pipeline-parallel-size"))
keys = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "VLLM_HOST_IP", "RAY_ADDRESS", "VLLM_PLUGINS", "RAY_AUTH_MODE",
        "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "VLLM_API_KEY")
with open({record!r}, "w") as f:
    json.dump({{"argv": args, "env": {{k: os.environ.get(k) for k in keys}}, "alive": alive, "pid": os.getpid()}}, f)
if len(alive) < want:
    sys.exit(f"stand-in vllm: {{len(alive)}} GPU nodes in Ray, TP x PP = {{want}}")
ref = ["--reference", args[1]] if os.path.exists(os.path.join(args[1], "hybrid_build", "reference.json")) else []
os.execv(sys.executable, [sys.executable, {standin!r}, "--port", opt("--port"), "--model", opt("--served-model-name"),
                          *ref])
'''


def _holding(data: bytes) -> list[str]:
    """Live processes whose command line or environment (those this user may read) holds ``data``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        for what in ("cmdline", "environ"):
            try:
                if data in (d / what).read_bytes():
                    found.append(f"{d.name} ({what}): {(d / 'cmdline').read_bytes()[:120]!r}")
            except OSError:
                continue
    return found


def _listening(proc: Path) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses the process ``proc`` (``/proc/PID``) has listening TCP sockets on."""
    inodes = set()
    for fd in (proc / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):  # local address as hex, each 32-bit word little-endian; state 0A: LISTEN
        for row in Path("/proc/net", table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:
                raw = bytes.fromhex(fields[1].split(":")[0])
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.append(getattr(ip, "ipv4_mapped", None) or ip)
    return found


def _files_holding(root: Path, data: bytes) -> list[str]:
    return [str(f) for f in root.rglob("*") if f.is_file() and not f.is_symlink() and data in f.read_bytes()]


def _token_files(home: Path) -> list[Path]:
    return sorted((home / ".cache" / "hybrid-build").glob("ray-token-*"))


# a job: a driver that connects to the cluster (as vLLM does) and runs a task there that writes the
# marker file argv[2]
DRIVER = """import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

@ray.remote
def mark(path):
    with open(path, "w") as f:
        f.write("ran")

ray.get(mark.remote(sys.argv[2]), timeout=120)
print("CONNECTED", sum(n["Alive"] for n in ray.nodes()))
"""
REFUSED = re.compile(r"InvalidAuthToken|Authentication token is missing or incorrect")


def _outsiders(c: dict, token_file: Path) -> dict[str, tuple[subprocess.Popen, Path | None]]:
    """Processes that try the cluster at once, with the marker file each one's job would write: a
    node joining and a job without the token, a job with a wrong one, and (the control) one with the
    cluster's token file. Each has an empty home (no ~/.ray/auth_token) and gives up after ~3 s of
    refused connections."""
    home = c["cwd"] / "outsider-home"
    home.mkdir(exist_ok=True)
    wrong = home / "wrong-token"
    wrong.write_text("w" * 43)
    wrong.chmod(0o600)
    env = {k: v for k, v in c["env"].items() if k not in RAY_AUTH_VARS}
    env.update(HOME=str(home), RAY_gcs_server_port_wait_time_s="3")
    address = f"127.0.0.2:{c['ray_port']}"
    ray_bin = str(Path(sys.executable).parent / "ray")
    job = [sys.executable, "-c", DRIVER, address]
    runs = {
        "join without the token": ([ray_bin, "start", "--address", address, "--node-ip-address", "127.0.0.4",
                                    "--num-gpus", "1", "--disable-usage-stats", "--temp-dir",
                                    f"{c['ray_tmp']}/outsider"], {}, None),
        "job without the token": (job, {}, c["cwd"] / "marker-no-token"),
        "job with another token": (job, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)},
                                   c["cwd"] / "marker-wrong-token"),
        "job with the token": (job, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)},
                               c["cwd"] / "marker-token"),
    }
    return {what: (subprocess.Popen(argv + ([str(marker)] if marker else []), env=dict(env, **extra),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=c["cwd"]), marker)
            for what, (argv, extra, marker) in runs.items()}


@pytest.fixture
def cluster_env(tmp_path, home):
    """A bin folder with the stand-in `vllm` first on PATH, a short Ray temp root, and a check that
    nothing of the cluster outlives the test."""
    if (Path(sys.executable).parent / "vllm").exists():
        pytest.skip("a real vllm is installed beside this Python: it, not the stand-in, would run")
    if shutil.which("ray", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")) is None:
        pytest.skip("Ray is not installed")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "vllm-call.json"
    fake = bindir / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, record=str(record), standin=str(STANDIN)))
    fake.chmod(0o755)
    ray_tmp = tempfile.mkdtemp(prefix="hbray", dir="/tmp")  # Ray's socket paths must stay short
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    serve_port, ray_port = free_port(), free_port("127.0.0.2")
    marks = [ray_tmp, f"--port {serve_port}"]
    yield {"env": env, "record": record, "ray_tmp": ray_tmp, "serve_port": serve_port, "ray_port": ray_port,
           "marks": marks, "cwd": tmp_path}
    left = _processes_mentioning(marks)
    for line in left:  # leave no process behind even when the test failed: only those of this test
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"processes of the cluster outlived the test: {left}"


def _serve_argv(art: Path, c: dict, *extra: str) -> list[str]:
    return ["serve", str(art), "--profile", "dense", "--nodes", NODES, "--ifname", "lo", "--ray-port",
            str(c["ray_port"]), "--ray-temp-dir", c["ray_tmp"], "--port", str(c["serve_port"]), "--join-timeout",
            "120", "--ready-timeout", "120", "--log", str(c["cwd"] / "logs" / "serve.log"), *extra]


@pytest.mark.slow
def test_two_ray_nodes_on_loopback_only_admit_the_tokens_holders_and_stop_on_ctrl_c(referenced_artifact, cluster_env,
                                                                                       home):
    """The bring-up with an API key given in a file: vLLM (the stand-in, wanting the key as vLLM
    does) has it in its environment only, and serve's readiness probe, check and smoke test send it."""
    c = cluster_env
    key = "sk-cluster-" + secrets.token_hex(16)
    keyfile = c["cwd"] / "api.key"
    keyfile.write_text(key + "\n")
    keyfile.chmod(0o600)
    run = CliRun(_serve_argv(referenced_artifact, c, "--api-key-file", str(keyfile)), c["env"], c["cwd"])
    try:
        assert run.wait_for("API key: ", 60).startswith(f"API key: {keyfile.resolve()} (--api-key-file)")
        assert run.wait_for("checked 2 nodes", 120).startswith("checked 2 nodes: same artifact, vLLM 0.0.0-standin")
        run.wait_for("Ray head up at 127.0.0.2:", 120)
        assert run.wait_for("2 nodes joined", 120) == "2 nodes joined: 127.0.0.2, 127.0.0.3"
        assert run.wait_for("verify ", 120).startswith("verify passed")  # through the head, with the key
        ready = run.wait_for("READY", 120)
        assert "on 2 nodes (TP=2 x PP=1)" in ready and f"http://127.0.0.1:{c['serve_port']}/v1" in ready
        assert run.wait_for("smoke test:", 30) == "smoke test: 'Paris.'"
        call = json.loads(c["record"].read_text())
        assert call["alive"] == ["127.0.0.2", "127.0.0.3"]  # both nodes were in Ray when vLLM started
        assert call["argv"][-6:] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
                                     "--distributed-executor-backend", "ray"]
        files = _token_files(home)
        assert [f.name for f in files] == [f"ray-token-{c['ray_port']}-node{i}" for i in (1, 2)]
        assert call["env"] == {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.2",
                               "RAY_ADDRESS": f"127.0.0.2:{c['ray_port']}", "VLLM_PLUGINS": "hybrid_build",
                               "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(files[0]), "RAY_AUTH_TOKEN": None,
                               "VLLM_API_KEY": key}
        # the key: in vLLM's environment and nowhere else, on no command line; vLLM wants it
        assert [h.split(" ", 2)[:2] for h in _holding(key.encode())] == [[str(call["pid"]), "(environ):"]]
        assert not any(key in a for a in call["argv"]) and "--api-key" not in call["argv"]
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"http://127.0.0.1:{c['serve_port']}/v1/models", timeout=30)
        ray_processes = [line for line in _processes_mentioning([c["ray_tmp"]])
                         if int(line.split(":", 1)[0]) != run.proc.pid]  # hybrid-build's own names it too
        assert ray_processes, "the Ray nodes run from the temp root given"
        token = files[0].read_bytes().strip()
        assert len(token) >= 40 and files[1].read_bytes().strip() == token
        assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
        assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
        # every Ray process has the token mode and a file's path, and no process the token itself
        for line in ray_processes:
            proc = Path("/proc") / line.split(":", 1)[0]
            assert b"RAY_AUTH_MODE=token" in (proc / "environ").read_bytes().split(b"\0"), line
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if any(a.endswith(b"dashboard/dashboard.py") for a in argv):  # the head's: its web server, on loopback
                assert b"--host=127.0.0.1" in argv, line
                listening = _listening(proc)
                assert all(a.is_loopback for a in listening), (line, listening)
                if importlib.util.find_spec("aiohttp_cors") is None:  # plain `ray`: no web server, no job API
                    assert listening == [], (line, listening)
        assert not _holding(token), "the token is on a command line or in an environment"

        outsiders = _outsiders(c, files[0])
        answers = {what: (p.communicate(timeout=180)[0], p.returncode, marker)
                   for what, (p, marker) in outsiders.items()}
        out, rc, marker = answers.pop("job with the token")
        # the control: the same job, given the token, gets in and its task runs on the cluster
        assert rc == 0 and "CONNECTED 2" in out and marker.read_text() == "ran", out
        for what, (out, rc, marker) in answers.items():
            assert rc != 0 and REFUSED.search(out), f"{what}: exit {rc}\n{out[-2000:]}"
            assert marker is None or not marker.exists(), f"{what}: its task ran"
        assert not _processes_mentioning([f"{c['ray_tmp']}/outsider"])  # the refused node left nothing running

        run.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert run.proc.wait(timeout=180) == 130
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    assert _token_files(home) == []
    shown = run.output().encode()
    assert token not in shown and key.encode() not in shown
    for secret in (token, key.encode()):
        assert _files_holding(c["cwd"] / "logs", secret) == [] and _files_holding(Path(c["ray_tmp"]), secret) == []
    # the fixture asserts that no Ray process and no stand-in server is left


@pytest.mark.slow
def test_a_failed_start_stops_the_nodes_it_started(tiny_artifact, cluster_env, home):
    """vLLM asks for more GPUs than joined (2 per node declared, so TP=4, but the stand-in counts
    GPU nodes): it exits, and the Ray nodes already started are stopped before the command ends."""
    c = cluster_env
    run = CliRun(_serve_argv(tiny_artifact, c, "--gpus-per-node", "2", "--parallel", "tp"), c["env"], c["cwd"])
    run.wait_for("2 nodes joined", 180)
    assert len(_token_files(home)) == 2
    assert run.proc.wait(timeout=180) == 1
    err = run.proc.stderr.read()
    assert "exited with code 1 before it was ready" in err and "GPU nodes in Ray, TP x PP = 4" in err
    assert _token_files(home) == []


def test_a_taken_port_on_the_head_starts_no_node(tiny_artifact, cluster_env, home):
    """The head is this machine and another process listens on the served port: exit 3 naming it, before
    any node, token file or vLLM starts (the fixture checks that no Ray process was left)."""
    c = cluster_env
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", c["serve_port"]))
        squatter.listen()
        run = CliRun(_serve_argv(tiny_artifact, c), c["env"], c["cwd"])
        assert run.proc.wait(timeout=120) == 3
        err = run.proc.stderr.read()
    assert f"port {c['serve_port']} is taken by pid {os.getpid()} (" in err and "no node was started" in err, err
    assert _token_files(home) == [] and not c["record"].exists()


LISTENER = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); " \
           "print('listening', flush=True); time.sleep(600)"


def test_the_head_port_must_be_held_by_the_vllm_the_bring_up_started(artifact, tmp_path, caplog):
    """``bind_to_head`` with real processes: a port held by another process than the started vLLM's tree
    is refused (exit 3, the holder named); held by that vLLM it passes; a head elsewhere gets one warning."""
    from dataclasses import replace

    from hybrid_build.core.errors import CannotRun

    port = free_port()
    plan = _plan(artifact)
    plan = replace(plan, serve=replace(plan.serve, host="127.0.0.1", port=port))
    procs = []

    def start(argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        procs.append(p)
        return p

    try:
        squatter = start([sys.executable, "-c", LISTENER, str(port)])
        assert squatter.stdout.readline() == "listening\n"
        idle = start([sys.executable, "-c", "import time; time.sleep(600)"])
        with pytest.raises(CannotRun, match=rf"^port {port} answers, but pid {squatter.pid} \(.*not the vLLM this "
                                            rf"bring-up started \(pid {idle.pid}\)"):
            mn.bind_to_head(plan, mn.Started("vLLM", idle, tmp_path / "log"))
        squatter.kill()
        squatter.wait()
        engine = start([sys.executable, "-c", LISTENER, str(port)])
        assert engine.stdout.readline() == "listening\n"
        mn.bind_to_head(plan, mn.Started("vLLM", engine, tmp_path / "log"))  # its own socket: no error
        elsewhere = mn.plan_multinode(plan.serve, ["user@198.51.100.12", "127.0.0.2"], str(artifact), ifname="lo")
        with caplog.at_level("WARNING", logger=mn.__name__):
            mn.bind_to_head(elsewhere, mn.Started("vLLM", idle, tmp_path / "log"))
        assert f"who answers on port {port} of node 1 (head, 198.51.100.12, ssh user@198.51.100.12) cannot be told " \
               "from here: it was free there when vLLM started" in caplog.text
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_sigterm_while_starting_stops_the_nodes_and_removes_the_token_files(tiny_artifact, cluster_env, home):
    """A daemon manager's SIGTERM (SIGHUP: a closed terminal, the same path) while vLLM starts:
    exit 143, the nodes stopped (the fixture checks), the token files gone."""
    c = cluster_env
    run = CliRun(_serve_argv(tiny_artifact, c), c["env"], c["cwd"])
    try:
        run.wait_for("2 nodes joined", 180)
        assert len(_token_files(home)) == 2
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=180) == 128 + signal.SIGTERM
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    assert _token_files(home) == []


# ----------------------------------------------------------------------------- plan --nodes


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.pipeline.generators.synthetic import (
        qwen35_122b_config,
        qwen35_397b_config,
        write_synthetic_checkpoint,
    )

    root = tmp_path_factory.mktemp("synthetic")
    return {name: Checkpoint.read_folder(write_synthetic_checkpoint(root / name, cfg))
            for name, cfg in (("122b", qwen35_122b_config(compact_extra_config=True)), ("397b", qwen35_397b_config()))}


def test_397b_headers_inspect_and_run_dry_run_with_its_recipe(synthetic, tmp_path, capsys):
    folder = synthetic["397b"].root
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "279674 tensors" in out and "276480" in out  # 60 layers x 512 experts x 3 projections x 3 tensors
    assert main(["run", str(folder), "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "recipe qwen3.5-397b-a17b (chosen from the source's config.json)" in out
    assert "lm_head  248320x4096" in out


def _nodes_plan(ckpt, **kw) -> dict:
    from hybrid_build.serve.speed.speed_plan import PlanOptions, build_plan

    return build_plan(ckpt, PlanOptions(accept=[1.0], nodes=2, **kw))


def test_tp_reads_half_the_sharded_bytes_and_pays_the_link(synthetic):
    data = _nodes_plan(synthetic["122b"])
    mnd, parts = data["multinode"], data["bytes_per_token"]["base"]
    replicated = sum(parts[k] for k in ("router", "shared_expert_gate", "norm", "embedding"))
    row = mnd["profiles"]["base"]
    assert row["tp"]["bytes_per_token_per_node"] == pytest.approx((sum(parts.values()) - replicated) / 2 + replicated)
    # 48 layers x 2 all-reduces of the 3072-wide BF16 hidden state + the embedding's, and one logits gather
    tp = mnd["tp"]
    assert (tp["allreduces_per_token"], tp["allreduce_bytes"], tp["gather_bytes"]) == (97, 6144, 496640)
    assert tp["link_ms"] == pytest.approx(98 * 0.025 + (97 * 6144 + 496640 / 2) / 25e9 * 1e3)
    gb10 = bw.HARDWARE["gb10"]
    step = row["tp"]["bytes_per_token_per_node"] / (273e9 * gb10.efficiency) + tp["link_ms"] / 1e3
    assert row["tp"]["tok_s"] == pytest.approx(1 / step)
    assert row["single_node_tok_s"] == pytest.approx(28.2, abs=0.05)
    assert 1.6 < row["tp"]["speedup"] < 1.8  # bytes halve, the link costs ~2.5 ms of ~18
    assert row["pp"]["tok_s"] < row["single_node_tok_s"]  # PP splits memory, not time
    # on an H200 the floor (7.6 ms) is paid on every node: TP=2 is slower than one GPU
    h200 = _nodes_plan(synthetic["122b"], hardware="h200")["multinode"]["profiles"]["dense"]
    assert h200["tp"]["tok_s"] < h200["single_node_tok_s"]
    slow_link = _nodes_plan(synthetic["122b"], link_latency_us=100)["multinode"]
    assert slow_link["tp"]["link_ms"] > 9.8 and "given (--link-latency-us)" in slow_link["link"]["source"]


def test_397b_needs_two_sparks(synthetic, capsys):
    data = _nodes_plan(synthetic["397b"])
    assert (data["experts"], data["top_k"]) == (512, 10)
    mnd = data["multinode"]
    assert mnd["tp"]["allreduces_per_token"] == 121  # 60 layers
    dense = mnd["profiles"]["dense"]
    assert 200e9 < dense["weights_bytes"] < 215e9 and dense["weights_per_node_bytes"] < 110e9
    assert any("one node (128 GB) cannot hold the weights" in n for n in mnd["notes"])
    assert dense["tp"]["tok_s"] > dense["single_node_tok_s"]
    with pytest.raises(UserError, match="--nodes must be 2 or more"):
        _nodes_plan_n(synthetic["397b"], 1)
    assert main(["plan", "synthetic:qwen3.5-397b-a17b", "--nodes", "2", "--accept", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes over a 200 Gb/s link, 25 us per two-node all-reduce" in out
    assert "assumption: link latency 25 us: assumed, not measured" in out


def _nodes_plan_n(ckpt, n: int) -> dict:
    from hybrid_build.serve.speed.speed_plan import PlanOptions, build_plan

    return build_plan(ckpt, PlanOptions(accept=[1.0], nodes=n))


def test_predict_refuses_one_node():
    with pytest.raises(ValueError):
        mnp.predict({}, {"hidden_size": 8, "vocab_size": 8}, bw.HARDWARE["gb10"], 0.0, 1)


@pytest.mark.slow
def test_a_node_whose_ray_dies_after_ready_stops_the_whole_server_naming_it(tiny_artifact, cluster_env, home):
    """After READY the nodes are watched as one engine is: node 2's `ray start --block` killed, serve
    says so in one line with its time, naming node 2, stops vLLM and the head, exits 1."""
    c = cluster_env
    run = CliRun(_serve_argv(tiny_artifact, c, "--watch-interval", "0.1"), c["env"], c["cwd"])
    try:
        run.wait_for("READY", 240)
        node2 = [line for line in _processes_mentioning([f"{c['ray_tmp']}/node2"])
                 if "ray start" in line or "/ray start" in line]
        assert len(node2) == 1, node2
        os.kill(int(node2[0].split(":", 1)[0]), signal.SIGKILL)
        line = run.wait_for("20", 60)
        assert " exit: Ray worker on node 2 (worker, 127.0.0.3" in line and "was killed by SIGKILL" in line, line
        assert line.endswith("; stopping every node")
        print(f"\nnode: {line}")
        assert run.proc.wait(timeout=180) == 1
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    assert _token_files(home) == []
    # the fixture asserts that no Ray process and no stand-in server is left
