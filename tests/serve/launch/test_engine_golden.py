"""Golden tests: the exact command and environment of every profile x engine.

The 122B recipe's profiles on a stand-in artifact folder (config.json with a hybrid_build block
naming its source); paths of this machine are replaced by <ARTIFACT> and <SERVE>. Regenerate
after an intended change with ``HYBRID_BUILD_UPDATE_GOLDEN=1`` and review the diff.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from hybrid_build.core.errors import SourceMismatch, UserError
from hybrid_build.pipeline.cli import main
from hybrid_build.serve.launch.engine import plan_launch

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
PROFILES = ("dense", "dflash", "base", "mtp")


def _render(plan, art: Path) -> str:
    from hybrid_build.serve.launch.engine import runtime_dir

    text = json.dumps(plan.to_json(), indent=1, sort_keys=True)
    return (text.replace(str(runtime_dir()), "<RUNTIME>")
                .replace(str(art.resolve()), "<ARTIFACT>")) + "\n"


@pytest.mark.parametrize("engine", ["local", "docker"])
@pytest.mark.parametrize("profile", PROFILES)
def test_golden_command(profile, engine, artifact):
    plan = plan_launch(str(artifact), profile, engine=engine, recipe="qwen3.5-122b-a10b")
    got = _render(plan, artifact)
    path = GOLDEN / f"{profile}-{engine}.json"
    if os.environ.get("HYBRID_BUILD_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text()


def test_profiles_differ_where_they_should(artifact):
    plans = {p: plan_launch(str(artifact), p, recipe="qwen3.5-122b-a10b") for p in PROFILES}
    spec = {p: next((json.loads(plans[p].argv[i + 1]) for i, a in enumerate(plans[p].argv)
                     if a == "--speculative-config"), None) for p in PROFILES}
    assert spec["dense"]["method"] == spec["dflash"]["method"] == "dflash"
    assert spec["dense"]["attention_backend"] == "FLASH_ATTN"
    # the recipe's reasons: 6 for low acceptance (a larger KV pool), 12 for agents and code
    assert spec["dense"]["num_speculative_tokens"] == 6 and spec["dflash"]["num_speculative_tokens"] == 12
    assert spec["mtp"]["method"] == "mtp" and spec["base"] is None
    assert plans["dense"].model.endswith("art")
    assert plans["base"].model == plans["dflash"].model == "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
    assert all(plans[p].env["VLLM_PLUGINS"] == "hybrid_build" for p in PROFILES)


def test_quantize_at_load_head_sets_the_plugin_env(artifact):
    cfg = json.loads((artifact / "config.json").read_text())
    cfg["hybrid_build"]["lm_head"] = "quantize-at-load"
    (artifact / "config.json").write_text(json.dumps(cfg))
    plan = plan_launch(str(artifact), "dense", recipe="qwen3.5-122b-a10b")
    assert plan.env["HYBRID_BUILD_LM_HEAD"] == "quantize-at-load"
    docker = plan_launch(str(artifact), "dense", engine="docker", recipe="qwen3.5-122b-a10b")
    assert "HYBRID_BUILD_LM_HEAD=quantize-at-load" in docker.argv


def test_dense_refuses_a_non_hybrid_folder(tiny_checkpoint):
    with pytest.raises(UserError, match="not a hybrid-build artifact"):
        plan_launch(str(tiny_checkpoint), "dense", drafter="x/y")


def _drafter(plan) -> str | None:
    spec = json.loads(plan.argv[plan.argv.index("--speculative-config") + 1])
    return spec.get("model")


def test_real_artifact_uses_its_own_recipe(tiny_artifact, tiny_checkpoint, tmp_path):
    from hybrid_build.pipeline.generators.demo import demo_drafter_path

    plan = plan_launch(str(tiny_artifact), "dense", drafter="z-lab/tiny-drafter")
    assert "--max-model-len" in plan.argv and plan.argv[plan.argv.index("--max-model-len") + 1] == "2048"
    assert _drafter(plan) == "z-lab/tiny-drafter"
    # the tiny recipe's drafter is `{source}-dflash`: the one the demo builder put beside the source
    drafter = demo_drafter_path(tiny_checkpoint).resolve()
    assert _drafter(plan_launch(str(tiny_artifact), "dense")) == str(drafter)
    assert _drafter(plan_launch(str(tiny_artifact), "dflash")) == str(drafter)
    docker = plan_launch(str(tiny_artifact), "dense", engine="docker")
    assert f"{drafter}:/drafter:ro" in docker.argv and '"model":"/drafter"' in docker.argv[-1]
    # a source with no drafter beside it: one line naming the way out
    bare = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, bare)
    with pytest.raises(UserError, match=f"DFlash drafter {bare}-dflash does not exist.*--drafter"):
        plan_launch(str(tiny_artifact), "dense", source=str(bare))



def test_source_profiles_serve_the_recorded_source_checked_by_content(tiny_artifact, tiny_checkpoint, tmp_path):
    assert plan_launch(str(tiny_artifact), "base").model == str(tiny_checkpoint.resolve())
    copy = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, copy)
    assert plan_launch(str(tiny_artifact), "base", source=str(copy)).model == str(copy.resolve())
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("}", " }", 1))
    with pytest.raises(SourceMismatch, match="config.json has"):
        plan_launch(str(tiny_artifact), "base", source=str(copy))


def test_dry_run_cli(artifact, capsys):
    assert main(["serve", str(artifact), "--profile", "mtp", "--recipe", "qwen3.5-122b-a10b", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("export VLLM_PLUGINS=hybrid_build\nvllm serve Intel/Qwen3.5-122B-A10B-int4-AutoRound")
    assert main(["serve", str(artifact), "--profile", "base", "--recipe", "qwen3.5-122b-a10b",
                 "--engine", "docker", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["argv"][:2] == ["docker", "run"]
    assert main(["serve", "nowhere/at-all", "--dry-run"]) == 2
    assert "needs --recipe" in capsys.readouterr().err


def test_dense_profile_says_when_its_levers_gain_little(tiny_artifact):
    """On an H200 the per-step floor hides the dense levers: serve says so; on a DGX Spark it does not."""
    h200 = plan_launch(str(tiny_artifact), "dense", drafter="z-lab/tiny-drafter", hardware="h200")
    assert any("bound by the per-step floor" in n for n in h200.notes)
    gb10 = plan_launch(str(tiny_artifact), "dense", drafter="z-lab/tiny-drafter", hardware="gb10")
    assert not any("per-step floor" in n for n in gb10.notes)


def test_kv_cache_dtype_reaches_vllm_only_when_a_profile_asks(artifact, tmp_path):
    """A profile's ``kv_cache_dtype`` becomes vLLM's --kv-cache-dtype; no shipped
    profile sets it (fp8 KV is checked with verify first, docs/serve.md); a value vLLM does not
    know is refused by the schema, and every value the schema takes is one that each vLLM
    version this project targets lists in its CacheDType."""
    import typing

    import yaml
    from pydantic import ValidationError

    from hybrid_build.recipes.profiles import ServeProfile
    from hybrid_build.recipes.schema import load_recipe
    from tests.serve.vllm_sources import VERSIONS, unpacked

    for p in PROFILES:
        assert "--kv-cache-dtype" not in plan_launch(str(artifact), p, recipe="qwen3.5-122b-a10b").argv
    data = load_recipe("qwen3.5-122b-a10b").model_dump(mode="json")
    data["serve"]["profiles"]["dense"]["kv_cache_dtype"] = "fp8"
    path = tmp_path / "fp8kv.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    argv = plan_launch(str(artifact), "dense", recipe=str(path)).argv
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in plan_launch(str(artifact), "base", recipe=str(path)).argv
    with pytest.raises(ValidationError):
        ServeProfile(kv_cache_dtype="fp9")
    ours = set(typing.get_args(ServeProfile.model_fields["kv_cache_dtype"].annotation))
    checked = 0
    for version in VERSIONS:
        src = unpacked(version)
        if src is None:
            continue
        text = (src / "vllm" / "config" / "cache.py").read_text()
        block = text[text.index("CacheDType = Literal["):]
        theirs = set(re.findall(r'"([a-z0-9_]+)"', block[:block.index("]")]))
        assert ours <= theirs, (version, ours - theirs)
        checked += 1
    if not checked:
        pytest.skip("no vLLM sources unpacked (.ci/vllm_sources.sh)")


def test_fp8_kv_cache_on_a_checkpoint_without_bf16_gets_the_measured_note(tiny_artifact, tmp_path):
    """On the H200 (vLLM 0.25.1) the tiny source, served in float16, died at the first prompt with
    an fp8 KV cache, while the tiny hybrid (served in bf16) passed verify with it (docs/serve.md).
    Neither config names a dtype (vLLM chose), so both plans carry the note; giving vLLM's --dtype
    takes it away, and a profile without fp8 KV never has it."""
    import yaml

    from hybrid_build.core.artifact import read_recipe_data

    data = read_recipe_data(tiny_artifact)
    path = tmp_path / "fp8kv.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert not any("KV cache" in n for n in plan_launch(str(tiny_artifact), "base", recipe=str(path)).notes)
    for prof in data["serve"]["profiles"].values():
        prof["kv_cache_dtype"] = "fp8"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    dense = plan_launch(str(tiny_artifact), "dense", recipe=str(path))
    assert dense.argv[dense.argv.index("--kv-cache-dtype") + 1] == "fp8"
    base = plan_launch(str(tiny_artifact), "base", recipe=str(path))
    assert any(re.search(r"'base' profile asks for an fp8 KV cache .* names no dtype.*--dtype", n) for n in base.notes)
    data["serve"]["profiles"]["base"]["extra_args"] = ["--dtype", "bfloat16"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    base = plan_launch(str(tiny_artifact), "base", recipe=str(path))
    assert "--kv-cache-dtype" in base.argv and not any("KV cache" in n for n in base.notes)
