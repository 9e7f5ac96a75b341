"""The demo's DFlash drafter: a real tiny Qwen3 saved with z-lab's DFlash layout, beside the demo
source, which the tiny recipe's DFlash profiles name as ``{source}-dflash``."""
from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from hybrid_build.pipeline.generators.demo import build_demo_drafter, demo_drafter_path
from hybrid_build.recipes.profiles import DrafterSpec


@pytest.fixture(scope="module")
def drafter(tiny_checkpoint):
    path = demo_drafter_path(tiny_checkpoint)
    assert path.name == tiny_checkpoint.name + "-dflash" and path.parent == tiny_checkpoint.parent
    return path


def test_config_mirrors_z_labs_dflash_drafter(drafter, tiny_checkpoint):
    cfg = json.loads((drafter / "config.json").read_text())
    target = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    dflash = cfg["dflash_config"]
    assert set(dflash) >= {"block_size", "mask_token_id", "target_layer_ids"}
    assert dflash["target_layer_ids"] and all(0 <= i < target["num_hidden_layers"] for i in dflash["target_layer_ids"])
    # it reads the target's hidden states and uses the target's embeddings and head
    assert cfg["hidden_size"] == target["hidden_size"] and cfg["vocab_size"] == target["vocab_size"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert len(tokenizer) <= dflash["mask_token_id"] < target["vocab_size"], "the mask id must be a free embedding row"
    # non-causal drafting needs a non-causal layer: z-lab's mix of sliding and full attention
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}


def test_weights_are_a_qwen3_stack_with_dflash_fc_and_no_embeddings(drafter):
    from transformers import AutoConfig, Qwen3Config, Qwen3Model

    cfg = AutoConfig.from_pretrained(drafter)
    assert isinstance(cfg, Qwen3Config)
    stored = load_file(drafter / "model.safetensors")
    assert not any(k.startswith(("embed_tokens.", "lm_head.", "model.")) for k in stored)
    # vLLM's DFlash model: fc maps the target's hidden states at target_layer_ids to the hidden size
    n = len(cfg.dflash_config["target_layer_ids"])
    assert tuple(stored["fc.weight"].shape) == (cfg.hidden_size, cfg.hidden_size * n)
    assert tuple(stored["hidden_norm.weight"].shape) == (cfg.hidden_size,)
    model, info = Qwen3Model.from_pretrained(drafter, output_loading_info=True, dtype=torch.bfloat16)
    assert set(info["missing_keys"]) == {"embed_tokens.weight"}
    assert set(info["unexpected_keys"]) == {"fc.weight", "hidden_norm.weight"}
    state = model.state_dict()
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "norm.weight"):
        assert torch.equal(state[name], stored[name]), name
    assert stored["layers.0.self_attn.q_proj.weight"].float().std() > 0  # random, not empty


def test_rebuilding_replaces_a_drafter_but_not_a_foreign_folder(tmp_path):
    foreign = tmp_path / "x-dflash"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="does not hold a DFlash drafter"):
        build_demo_drafter(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    ours = tmp_path / "y-dflash"
    build_demo_drafter(ours, seed=1)
    first = load_file(ours / "model.safetensors")["fc.weight"]
    build_demo_drafter(ours, seed=2)
    assert not torch.equal(first, load_file(ours / "model.safetensors")["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-dflash", "y-dflash"]  # no temp folder left


def test_only_the_source_placeholder_is_allowed():
    assert DrafterSpec(method="dflash", model="{source}-dflash").model == "{source}-dflash"
    with pytest.raises(ValidationError, match="only placeholder"):
        DrafterSpec(method="dflash", model="{src}-dflash")
