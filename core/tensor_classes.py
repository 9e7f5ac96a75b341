"""What a tensor is: its class in the Qwen3.5-MoE layout and how it is stored.

Names are classified after stripping the language-model prefix (``model.language_model.`` in the
VL form, ``model.`` in the text-only form), so both forms give the same classes.
"""
from __future__ import annotations

import re

CLASSES = (
    "routed_expert", "attention", "linear_attention", "shared_expert", "shared_expert_gate",
    "router", "lm_head", "embedding", "norm", "mtp", "vision", "other",
)
STORAGES = ("int4", "int8", "fp8", "bf16", "fp16", "fp32", "other")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def split_module(name: str) -> tuple[str, str]:
    """``a.b.c.qweight`` -> (``a.b.c``, ``qweight``)."""
    module, _, part = name.rpartition(".")
    return module, part


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m and not name.startswith("mtp.") else None


def classify(name: str) -> str:
    """The tensor's class (one of ``CLASSES``) from its name alone."""
    if name.startswith("mtp.") or ".mtp." in name:
        return "mtp"
    if name.startswith(("model.visual.", "visual.", "model.vision_tower.")):
        return "vision"
    if name.startswith("lm_head.") or ".lm_head." in name:
        return "lm_head"
    if "embed_tokens." in name:
        return "embedding"
    if ".mlp.experts." in name:
        return "routed_expert"
    if ".mlp.shared_expert_gate." in name:
        return "shared_expert_gate"
    if ".mlp.shared_expert." in name:
        return "shared_expert"
    if ".mlp.gate." in name:
        return "router"
    module, _ = split_module(name)
    if module.endswith("norm") or module.endswith("layernorm"):
        return "norm"
    if ".self_attn." in name:
        return "attention"
    if ".linear_attn." in name:
        return "linear_attention"
    return "other"


def module_storage(parts: dict[str, str], bits: int | None) -> str | None:
    """Storage shared by all parts of a quantized module (``parts``: part name -> dtype), or None
    for a plain module whose tensors are stored as their own dtype says."""
    if "qweight" in parts or "weight_packed" in parts:
        return "int8" if bits == 8 else "int4"
    weight = parts.get("weight", "")
    if weight.startswith("F8_"):
        return "fp8"
    if weight == "I8":
        return "int8"
    return None


def dtype_storage(dtype: str) -> str:
    if dtype.startswith("F8_"):
        return "fp8"
    if dtype == "I8":
        return "int8"
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(dtype, "other")


FLOAT_DTYPES = ("BF16", "F16", "F32")
# classes the build, validate and vLLM read only as floating point, in every scheme (source and
# artifact alike): a norm's weight and the shared expert's sigmoid gate are never quantized
FLOAT_ONLY = ("norm", "shared_expert_gate")


def dtype_problem(name: str, klass: str, dtype: str) -> str | None:
    """Why a tensor of class ``klass`` cannot be stored as ``dtype`` (one line naming it), or None."""
    if klass in FLOAT_ONLY and dtype not in FLOAT_DTYPES:
        what = "a norm" if klass == "norm" else "the shared expert gate"
        return (f"tensor {name} is {dtype}: {what} is stored as {', '.join(FLOAT_DTYPES)} (the build and vLLM "
                "read it as floating point)")
    return None

