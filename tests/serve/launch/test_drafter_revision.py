"""The DFlash drafter is pinned: the recipe names the Hub revision its profile's figures rest on,
`serve` passes it to vLLM (``SpeculativeConfig.revision``) and names it, `--drafter-revision`
overrides it, and a recipe whose Hub drafter names no revision is refused unless it says
`revision: null` outright (then serve says the drafter follows the Hub's main)."""
from __future__ import annotations

import json

import pytest
import yaml

from hybrid_build.pipeline.cli import main
from hybrid_build.recipes.schema import load_recipe

DRAFTER = "z-lab/Qwen3.5-122B-A10B-DFlash"


def _dry(capsys, artifact, *extra: str) -> tuple[int, dict | None, str]:
    rc = main(["serve", str(artifact), "--recipe", "qwen3.5-122b-a10b", "--dry-run", "--json", *extra])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else None, err


def _spec(plan: dict) -> dict:
    argv = plan["argv"]
    return json.loads(argv[argv.index("--speculative-config") + 1])


@pytest.mark.parametrize("profile", ["dense", "dflash"])
def test_the_recipe_pins_the_drafter_and_serve_names_the_revision(capsys, artifact, profile):
    pinned = load_recipe("qwen3.5-122b-a10b").serve.profiles[profile].speculative.revision
    assert pinned, "the 122B recipe pins its drafter"
    rc, plan, _ = _dry(capsys, artifact, "--profile", profile)
    assert rc == 0
    assert _spec(plan) | {"model": DRAFTER, "revision": pinned} == _spec(plan)
    assert f"drafter: {DRAFTER} at revision {pinned}, the {profile!r} profile's pin" in plan["notes"]


def test_drafter_revision_overrides_the_pin(capsys, artifact):
    rc, plan, _ = _dry(capsys, artifact, "--profile", "dense", "--drafter-revision", "6c7242c")
    assert rc == 0 and _spec(plan)["revision"] == "6c7242c"
    assert f"drafter: {DRAFTER} at revision 6c7242c (--drafter-revision)" in plan["notes"]


def test_another_hub_drafter_without_a_revision_is_said_to_follow_main(capsys, artifact):
    rc, plan, _ = _dry(capsys, artifact, "--profile", "dense", "--drafter", "someone/Other-DFlash")
    assert rc == 0 and "revision" not in _spec(plan)  # the profile's pin is for its own drafter
    line = next(n for n in plan["notes"] if n.startswith("drafter: "))
    assert "someone/Other-DFlash at the Hub's main, which moves (--drafter names no revision)" in line


@pytest.mark.parametrize("extra, words", [
    (("--profile", "dense", "--drafter-revision", "bad rev"), "not a Hub revision"),
    (("--profile", "base", "--drafter-revision", "6c7242c"), "the 'base' profile has no DFlash drafter"),
])
def test_a_revision_that_cannot_apply_is_one_line_exit_2(capsys, artifact, extra, words):
    rc, _, err = _dry(capsys, artifact, *extra)
    assert rc == 2 and words in err and err.count("\n") <= 2 and "Traceback" not in err, err


def test_a_revision_for_a_drafter_folder_is_refused(capsys, artifact, tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    rc, _, err = _dry(capsys, artifact, "--profile", "dense", "--drafter", str(folder), "--drafter-revision", "abc1234")
    assert rc == 2 and f"the drafter {folder} is a folder" in err, err


def _recipe_with(tmp_path, **speculative) -> str:
    data = load_recipe("qwen3.5-122b-a10b").model_dump(mode="json")
    spec = data["serve"]["profiles"]["dense"]["speculative"]
    spec.pop("revision")
    spec.update(speculative)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_a_recipe_whose_hub_drafter_names_no_revision_is_refused(capsys, artifact, tmp_path):
    path = _recipe_with(tmp_path)
    rc = main(["serve", str(artifact), "--recipe", path, "--profile", "dense", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and f"the DFlash drafter {DRAFTER} names no revision" in err, err
    assert "Traceback" not in err


def test_revision_null_is_served_at_main_and_said(capsys, artifact, tmp_path):
    path = _recipe_with(tmp_path, revision=None)
    rc = main(["serve", str(artifact), "--recipe", path, "--profile", "dense", "--dry-run", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and "revision" not in _spec(plan)
    assert any(n.startswith(f"drafter: {DRAFTER} at the Hub's main, which moves (the 'dense' profile pins none)")
               for n in plan["notes"]), plan["notes"]

