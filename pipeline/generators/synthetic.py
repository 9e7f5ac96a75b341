"""Synthetic checkpoints with the real model's layout: every name, dtype and shape, from a config.

The real input (Intel's INT4 AutoRound Qwen3.5-122B-A10B) is 62 GB; ``plan`` and ``inspect`` only
need its headers. ``synthetic_tensors`` derives the full tensor list from a config (auto-round
``auto_round:auto_gptq`` INT4 for the routed experts, attention and the big DeltaNet projections;
BF16 for the rest; MTP in BF16 in ``model_extra_tensors.safetensors``), and
``write_synthetic_checkpoint`` writes it as a checkpoint folder: either sparse (real headers, the
data a hole that costs no disk and reads as zeros) or with random data, optionally keeping only
some decoder layers so a GPU test gets a loadable model with the real widths.

Widths come from docs (FACTS.md); values marked "assumed" below were not read from the real
config.json and do not affect byte counts.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hybrid_build.core.errors import ArtifactError, UserError
from hybrid_build.core.safetensors_io import (
    OutTensor,
    ShardPlan,
    plan_shards,
    tensor_nbytes,
    write_index,
    write_shard,
    write_text_atomic,
)

log = logging.getLogger(__name__)

MTP_FILE = "model_extra_tensors.safetensors"
GROUP_SIZE = 128
INT4_ZERO_WORD = 0x77777777  # symmetric auto_gptq: stored zero-1 = 7 in every nibble

QWEN35_122B_TEXT_CONFIG: dict = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 3072,
    "num_hidden_layers": 48,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
    "full_attention_interval": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "bfloat16",
    "use_cache": True,
    # assumed (not read from the real file; no byte count depends on them)
    "max_position_embeddings": 262144,
    "mamba_ssm_dtype": "float32",
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
}
# transformers' qwen3_5_moe vision defaults, projecting into the 3072-wide text model (assumed)
QWEN35_VISION_CONFIG: dict = {
    "model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "out_hidden_size": 3072, "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
}


def qwen35_122b_config(compact_extra_config: bool = False) -> dict:
    """config.json of the VL form of Intel's checkpoint, with its auto-round quantization_config
    (see ``autoround_quantization_config`` for ``compact_extra_config``)."""
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "text_config": copy.deepcopy(QWEN35_122B_TEXT_CONFIG),
        "vision_config": copy.deepcopy(QWEN35_VISION_CONFIG),
    }
    cfg["quantization_config"] = autoround_quantization_config(cfg, compact_extra_config)
    return cfg


# Qwen3.5-397B-A17B's text config. Every width below was read from public copies of the real
# config.json / model definition, not guessed:
# - hidden 4096, 60 layers, 32 q / 2 kv heads of 256 with the output gate, 512 routed experts,
#   top-10, moe_intermediate 1024, one shared expert of 1024 with its sigmoid gate, vocab 248,320,
#   untied head, partial rotary 0.25, rope theta 1e7: THUDM/slime scripts/models/qwen3.5-397B-A17B.sh
#   (its Megatron arguments for this model), and the same numbers in two independent model-metadata
#   tables of other projects;
# - full attention every 4th layer, top-10 of 512 plus one shared expert, MTP: SGLang's
#   Qwen3.5-397B-A17B deployment docs;
# - Gated DeltaNet 16 key / 64 value heads of 128, conv kernel 4: a gated-delta-rule walkthrough that
#   quotes huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/config.json, and the same in two
#   converters' hard-coded configs for this model;
# - one MTP layer: a public MTP-extraction script counts 1553 MTP tensors in the BF16 release, which
#   is exactly one full-attention layer with 512 experts (512 x 3 + 3 shared + gate + shared gate +
#   4 attention + 2 q/k norms + 2 layer norms) plus mtp.fc and its 3 norms.
# The rest is the 122B's (same family, same model_type), marked assumed where no byte count
# depends on it.
QWEN35_397B_TEXT_CONFIG: dict = dict(
    copy.deepcopy(QWEN35_122B_TEXT_CONFIG),
    hidden_size=4096,
    num_hidden_layers=60,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(60)],
    num_experts=512,
    num_experts_per_tok=10,
)


def qwen35_397b_config(compact_extra_config: bool = True) -> dict:
    """config.json of an Intel-style INT4 AutoRound Qwen3.5-397B-A17B (VL form), widths as
    ``QWEN35_397B_TEXT_CONFIG`` says where they come from. The vision tower is the 122B's
    (assumed: its widths are not read from the real file) projecting into 4096. ``compact``
    defaults to True: the ~280k tensors of this model make the per-layer keys slow to match."""
    cfg = qwen35_122b_config()
    cfg.pop("quantization_config")
    cfg["text_config"] = copy.deepcopy(QWEN35_397B_TEXT_CONFIG)
    cfg["vision_config"]["out_hidden_size"] = QWEN35_397B_TEXT_CONFIG["hidden_size"]
    cfg["quantization_config"] = autoround_quantization_config(cfg, compact_extra_config)
    return cfg


def autoround_quantization_config(config: dict, compact: bool = False) -> dict:
    """Intel-style auto-round config: INT4 g128 sym, with the 16-bit layers in ``extra_config``
    (router and shared experts as regex keys, in_proj_a/b and shared_expert_gate per layer).
    ``compact`` writes three regex keys with the same meaning instead of ~170 keys: header
    readers try every key on every module, which costs ~30 s on the 112k tensors of the 122B."""
    tc = config.get("text_config") or config
    vl = "text_config" in config
    prefix = "model.language_model.layers" if vl else "model.layers"
    esc = prefix.replace(".", r"\.")
    extra: dict[str, dict] = {}
    if compact:
        extra = {rf".*{esc}\.\d+\.mlp\.gate.*": {"bits": 16, "data_type": "float"},
                 r".*shared_expert\..*": {"bits": 16, "data_type": "float"},
                 rf".*{esc}\.\d+\.(linear_attn\.in_proj_[ab]|mlp\.shared_expert_gate)": {"bits": 16, "data_type": "fp"}}
        return _autoround(prefix, extra)
    for i in range(tc["num_hidden_layers"]):
        extra[rf".*{esc}\.{i}\.mlp\.gate.*"] = {"bits": 16, "data_type": "float"}
    extra[r".*shared_expert\..*"] = {"bits": 16, "data_type": "float"}
    for i, kind in enumerate(_layer_types(tc)):
        if kind == "linear_attention":
            for p in ("in_proj_a", "in_proj_b"):
                extra[f"{prefix}.{i}.linear_attn.{p}"] = {"bits": 16, "data_type": "fp"}
        extra[f"{prefix}.{i}.mlp.shared_expert_gate"] = {"bits": 16, "data_type": "fp"}
    return _autoround(prefix, extra)


def _autoround(prefix: str, extra: dict) -> dict:
    return {"quant_method": "auto-round", "bits": 4, "group_size": GROUP_SIZE, "sym": True, "data_type": "int",
            "packing_format": "auto_round:auto_gptq", "block_name_to_quantize": prefix, "extra_config": extra}


def _layer_types(tc: dict) -> list[str]:
    n = tc["num_hidden_layers"]
    types = tc.get("layer_types")
    if types:
        if len(types) != n:
            raise UserError(f"config: layer_types has {len(types)} entries for {n} layers")
        return list(types)
    interval = tc.get("full_attention_interval") or 4
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


@dataclass(frozen=True)
class SyntheticTensor:
    """One tensor to write: name, safetensors dtype, shape, and what its data should look like."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    init: str  # "qweight" | "qzeros" | "scales" | "normal" | "zeros" | "ones" | "a_log"
    mtp: bool = False

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def _int4(module: str, n: int, k: int) -> list[SyntheticTensor]:
    """auto_gptq packing of a [n, k] linear: qweight [k/8, n], qzeros [k/g, n/8], scales [k/g, n]."""
    if k % 8 or n % 8:
        raise UserError(f"{module}: INT4 packing needs both dims divisible by 8, shape is {n}x{k}")
    groups = math.ceil(k / GROUP_SIZE)
    return [SyntheticTensor(f"{module}.qweight", "I32", (k // 8, n), "qweight"),
            SyntheticTensor(f"{module}.qzeros", "I32", (groups, n // 8), "qzeros"),
            SyntheticTensor(f"{module}.scales", "F16", (groups, n), "scales")]


def _bf16(module: str, n: int, k: int, mtp: bool = False) -> list[SyntheticTensor]:
    return [SyntheticTensor(f"{module}.weight", "BF16", (n, k), "normal", mtp)]


def _vec(name: str, n: int, init: str, mtp: bool = False) -> SyntheticTensor:
    return SyntheticTensor(name, "BF16", (n,), init, mtp)


def _decoder_layer(p: str, kind: str, tc: dict, quantized: bool, mtp: bool = False) -> list[SyntheticTensor]:
    """One decoder layer under prefix ``p`` (ending in a dot). ``quantized`` False gives the BF16
    form Intel keeps for the MTP layer."""
    h = tc["hidden_size"]
    lin = (lambda m, n, k: _int4(m, n, k)) if quantized else (lambda m, n, k: _bf16(m, n, k, mtp))
    out: list[SyntheticTensor] = [_vec(p + "input_layernorm.weight", h, "zeros", mtp),
                                  _vec(p + "post_attention_layernorm.weight", h, "zeros", mtp)]
    if kind == "full_attention":
        heads, kv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
        q_rows = heads * hd * (2 if tc.get("attn_output_gate", True) else 1)
        out += lin(p + "self_attn.q_proj", q_rows, h) + lin(p + "self_attn.k_proj", kv * hd, h)
        out += lin(p + "self_attn.v_proj", kv * hd, h) + lin(p + "self_attn.o_proj", h, heads * hd)
        out += [_vec(p + "self_attn.q_norm.weight", hd, "zeros", mtp),
                _vec(p + "self_attn.k_norm.weight", hd, "zeros", mtp)]
    elif kind == "linear_attention":
        nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        conv = 2 * nk * dk + nv * dv
        a = p + "linear_attn."
        out += lin(a + "in_proj_qkv", conv, h) + lin(a + "in_proj_z", nv * dv, h) + lin(a + "out_proj", h, nv * dv)
        out += _bf16(a + "in_proj_a", nv, h, mtp) + _bf16(a + "in_proj_b", nv, h, mtp)
        conv_kernel = tc.get("linear_conv_kernel_dim", 4)
        out += [SyntheticTensor(a + "conv1d.weight", "BF16", (conv, 1, conv_kernel), "normal", mtp),
                _vec(a + "A_log", nv, "a_log", mtp), _vec(a + "dt_bias", nv, "ones", mtp),
                _vec(a + "norm.weight", dv, "ones", mtp)]
    else:
        raise UserError(f"config: unknown layer type {kind!r}")
    e, inter, shared = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
    m = p + "mlp."
    out += _bf16(m + "gate", e, h, mtp)
    for j in range(e):
        x = f"{m}experts.{j}."
        out += lin(x + "gate_proj", inter, h) + lin(x + "up_proj", inter, h) + lin(x + "down_proj", h, inter)
    out += _bf16(m + "shared_expert.gate_proj", shared, h, mtp) + _bf16(m + "shared_expert.up_proj", shared, h, mtp)
    out += _bf16(m + "shared_expert.down_proj", h, shared, mtp) + _bf16(m + "shared_expert_gate", 1, h, mtp)
    return out


def _vision(vc: dict) -> list[SyntheticTensor]:
    d, inter, c = vc["hidden_size"], vc["intermediate_size"], vc.get("in_channels", 3)
    merged = d * vc.get("spatial_merge_size", 2) ** 2
    v = "model.visual."
    out = [SyntheticTensor(v + "patch_embed.proj.weight", "BF16",
                           (d, c, vc.get("temporal_patch_size", 2), vc["patch_size"], vc["patch_size"]), "normal"),
           _vec(v + "patch_embed.proj.bias", d, "zeros"),
           SyntheticTensor(v + "pos_embed.weight", "BF16", (vc["num_position_embeddings"], d), "normal")]
    for i in range(vc["depth"]):
        b = f"{v}blocks.{i}."
        out += [_vec(b + "norm1.weight", d, "ones"), _vec(b + "norm1.bias", d, "zeros"),
                _vec(b + "norm2.weight", d, "ones"), _vec(b + "norm2.bias", d, "zeros")]
        out += _bf16(b + "attn.qkv", 3 * d, d) + [_vec(b + "attn.qkv.bias", 3 * d, "zeros")]
        out += _bf16(b + "attn.proj", d, d) + [_vec(b + "attn.proj.bias", d, "zeros")]
        out += _bf16(b + "mlp.linear_fc1", inter, d) + [_vec(b + "mlp.linear_fc1.bias", inter, "zeros")]
        out += _bf16(b + "mlp.linear_fc2", d, inter) + [_vec(b + "mlp.linear_fc2.bias", d, "zeros")]
    out += [_vec(v + "merger.norm.weight", d, "ones"), _vec(v + "merger.norm.bias", d, "zeros")]
    out += _bf16(v + "merger.linear_fc1", merged, merged) + [_vec(v + "merger.linear_fc1.bias", merged, "zeros")]
    out += _bf16(v + "merger.linear_fc2", vc["out_hidden_size"], merged)
    out += [_vec(v + "merger.linear_fc2.bias", vc["out_hidden_size"], "zeros")]
    return out


def synthetic_tensors(config: dict) -> list[SyntheticTensor]:
    """Every tensor of an Intel-style INT4 AutoRound checkpoint of ``config`` (VL or text-only form)."""
    tc = config.get("text_config") or config
    vl = "text_config" in config
    lm = "model.language_model." if vl else "model."
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    out = _bf16("lm_head", vocab, h) if not tc.get("tie_word_embeddings") else []
    out += [SyntheticTensor(lm + "embed_tokens.weight", "BF16", (vocab, h), "normal")]
    for i, kind in enumerate(_layer_types(tc)):
        out += _decoder_layer(f"{lm}layers.{i}.", kind, tc, quantized=True)
    out.append(_vec(lm + "norm.weight", h, "zeros"))
    if vl and config.get("vision_config"):
        out += _vision(config["vision_config"])
    for j in range(tc.get("mtp_num_hidden_layers", 0) or 0):
        out += _decoder_layer(f"mtp.layers.{j}.", "full_attention", tc, quantized=False, mtp=True)
    if tc.get("mtp_num_hidden_layers"):
        out += _bf16("mtp.fc", h, 2 * h, mtp=True)
        out += [_vec(f"mtp.{n}.weight", h, "zeros", mtp=True)
                for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")]
    return out


def select_layers(config: dict, layers: Iterable[int]) -> dict:
    """A copy of ``config`` keeping only decoder ``layers`` (renumbered from 0, types kept)."""
    cfg = copy.deepcopy(config)
    tc = cfg.get("text_config") or cfg
    types = _layer_types(tc)
    keep = sorted(set(layers))
    if not keep or keep[0] < 0 or keep[-1] >= len(types):
        raise UserError(f"layers {list(layers)}: choose indices in 0..{len(types) - 1}")
    tc["layer_types"] = [types[i] for i in keep]
    tc["num_hidden_layers"] = len(keep)
    tc.pop("full_attention_interval", None)
    if "quantization_config" in cfg:
        # the per-layer keys name layer numbers, so rebuild them for the kept layers
        extra = cfg["quantization_config"].get("extra_config") or {}
        compact = not any(re.search(r"layers\\?\.\d", k) for k in extra)
        cfg["quantization_config"] = autoround_quantization_config(cfg, compact)
    return cfg


# ----------------------------------------------------------------------------- data


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF


def _random_bytes(t: SyntheticTensor, seed: int, chunk_elems: int = 1 << 22) -> Iterator[bytes]:
    """Plausible random data in bounded chunks: dequantized INT4 weights and BF16 weights both
    have std ~0.02 (a nibble in 0..15 minus 8 has std ~4.6, hence scales of 0.02/4.6)."""
    import numpy as np

    rng = np.random.default_rng(_seed_for(seed, t.name))
    numel = math.prod(t.shape)
    for lo in range(0, numel, chunk_elems):
        n = min(chunk_elems, numel - lo)
        if t.init == "qweight":
            yield rng.integers(0, 1 << 32, n, dtype=np.uint32).tobytes()
        elif t.init == "qzeros":
            yield np.full(n, INT4_ZERO_WORD, dtype=np.uint32).tobytes()
        elif t.init == "scales":
            yield (rng.uniform(0.5, 1.5, n) * (0.02 / 4.6)).astype(np.float16).tobytes()
        else:
            if t.init == "normal":
                x = rng.standard_normal(n, dtype=np.float32) * 0.02
            elif t.init == "a_log":
                x = np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
            else:
                x = np.full(n, 1.0 if t.init == "ones" else 0.0, dtype=np.float32)
            yield (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # float32 -> bf16 by truncation


def _write_sparse(plan: ShardPlan, out_dir: Path) -> Path:
    """Real header, data left as a hole: the file has its full size but no blocks behind it."""
    final = out_dir / plan.filename
    tmp = final.with_name(final.name + ".partial")
    head = plan.header_bytes()
    with open(tmp, "wb") as f:
        f.write(head)
        f.truncate(len(head) + plan.data_bytes)
    used = os.stat(tmp).st_blocks * 512
    if plan.data_bytes > (64 << 20) and used > len(head) + (16 << 20):
        tmp.unlink()
        raise ArtifactError(f"{out_dir}: this filesystem does not keep sparse files "
                            f"({used} bytes allocated for {plan.filename}); use another folder")
    os.replace(tmp, final)
    return final


def write_synthetic_checkpoint(out_dir: str | os.PathLike, config: dict | None = None,
                               layers: Iterable[int] | None = None, sparse: bool = True, seed: int = 0,
                               max_shard_bytes: int = 5_000_000_000, index_mtp: bool = False,
                               tensors: list[SyntheticTensor] | None = None) -> Path:
    """Write an auto-round-style INT4 checkpoint folder for ``config`` (default: the real 122B).

    ``layers`` keeps only those decoder layers (renumbered; the config says so). ``sparse`` leaves
    all data as holes (header-only use: plan, inspect); otherwise random data is written, which
    for the full 122B is ~70 GB. MTP tensors go to ``model_extra_tensors.safetensors``, listed in
    the index only with ``index_mtp`` (Intel's upload may not list them). ``tensors`` overrides
    the derived tensor list (for hand-made variants, e.g. a hybrid's headers)."""
    config = copy.deepcopy(config) if config is not None else qwen35_122b_config()
    if layers is not None:
        config = select_layers(config, layers)
    if tensors is None:
        tensors = synthetic_tensors(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.glob("*.safetensors")):
        raise UserError(f"{out_dir}: already holds safetensors files")

    def out_tensor(t: SyntheticTensor) -> OutTensor:
        return OutTensor(t.name, t.dtype, t.shape, lambda t=t: _random_bytes(t, seed))

    main = plan_shards([out_tensor(t) for t in tensors if not t.mtp], max_shard_bytes)
    shards = list(main)
    mtp = [out_tensor(t) for t in tensors if t.mtp]
    if mtp:
        shards.append(ShardPlan(MTP_FILE, mtp, in_index=index_mtp))
    for plan in shards:
        if sparse:
            _write_sparse(plan, out_dir)
        else:
            log.info("writing %s (%.2f GB)", plan.filename, plan.data_bytes / 1e9)
            write_shard(plan, out_dir)
    qc = config.get("quantization_config")
    write_text_atomic(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    if qc:
        write_text_atomic(out_dir / "quantization_config.json", json.dumps(qc, indent=2) + "\n")
    write_index(out_dir, shards)
    return out_dir
