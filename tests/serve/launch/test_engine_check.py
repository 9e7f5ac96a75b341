"""serve's drafter-vs-engine check (``serve/launch/engine_check.py``): the source texts its rules rest on,
read from each checked version's unpacked wheel, the verdict for each combination, and ``serve``
refusing before anything starts (stand-in ``vllm`` / ``nvidia-smi`` executables on PATH: the version
is what the stand-in prints; a started ``vllm serve`` would leave a mark)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hybrid_build.core.errors import UserError
from hybrid_build.pipeline.cli import main
from hybrid_build.serve.launch import engine_check
from hybrid_build.serve.launch.engine_check import CHECKED, FACTS, EngineCannotRun, Shapes

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "scripts" / "gpu"))
import vllm_sources  # noqa: E402
from agent_steps import drafter_config  # noqa: E402

TARGET_122B = {"text_config": {"num_key_value_heads": 2, "head_dim": 256, "num_attention_heads": 32,
                               "hidden_size": 3072,
                               "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12}}


@pytest.mark.vllm
@pytest.mark.parametrize("fact", FACTS, ids=lambda f: f.path.rsplit("/", 1)[-1] + ":" + f.text[:30])
def test_each_rule_rests_on_its_versions_source(fact):
    """The text is in every version the rule names, and in none of the other checked versions
    (where the rule says the version behaves otherwise)."""
    for version in CHECKED:
        root = vllm_sources.unpacked(version)
        if root is None:
            pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
        path = root / fact.path
        text = path.read_text() if path.exists() else ""
        if version in fact.versions or fact.only:
            assert (fact.text in text) == (version in fact.versions), (version, fact)


@pytest.mark.vllm
def test_0230_drafter_layers_take_no_window():
    """0.23.0's DFlash attention never reads layer_types or a sliding window (the note it gets)."""
    root = vllm_sources.unpacked("0.23.0") or pytest.skip("vLLM 0.23.0 sources not prepared")
    text = (root / "vllm/model_executor/models/qwen3_dflash.py").read_text()
    assert "layer_types" not in text and "sliding_window" not in text


def _shapes(shape: str) -> Shapes:
    return engine_check.shapes(drafter_config(shape), TARGET_122B)


def test_real_shapes_read_from_the_configs():
    mixed, full = _shapes("mixed"), _shapes("full6")
    assert mixed.mixed and not full.mixed
    assert full.drafter_kv_bytes == 2 * 8 * 128 and full.target_kv_bytes == 2 * 2 * 256 and full.target_hybrid
    assert full.larger_drafter_pages


def test_mixed_drafter_on_0251_needs_another_vllm():
    with pytest.raises(EngineCannotRun) as e:
        engine_check.check("0.25.1+cu130", "local", _shapes("mixed"), frozenset(), {}, True)
    msg = str(e.value)
    assert e.value.exit_code == 3 and "\n" not in msg
    assert "NotImplementedError" in msg and "0.26.0" in msg and "docker" in msg


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_mixed_drafter_needs_the_v2_runner(version):
    assert engine_check.check(version, "local", _shapes("mixed"), frozenset(), {}, False).notes == []
    with pytest.raises(UserError, match=f"{engine_check.V2_ENV}=0 turns that off"):
        engine_check.check(version, "local", _shapes("mixed"), frozenset(), {engine_check.V2_ENV: "0"}, False)


@pytest.mark.parametrize("shape", ["mixed", "full6"])
def test_0340_has_no_v1_runner_to_switch_to(shape):
    """0.34.0 runs every drafter on its V2 runner (the only one) and stops at start on the switch set to
    anything but 1, whatever the drafter."""
    v2 = engine_check.V2_ENV
    assert engine_check.check("0.34.0", "local", _shapes(shape), frozenset(), {}, False).notes == []
    assert engine_check.check("0.34.0", "local", _shapes(shape), frozenset(), {v2: "1"}, False).notes == []
    for value in ("0", "true"):
        with pytest.raises(UserError, match=f"refuses {v2}={value} at start") as e:
            engine_check.check("0.34.0", "local", _shapes(shape), frozenset(), {v2: value}, False)
        assert "\n" not in str(e.value)


def test_full_drafter_on_0251_needs_kv_unify():
    v = engine_check.check("0.25.1", "local", _shapes("full6"), frozenset(), {}, True)
    assert v.caching == "effective" and v.notes == []
    with pytest.raises(UserError, match="kv_unify"):
        engine_check.check("0.25.1", "local", _shapes("full6"), frozenset({"kv_unify"}), {}, True)


