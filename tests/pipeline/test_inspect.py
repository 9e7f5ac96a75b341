"""`hybrid-build inspect` on the real tiny checkpoint, and each kind of broken input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_build.pipeline.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_json_classifies_the_fixture(tiny_checkpoint, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    code, out, err = run_cli(capsys, "inspect", str(tiny_checkpoint), "--json")
    assert code == 0, err
    data = json.loads(out)
    jsonschema.validate(data, json.loads((ROOT / "docs" / "inspect.schema.json").read_text()))
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    layers = cfg["num_hidden_layers"]
    by_class = {}
    for t in data["tensors"]:
        by_class.setdefault(t["class"], []).append(t)
    shared = by_class["shared_expert"]
    assert len(shared) == 3 * layers and {t["storage"] for t in shared} == {"bf16"}
    assert {t["storage"] for t in by_class["routed_expert"]} == {"int4"}
    assert len(by_class["routed_expert"]) == layers * cfg["num_experts"] * 3 * 3  # qweight, qzeros, scales
    assert {t["storage"] for t in by_class["attention"]} == {"int4"}
    for klass in ("router", "shared_expert_gate", "embedding", "lm_head"):
        assert {t["storage"] for t in by_class[klass]} == {"bf16"}, klass
    mtp = by_class["mtp"]
    assert mtp and all(t["file"] == "model_extra_tensors.safetensors" and not t["in_index"] for t in mtp)
    assert any(p["code"] == "unindexed_file" for p in data["problems"])
    # class totals agree with the tensor list
    for klass, stats in data["classes"].items():
        assert stats["count"] == len(by_class.get(klass, []))
        assert stats["bytes"] == sum(t["bytes"] for t in by_class.get(klass, []))
    # per-token bytes: experts scaled by top-k / E, one embedding row
    experts = data["classes"]["routed_expert"]["bytes"]
    assert data["bytes_per_token"]["routed_expert"] == round(experts * cfg["num_experts_per_tok"] / cfg["num_experts"])
    assert data["bytes_per_token"]["embedding"] == data["classes"]["embedding"]["bytes"] // cfg["vocab_size"]
    assert data["bytes_per_token"]["mtp"] == 0
    conv = data["conversion"]
    assert sum(c["kind"] == "fp8" for c in conv["conversions"]) == 3 * layers
    assert [c["module"] for c in conv["conversions"] if c["kind"] == "int8"] == ["lm_head"]
    assert conv["bytes_per_token_after"] < data["bytes_per_token_total"]


def test_inspect_text_report(tiny_checkpoint, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(tiny_checkpoint))
    assert code == 0
    assert "shared_expert" in out and "bf16 x12" in out and "FP8 block-128" in out


def _damage_truncated_header(d: Path):
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:200])


def _damage_missing_shard(d: Path):
    sorted(d.glob("model-*.safetensors"))[1].unlink()


def _damage_not_safetensors(d: Path):
    (d / "notes.safetensors").write_text("this is a text file, not tensors\n")


def _damage_missing_config(d: Path):
    (d / "config.json").unlink()


def _damage_config_is_a_list(d: Path):
    (d / "config.json").write_text("[1, 2]\n")


def _damage_config_wrong_type(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = "big"
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,needle", [
    (_damage_config_is_a_list, "expected a JSON object, found a list"),
    (_damage_config_wrong_type, "text_config.hidden_size must be a non-negative integer, found 'big'"),
    (_damage_truncated_header, "truncated"),
    (_damage_missing_shard, "does not exist"),
    (_damage_not_safetensors, "not a safetensors file"),
    (_damage_missing_config, "missing config.json"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_copy, capsys, damage, needle):
    damage(tiny_copy)
    code, _, err = run_cli(capsys, "inspect", str(tiny_copy))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_missing_path(capsys, tmp_path):
    code, _, err = run_cli(capsys, "inspect", str(tmp_path / "nope"))
    assert code == 2 and "no such file or directory" in err and len(err.strip().splitlines()) == 1


def test_duplicate_tensor_is_flagged(tiny_copy, capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(1024, 256, dtype=torch.bfloat16)}, tiny_copy / "extra.safetensors")
    code, out, err = run_cli(capsys, "inspect", str(tiny_copy), "--json")
    assert code == 2 and "lm_head.weight is stored in both" in err
    assert any(p["code"] == "duplicate_tensor" for p in json.loads(out)["problems"])


def test_bad_packing_is_flagged(tiny_copy, capsys):
    """A qweight whose K/8 rows disagree with the scale groups breaks the packing rules."""
    from safetensors.torch import load_file, save_file

    shard = next(p for p in sorted(tiny_copy.glob("model-*.safetensors"))
                 if any(k.endswith("experts.0.gate_proj.qweight") for k in load_file(p)))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("experts.0.gate_proj.qweight"))
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].clone()  # K halves, scale groups do not
    save_file(tensors, shard, metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "inspect", str(tiny_copy))
    assert code == 2 and "group_size" in err


def test_already_hybrid_is_a_warning(inc_artifact, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(inc_artifact), "--json")
    data = json.loads(out)
    assert code == 0 and any(p["code"] == "already_hybrid" for p in data["problems"])
    assert {t["storage"] for t in data["tensors"] if t["class"] == "shared_expert"} == {"fp8"}
    assert {t["storage"] for t in data["tensors"] if t["class"] == "lm_head"} == {"int8"}


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--help"])
    assert e.value.code == 0 and "examples:" in capsys.readouterr().out


@pytest.mark.parametrize("damage", [_damage_config_is_a_list, _damage_config_wrong_type])
def test_a_malformed_config_is_refused_before_run_writes_anything(tiny_copy, tmp_path, capsys, damage):
    damage(tiny_copy)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "run", str(tiny_copy), "-o", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
