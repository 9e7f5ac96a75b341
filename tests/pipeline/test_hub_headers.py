"""`inspect` and `plan` on a Hub id read headers, not weights; `run` still downloads the snapshot.

The Hub is a stand-in on loopback (``hub_http.py``) spoken to over HTTP by the real huggingface_hub
client: its repo info, its ranged GETs of safetensors headers (``parse_safetensors_file_metadata``),
its downloads. The served checkpoint has the real 122B's layout at two decoder layers, its data
left as holes: ~11 GB in five shards, headers real. The stand-in counts the bytes it sends and
refuses (403) any answer that would pass a budget of a few MB, so a command that starts fetching
weights fails at once.
"""
from __future__ import annotations

import json
import shutil

import pytest
from hub_http import HubServer
from huggingface_hub import constants

from hybrid_build.core import hub_headers
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import UserError
from hybrid_build.core.safetensors_io import INDEX_NAME
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.generators.synthetic import qwen35_122b_config, write_synthetic_checkpoint

REPO = "some-org/big-int4"
BUDGET = 4 << 20  # bytes the stand-in sends in one test before it refuses


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """The 122B's layout at 2 decoder layers, sparse: ~11 GB of holes, ~1 MB of headers and index."""
    folder = tmp_path_factory.mktemp("big") / "ckpt"
    return write_synthetic_checkpoint(folder, qwen35_122b_config(compact_extra_config=True), layers=range(2),
                                      sparse=True, max_shard_bytes=2_000_000_000)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in, and huggingface_hub online and pointed at it (its own cache, empty)."""
    with HubServer(budget=BUDGET) as server:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        yield server


def size_of(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def file_bytes(hub) -> int:
    """Bytes of repository files the stand-in sent (its API's JSON answers aside)."""
    return sum(s.body_bytes for s in hub.served if "/resolve/" in s.path and s.status < 300)


def cli_json(capsys, *argv) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_inspect_reads_headers_only_and_says_what_the_folder_says(big_checkpoint, hub, capsys, tmp_path):
    commit = hub.add_repo(REPO, big_checkpoint)
    served_size = size_of(big_checkpoint)
    assert served_size > 10e9

    code, remote = cli_json(capsys, "inspect", REPO)
    assert code == 0
    sent = hub.bytes_sent
    shards = sorted(big_checkpoint.glob("*.safetensors"))
    headers = sum(8 + int.from_bytes(p.open("rb").read(8), "little") for p in shards)
    jsons = (big_checkpoint / "config.json").stat().st_size + (big_checkpoint / INDEX_NAME).stat().st_size
    # the configs and every header came, and little else: under 100 kB more per shard (the library's first
    # ranged GET reads 100 kB, a second one the rest of a larger header)
    assert headers + jsons <= sent <= headers + jsons + len(shards) * 100_001 + 64_000, (sent, headers, jsons)
    assert sent < BUDGET and sent < served_size / 1000
    # every safetensors GET was ranged; nothing was written to the Hub cache
    shard_gets = [s for s in hub.served if s.method == "GET" and s.path.endswith(".safetensors")]
    assert shard_gets and all(s.range and s.status == 206 for s in shard_gets), shard_gets
    assert {s.path.rsplit("/", 1)[1] for s in shard_gets} == {p.name for p in shards}
    assert all(f"/resolve/{commit}/" in s.path for s in hub.served if "/resolve/" in s.path)  # one commit
    assert not (tmp_path / "hub-cache").exists() or not any((tmp_path / "hub-cache").rglob("*.safetensors"))

    code, local = cli_json(capsys, "inspect", str(big_checkpoint))
    assert code == 0
    assert remote.pop("source") == REPO and local.pop("source") == str(big_checkpoint)
    assert remote == local


def test_plan_reads_headers_only_and_predicts_what_the_folder_predicts(big_checkpoint, hub, capsys):
    hub.add_repo(REPO, big_checkpoint)
    code, remote = cli_json(capsys, "plan", REPO, "--hardware", "gb10")
    assert code == 0
    assert hub.bytes_sent < BUDGET and hub.bytes_sent < size_of(big_checkpoint) / 1000
    code, local = cli_json(capsys, "plan", str(big_checkpoint), "--hardware", "gb10")
    assert code == 0
    assert remote.pop("source") == REPO and local.pop("source") == str(big_checkpoint)
    assert remote == local


def cut_shard(big_checkpoint, folder, short: int):
    """``folder``: the config and the first shard with its data region ``short`` bytes short (sparse)."""
    folder.mkdir()
    shutil.copyfile(big_checkpoint / "config.json", folder / "config.json")
    shard = sorted(big_checkpoint.glob("model-*.safetensors"))[0]
    with shard.open("rb") as src, (folder / shard.name).open("wb") as dst:
        head = src.read(8)
        dst.write(head + src.read(int.from_bytes(head, "little")))
        dst.truncate(shard.stat().st_size - short)
    return folder / shard.name


@pytest.mark.parametrize("short", [4096, 8])
def test_a_shard_cut_short_on_the_hub_is_refused_as_a_local_one(big_checkpoint, hub, capsys, tmp_path, short):
    """The remote header is checked as a local one: a data region cut short is a truncated file, on the
    Hub as in a folder (a cut of 8 bytes is past the header's own padding)."""
    shard = cut_shard(big_checkpoint, tmp_path / "cut", short)
    hub.add_repo(REPO, shard.parent)
    assert main(["inspect", REPO]) == 2
    remote = capsys.readouterr().err
    assert main(["inspect", str(shard.parent)]) == 2
    local = capsys.readouterr().err
    for err in (remote, local):
        assert err.count("\n") == 1 and f"error: {shard.name}: truncated: " in err, err


def test_a_header_that_is_not_json(big_checkpoint, hub, capsys, tmp_path):
    folder = tmp_path / "notjson"
    folder.mkdir()
    shutil.copyfile(big_checkpoint / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes((16).to_bytes(8, "little") + b"this is not json")
    hub.add_repo(REPO, folder)
    assert main(["inspect", REPO]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors: not a safetensors file" in err, err


def test_a_json_file_over_the_cap_is_refused_before_it_is_fetched(big_checkpoint, hub, capsys, monkeypatch):
    monkeypatch.setattr(hub_headers, "MAX_JSON_BYTES", (big_checkpoint / "config.json").stat().st_size + 1)
    hub.add_repo(REPO, big_checkpoint)
    assert main(["inspect", REPO]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{REPO}/{INDEX_NAME}: over " in err, err
    assert not [s for s in hub.served if s.path.endswith(INDEX_NAME)]


def test_an_unknown_repo_and_revision_are_one_line(hub, capsys, big_checkpoint):
    assert main(["inspect", "nobody/nothing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nobody/nothing: not found on the Hub (HTTP 404)" in err, err
    hub.add_repo(REPO, big_checkpoint)
    assert main(["plan", REPO, "--revision", "v9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "revision 'v9' not found on the Hub (HTTP 404)" in err, err


def test_run_downloads_the_whole_snapshot_and_resumes(tiny_checkpoint, hub, tmp_path):
    """`run` opens a Hub id through snapshot_download: every file comes, into the Hub cache; stopped
    part way (here: the stand-in refuses past its budget), the next run fetches only what is missing."""
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint, folder)
    total = size_of(folder)
    hub.add_repo(REPO, folder)
    hub.budget = total // 2
    with pytest.raises(UserError, match=f"the Hub refused access to {REPO} \\(HTTP 403\\)"):
        Checkpoint.open(REPO)
    first = file_bytes(hub)
    assert 0 < first < total
    hub.reset()
    hub.budget = None
    ckpt = Checkpoint.open(REPO)
    assert ckpt.source_id == REPO and not ckpt.errors()
    got = {p.relative_to(ckpt.root): p.read_bytes() for p in ckpt.root.rglob("*") if p.is_file()}
    assert got == {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert file_bytes(hub) == total - first  # what the first run fetched is not fetched again