def test_a_drafter_with_the_targets_pages_needs_no_fix():
    small = dict(drafter_config("full6"), num_key_value_heads=2, head_dim=256)
    spec = engine_check.shapes(small, TARGET_122B)
    assert spec.larger_drafter_pages is False
    assert engine_check.check("0.25.1", "local", spec, frozenset({"kv_unify"}), {}, False).notes == []


@pytest.mark.parametrize("version, engine, off, caching", [
    ("0.25.1", "local", frozenset(), "effective"),
    ("0.26.0", "local", frozenset(), "effective"),
    ("0.26.0", "local", frozenset({"prefix_align"}), "coarse"),
    ("0.33.0", "local", frozenset(), "unclaimed"),
    ("0.34.0", "local", frozenset(), "unclaimed"),
    ("0.23.0", "docker", frozenset(), "unclaimed"),
    ("0.27.0", "local", frozenset(), "unclaimed"),
])
def test_warm_prefix_claims(version, engine, off, caching):
    v = engine_check.check(version, engine, _shapes("full6"), off, {}, True)
    assert v.caching == caching
    assert bool(v.notes) is (caching != "effective")
    assert all("\n" not in n for n in v.notes)
    assert engine_check.check(version, engine, _shapes("full6"), off, {}, False).caching in ("off", "unclaimed")


