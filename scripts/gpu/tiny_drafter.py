"""A random-weight DFlash drafter shaped for a target checkpoint (wiring test, not acceptance).

vLLM 0.25.1 reads a DFlash drafter as a Qwen3 config with ``architectures: [DFlashDraftModel]``
and a ``dflash_config`` (``mask_token_id``, ``target_layer_ids``); its ``fc`` projects the
concatenated target hidden states of those layers. Embedding and lm-head are not shipped: vLLM
shares the target's, as with the published DFlash drafters.

    python scripts/gpu/tiny_drafter.py TARGET_FOLDER OUT_FOLDER
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def build(target: Path, out: Path, layers: int = 1, seed: int = 0) -> Path:
    cfg = json.loads((target / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    h, n_layers = tc["hidden_size"], tc["num_hidden_layers"]
    heads, kv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc.get("head_dim", 64)
    inter = 2 * h
    taps = sorted({max(0, n_layers // 2 - 1), n_layers - 1})  # two target layers feed the drafter
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"fc.weight": w(h, h * len(taps)), "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
          "norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(heads * hd, h), p + "self_attn.k_proj.weight": w(kv * hd, h),
                   p + "self_attn.v_proj.weight": w(kv * hd, h), p + "self_attn.o_proj.weight": w(h, heads * hd),
                   p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                   p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                   p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                   p + "mlp.down_proj.weight": w(h, inter),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": hd, "vocab_size": tc["vocab_size"], "hidden_act": "silu",
              "rms_norm_eps": tc.get("rms_norm_eps", 1e-6),
              "max_position_embeddings": tc.get("max_position_embeddings", 4096),
              "rope_theta": 1000000, "attention_bias": False, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "block_size": 4, "target_hidden_size": h,
              "dflash_config": {"mask_token_id": tc["vocab_size"] - 1, "target_layer_ids": taps}}
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
