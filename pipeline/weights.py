"""Load one module's weight from any checkpoint this tool reads or writes, dequantized to float32.

Storage is recognised from the module's parts: plain ``weight`` (BF16/FP16/FP32), FP8 block
(``weight`` F8 + ``weight_scale_inv`` or compressed-tensors ``weight_scale``), GPTQ
(``qweight``/``qzeros``/``scales``, 4- or 8-bit by the quantization config), int8 per-row
(``weight`` I8 + ``weight_scale``) and compressed-tensors ``pack-quantized`` INT4. Tensors are read
one at a time through ``safetensors.safe_open`` (memory-mapped), so memory is one module's worth.
"""
from __future__ import annotations

import torch
from safetensors import safe_open

from hybrid_build.calibration.fp8_block import dequantize_fp8_block
from hybrid_build.calibration.gptq import dequantize_gptq, unpack_codes
from hybrid_build.calibration.int8_rows import dequantize_int8_rows

from .checkpoint import Checkpoint
from .errors import ArtifactError


def read_tensor(ckpt: Checkpoint, name: str) -> torch.Tensor:
    t = ckpt.tensors.get(name)
    if t is None:
        raise ArtifactError(f"{name}: not in the checkpoint")
    with safe_open(str(ckpt.path_of(t)), framework="pt") as f:
        return f.get_tensor(name)


def read_rows(ckpt: Checkpoint, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a tensor, without reading the rest."""
    t = ckpt.tensors[name]
    with safe_open(str(ckpt.path_of(t)), framework="pt") as f:
        return f.get_slice(name)[start:stop]


def module_storage(ckpt: Checkpoint, module: str) -> str:
    parts = ckpt.modules.get(module)
    if not parts:
        raise ArtifactError(f"{module}: no tensors for this module")
    return next(iter(parts.values())).storage


def load_weight(ckpt: Checkpoint, module: str) -> torch.Tensor:
    """The module's weight [N, K] in float32, whatever its storage."""
    parts = ckpt.modules.get(module)
    if not parts:
        raise ArtifactError(f"{module}: no tensors for this module")
    if "qweight" in parts:
        bits = ckpt.quant.module_bits(module) or 4
        override = ckpt.quant.layer_override(module) or {}
        group = override.get("group_size", ckpt.quant.group_size or 128)
        return dequantize_gptq(read_tensor(ckpt, module + ".qweight"), read_tensor(ckpt, module + ".scales"),
                               bits, group)
    if "weight_packed" in parts:  # compressed-tensors pack-quantized (sym: codes offset by 2^(bits-1))
        bits = ckpt.quant.module_bits(module) or 4
        packed = read_tensor(ckpt, module + ".weight_packed")
        scale = read_tensor(ckpt, module + ".weight_scale").float()
        codes = unpack_codes(packed.t().contiguous(), bits).t().float() - (1 << (bits - 1))  # [N, K]
        g = codes.shape[1] // scale.shape[1]
        return codes * scale.repeat_interleave(g, 1)
    w = read_tensor(ckpt, module + ".weight")
    if w.dtype == torch.float8_e4m3fn:
        key = "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"
        return dequantize_fp8_block(w, read_tensor(ckpt, f"{module}.{key}"))
    if w.dtype == torch.int8:
        return dequantize_int8_rows(w, read_tensor(ckpt, module + ".weight_scale"))
    return w.float()