def test_unreadable_drafter_is_a_reason_not_a_crash(tmp_path):
    cfg, why = engine_check.read_config(str(tmp_path / "nowhere-as-a-folder"))
    assert cfg is None and why
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{not json")
    cfg, why = engine_check.read_config(str(tmp_path / "d"))
    assert cfg is None and "config.json" in why


# ---- serve, before anything starts

@pytest.fixture
def served(tmp_path, monkeypatch):
    """A config-only hybrid-shaped target (the 122B's attention and layer types), drafters of both
    shapes, and stand-in executables: `vllm --version` prints $STANDIN_VERSION, `vllm serve` leaves
    a mark and exits 1."""
    art = tmp_path / "target"
    art.mkdir()
    (art / "config.json").write_text(json.dumps(dict(TARGET_122B, model_type="qwen3_5_moe")))
    for shape in ("mixed", "full6"):
        (tmp_path / f"drafter-{shape}").mkdir()
        (tmp_path / f"drafter-{shape}" / "config.json").write_text(json.dumps(drafter_config(shape)))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    mark = tmp_path / "started"
    (bindir / "vllm").write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo \"$STANDIN_VERSION\"; exit 0; fi\n"
                                 f"echo \"$@ | off: $HYBRID_BUILD_DISABLE_FIXES\" > {mark}\nexit 1\n")
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("HYBRID_BUILD_DISABLE_FIXES", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path, mark


def _serve(tmp: Path, shape: str, *extra: str) -> int:
    from serve_cli import free_port

    return main(["serve", str(tmp / "target"), "--profile", "dflash", "--recipe", "qwen3.5-122b-a10b", "--drafter",
                 str(tmp / f"drafter-{shape}"), "--no-smoke", "--no-verify", "--ready-timeout", "5",
                 "--port", str(free_port()), *extra])


def test_serve_refuses_the_mixed_drafter_on_0251_before_starting(served, monkeypatch, capsys):
    tmp, mark = served
    monkeypatch.setenv("STANDIN_VERSION", "0.25.1")
    assert _serve(tmp, "mixed") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mixed sliding/full layer_types" in err and "Traceback" not in err
    assert not mark.exists()


def test_serve_refuses_kv_unify_off_with_exit_2(served, monkeypatch, capsys):
    tmp, mark = served
    monkeypatch.setenv("STANDIN_VERSION", "0.25.1")
    assert _serve(tmp, "full6", "--disable-fix", "kv_unify") == 2
    assert "do not disable it" in capsys.readouterr().err and not mark.exists()


def test_serve_starts_what_the_version_runs_and_prints_its_notes(served, monkeypatch, capsys):
    tmp, mark = served
    monkeypatch.setenv("STANDIN_VERSION", "0.26.0")
    assert _serve(tmp, "mixed") == 1  # the stand-in vLLM exits: it was started
    assert mark.exists() and "note: prefix caching" not in capsys.readouterr().out
    mark.unlink()
    monkeypatch.setenv("STANDIN_VERSION", "0.33.0")
    assert _serve(tmp, "mixed") == 1 and mark.exists()
    assert "note: prefix caching with this drafter" not in capsys.readouterr().out  # the fine_grained layout
    mark.unlink()
    assert _serve(tmp, "mixed", "--disable-fix", "sliding_window_partial_hits") == 1 and mark.exists()
    assert "note: prefix caching with this drafter" in capsys.readouterr().out


def test_the_prefix_match_unit_is_passed_where_it_was_measured(served, monkeypatch, capsys):
    """The 122B profiles' prefix_match_unit reaches vLLM 0.26.0, 0.33.0 and 0.34.0 with the same --block-size (the
    fine_grained layout), with either drafter, and turns prefix_align (its padded pages) off there; with
    sliding_window_partial_hits off and the mixed drafter, on 0.25.1, or with dflash_keep_last_block off,
    prefix_align's layout stays (0.26.0) and no unit is passed."""
    tmp, mark = served
    unit = "--block-size 64 --prefix-match-unit 64"
    for version in ("0.26.0", "0.33.0", "0.34.0"):
        for shape in ("full6", "mixed"):
            monkeypatch.setenv("STANDIN_VERSION", version)
            assert _serve(tmp, shape) == 1
            said = mark.read_text()
            assert unit in said and said.strip().endswith("off: prefix_align"), (version, said)
            out = capsys.readouterr().out
            assert "note: prefix cache: --block-size 64 --prefix-match-unit 64 on vLLM's own KV pages" in out
            assert ("sliding_window_partial_hits on" in out) is (shape == "mixed"), out
            assert "coarse" not in out and "no warm-prefix TTFT" not in out
    off_window, off_keep = ("--disable-fix", "sliding_window_partial_hits"), ("--disable-fix", "dflash_keep_last_block")
    for version, shape, extra in (("0.26.0", "mixed", off_window), ("0.33.0", "mixed", off_window),
                                  ("0.34.0", "mixed", off_window),
                                  ("0.25.1", "full6", ()), ("0.26.0", "full6", off_keep)):
        monkeypatch.setenv("STANDIN_VERSION", version)
        assert _serve(tmp, shape, *extra) == 1, (version, shape)
        said = mark.read_text()
        assert "--prefix-match-unit" not in said and "--block-size" not in said, (version, shape, said)
        assert "prefix_align" not in said.rsplit("off:", 1)[1], (version, shape, said)
    capsys.readouterr()


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0", "0.34.0"])
def test_mixed_drafter_without_a_window_is_refused(version):
    """transformers drops sliding_window unless use_sliding_window is true; vLLM's DFlash then raises
    ValueError for the sliding layers (seen on CPU in test_agent_harness)."""
    bare = dict(drafter_config("mixed"), use_sliding_window=False)
    with pytest.raises(UserError, match="no window"):
        engine_check.check(version, "local", engine_check.shapes(bare, TARGET_122B), frozenset(), {}, False)
    given = dict(bare, dflash_config=dict(bare["dflash_config"], swa_window_size=4096))
    assert engine_check.check(version, "local", engine_check.shapes(given, TARGET_122B), frozenset(), {},
                              False).notes == []


def test_the_shipped_profiles_say_what_they_are_not_shown_to_survive(served, monkeypatch, capsys):
    """The 122B's speculative profiles carry a note on the align-mode crash family (the fix for the
    racing accepted-token read is not shown on a GPU): serve prints it at start."""
    from hybrid_build.recipes.schema import load_recipe

    tmp, mark = served
    noted = {n for n, p in load_recipe("qwen3.5-122b-a10b").serve.profiles.items() if p.note}
    assert noted == {"dense", "dflash", "mtp"}
    monkeypatch.setenv("STANDIN_VERSION", "0.26.0")
    assert _serve(tmp, "mixed") == 1 and mark.exists()
    out = capsys.readouterr().out
    assert "note: 'dflash' profile: not shown to run for hours" in out and "align_accept_snapshot" in out


def test_a_profiles_caching_note_is_printed_at_start(served, monkeypatch, capsys, tmp_path):
    import yaml

    from hybrid_build.recipes.schema import load_recipe

    tmp, mark = served
    data = load_recipe("qwen3.5-122b-a10b").model_dump(mode="json")
    data["serve"]["profiles"]["dflash"]["prefix_caching_note"] = "the drafter's pages are not aligned here"
    path = tmp / "noted.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("STANDIN_VERSION", "0.26.0")
    from serve_cli import free_port

    assert main(["serve", str(tmp / "target"), "--profile", "dflash", "--recipe", str(path), "--drafter",
                 str(tmp / "drafter-mixed"), "--no-smoke", "--no-verify", "--ready-timeout", "5",
                 "--port", str(free_port())]) == 1
    assert "note: prefix caching ('dflash' profile): the drafter's pages are not aligned here" in \
        capsys.readouterr().out
