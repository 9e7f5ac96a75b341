"""Bad input is one line and exit 2, with nothing written: a binary file where a recipe or texts are
expected, an output path that is a loop of symbolic links (or under a file), a FIFO where a shard or
the config should be (refused, never read: reading one blocks), values out of range (ports,
timeouts, sizes) refused by argparse before anything starts, dry runs included, and a disk too small
for what validate writes (the report, its picture, the reference) refused before a check runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_build.pipeline.cli import main

BINARY = bytes(range(256)) * 8  # not UTF-8 (0x80 alone), holds NUL bytes


def _error(capsys, argv) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return code, err.strip()


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def binary(tmp_path) -> Path:
    path = tmp_path / "weights.bin"
    path.write_bytes(BINARY)
    return path


def test_a_binary_recipe_is_refused_before_the_demo_is_built(binary, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _error(capsys, ["run", "-o", str(out), "--recipe", str(binary), "--dry-run"])
    assert code == 2 and err == f"error: recipe {binary}: not a UTF-8 text file (byte 128 is 0x80)"
    assert not out.exists()


def test_a_recipe_that_is_a_fifo_or_a_folder_is_refused_without_reading(tiny_checkpoint, tmp_path, capsys):
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    code, err = _error(capsys, ["inspect", str(tiny_checkpoint), "--recipe", str(fifo)])
    assert code == 2 and err == f"error: recipe {fifo}: a FIFO, not a regular file"
    code, err = _error(capsys, ["inspect", str(tiny_checkpoint), "--recipe", str(tmp_path)])
    assert code == 2 and err == f"error: recipe {tmp_path}: a folder, not a regular file"


def test_binary_texts_are_refused_before_validate_writes(binary, tmp_path, capsys):
    texts = tmp_path / "prompts.txt"
    texts.write_bytes(b"a prompt\x00with a NUL")
    before = _tree(tmp_path)
    code, err = _error(capsys, ["validate", str(tmp_path), "--texts", str(binary)])
    assert code == 2 and err == f"error: texts file {binary}: not a UTF-8 text file (byte 128 is 0x80)"
    code, err = _error(capsys, ["validate", str(tmp_path), "--texts", str(texts)])
    assert code == 2 and err == f"error: texts file {texts}: not a text file (it holds NUL bytes at byte 8)"
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("argv", [
    ["run", "-o", "{out}", "--dry-run"],
    ["demo-checkpoint", "{out}"],
    ["plan", "synthetic:qwen3.5-122b-a10b", "--plot", "{out}"],
    ["bench", "--compare", "{tmp}/a.json", "{tmp}/b.json", "--out", "{out}"],
    ["eval", "--source-url", "http://127.0.0.1:9/v1", "--hybrid-url", "http://127.0.0.1:9/v1", "--out", "{out}"],
], ids=["run", "demo-checkpoint", "plan", "bench", "eval"])
def test_an_output_path_in_a_loop_of_links_is_one_line(argv, tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "file").write_text("x\n")
    before = _tree(tmp_path)
    for out, says in ((tmp_path / "a", "a loop of symbolic links"), (tmp_path / "a" / "x", "a loop of symbolic links"),
                      (tmp_path / "file" / "x", "a part of the path is a file, not a folder")):
        code, err = _error(capsys, [a.format(out=out, tmp=tmp_path) for a in argv])
        assert code == 2 and err.endswith(f" {out}: {says}"), err
    assert _tree(tmp_path) == before


def _fifo_in_place_of(folder: Path, name: str) -> Path:
    path = folder / name
    path.unlink()
    os.mkfifo(path)
    return path


CLI = [sys.executable, "-c", "import sys; from hybrid_build.pipeline.cli import main; sys.exit(main())"]


@pytest.mark.parametrize("name", ["model-00002-of-00004.safetensors", "config.json", "model.safetensors.index.json"])
def test_a_fifo_in_the_source_is_refused_not_read(tiny_copy, tmp_path, name):
    """A separate process with a time limit: reading the FIFO would block it, not this test run."""
    if not (tiny_copy / name).exists():
        pytest.skip(f"the tiny checkpoint has no {name}")
    fifo = _fifo_in_place_of(tiny_copy, name)
    for argv in (["inspect", str(tiny_copy)], ["run", str(tiny_copy), "-o", str(tmp_path / "out"), "--dry-run"]):
        r = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in r.stderr
        named = fifo.name if name.endswith('.safetensors') else fifo
        assert err[0].startswith("error: ") and (f"{named}: a FIFO" in err[0] or f"{named} is a FIFO" in err[0])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value, says", [
    ("--port", "99999", "argument --port: must be between 1 and 65,535, got 99999"),
    ("--port", "-1", "argument --port: must be between 1 and 65,535, got -1"),
    ("--ready-timeout", "-1", "argument --ready-timeout: must be more than 0 and at most 2,592,000, got -1"),
    ("--ready-timeout", "1e308", "argument --ready-timeout: must be more than 0 and at most 2,592,000, got 1e308"),
    ("--ready-timeout", "nan", "argument --ready-timeout: not a finite number: 'nan'"),
    ("--ray-port", "0", "argument --ray-port: must be between 1 and 65,535, got 0"),
    ("--join-timeout", "0", "argument --join-timeout: must be more than 0 and at most 2,592,000, got 0"),
    ("--gpus-per-node", "0", "argument --gpus-per-node: must be between 1 and 1,000,000, got 0"),
    ("--restart", "1000000000", "argument --restart: must be between 0 and 1,000,000, got 1000000000"),
])
def test_serve_dry_run_refuses_values_out_of_range(flag, value, says, tmp_path, capsys):
    code, err = _error(capsys, ["serve", str(tmp_path), "--dry-run", flag, value])
    assert code == 2 and err.startswith(f"error: {says} ")


PLAN = ["plan", "synthetic:qwen3.5-122b-a10b"]
BENCH = ["bench", "http://127.0.0.1:9/v1"]


@pytest.mark.parametrize("argv, says", [
    (BENCH + ["--runs", "0"], "argument --runs: must be between 1 and 1,000, got 0"),
    (BENCH + ["--max-tokens", "-5"], "argument --max-tokens: must be between 1 and 16,777,216, got -5"),
    (BENCH + ["--concurrency", "1000000000"], "argument --concurrency: must be between 1 and 1,024, got 1000000000"),
    (BENCH + ["--seed", "-1"], "argument --seed: must be between 0 and 4,294,967,295, got -1"),
    (BENCH + ["--conversations", "20000"], "argument --conversations: must be between 1 and 10,000, got 20000"),
    (BENCH + ["--duration", "1e308"], "argument --duration: must be more than 0 and at most 2,592,000, got 1e308"),
    (["eval", "--limit", "0"], "argument --limit: must be more than 0 and at most 1,000,000,000, got 0"),
    (["eval", "--num-fewshot", "-1"], "argument --num-fewshot: must be between 0 and 1,000,000, got -1"),
    (["eval", "--batch-size", "0"], "argument --batch-size: must be between 1 and 1,000,000, got 0"),
    (["eval", "--concurrency", "5000"], "argument --concurrency: must be between 1 and 1,024, got 5000"),
    (["demo-checkpoint", "-o", "x", "--seed", str(2**64)], "argument --seed: must be between 0 and 4,294,967,295"),
    (PLAN + ["--context", "0"], "argument --context: must be between 1 and 16,777,216, got 0"),
    (PLAN + ["--efficiency", "1.5"], "argument --efficiency: must be more than 0 and at most 1, got 1.5"),
    (PLAN + ["--accept", "0.5"], "argument --accept: must be between 1 and 65, got 0.5"),
    (PLAN + ["--accept", "1e308"], "argument --accept: must be between 1 and 65, got 1e308"),
    (PLAN + ["--concurrency", "1000000000"], "argument --concurrency: must be between 1 and 1,024, got 1000000000"),
    (PLAN + ["--verify-block", "100"], "argument --verify-block: must be between 1 and 65, got 100"),
    (PLAN + ["--stream-overlap", "2"], "argument --stream-overlap: must be between 0 and 1, got 2"),
    (PLAN + ["--nodes", "1"], "argument --nodes: must be between 2 and 64, got 1"),
    (PLAN + ["--bandwidth", "inf"], "argument --bandwidth: not a finite number: 'inf'"),
    (PLAN + ["--bandwidth", "1e308"], "argument --bandwidth: must be more than 0 and at most 100,000, got 1e308"),
    (PLAN + ["--floor-ms", "1e300"], "argument --floor-ms: must be between 0 and 10,000, got 1e300"),
])
def test_sizes_and_counts_out_of_range_are_refused_by_argparse(argv, says, capsys):
    code, err = _error(capsys, argv)
    assert code == 2 and err.startswith(f"error: {says}")


@pytest.mark.parametrize("argv, says", [
    # the bound that depends on what is planned: the DFlash drafter's block of 16 (15 drafted + the bonus)
    (PLAN + ["--accept", "17"], "--accept 17: the dflash drafter emits at most 16 tokens a step"),
    (PLAN + ["--accept", "8", "--verify-block", "6"], "--accept 8 exceeds --verify-block 6"),
    (PLAN + ["--context", "10000000"], "--context 10000000 exceeds 262,144 tokens"),
    (BENCH + ["--agent", "--contexts", "99999999999k"], "is more than 16,777,216 tokens"),
    (BENCH + ["--trace", "agent-synthetic", "--duration", "60", "--window", "0.001"],
     "--window 0.001: the soak could close 690,000 windows"),
])
def test_bounds_that_depend_on_the_input_are_one_line(argv, says, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_plan_takes_the_bounds_themselves(capsys):
    assert main(PLAN + ["--accept", "1", "16", "--concurrency", "1024", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["accept"] for r in data["speculative"] if r["profile"] == "dense"] == [1.0, 16.0]
    assert {r["concurrency"] for r in data["concurrency"]} == {1024}


# ------------------------------------------------------------------ what validate writes, on a small disk


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs (needs root, as tests/pipeline/test_trust.py's): ``small_fs(size)`` mounts one."""
    mounted = []

    def mount(size: str) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def test_validate_refuses_a_disk_that_cannot_hold_its_report_before_a_check_runs(inc_artifact, tiny_checkpoint,
                                                                                 small_fs, capsys):
    from hybrid_build.validate.end_to_end import load_texts
    from hybrid_build.validate.report import planned_bytes

    size = sum(p.stat().st_size for p in inc_artifact.rglob("*") if p.is_file() and ".hybrid-build" not in p.parts)
    fs = small_fs(f"{(size + 2_000_000) // 1024}k")  # the artifact and 2 MB: less than the picture's bound
    art = fs / "art"
    shutil.copytree(inc_artifact, art, ignore=shutil.ignore_patterns(".hybrid-build"))
    before = _tree(art)
    free = shutil.disk_usage(fs).free
    need = planned_bytes(load_texts(None), 1, True)
    assert need > free
    code, err = _error(capsys, ["validate", str(art), "--source", str(tiny_checkpoint)])
    assert code == 2 and "free on its filesystem, validate writes about" in err and str(art) in err
    assert _tree(art) == before  # no report, no reference, no partial file


# ------------------------------------------------------------------ a signature that never ends


@pytest.mark.parametrize("command", [["verify-artifact"], ["status"], ["serve", "--dry-run"]])
def test_a_signature_nested_without_end_is_one_line_exit_2(artifact, command, capsys):
    (artifact / "model.sig").write_text("[" * 100_000 + "]" * 100_000)
    code, err = _error(capsys, [command[0], str(artifact), *command[1:]])
    assert code == 2 and err == "error: model.sig: JSON nested deeper than 100 levels; not read", err


def test_a_signature_that_is_a_fifo_is_refused_unopened(artifact):
    os.mkfifo(artifact / "model.sig")
    r = subprocess.run(CLI + ["verify-artifact", str(artifact)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr == "error: model.sig: a FIFO, not a regular file\n", r.stderr
