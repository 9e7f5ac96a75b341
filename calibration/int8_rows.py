"""lm-head BF16 -> int8 weight-only, symmetric, one scale per output row.

The scale is ``row absmax / 127`` so codes stay in [-127, 127]: the symmetric range that GPTQ
8-bit (``uint8b128``: code + 128 in [1, 255]) and a plain int8 kernel both represent exactly.
compressed-tensors' own int8 channel scale is absmax / 127.5 with range [-128, 127], which a
zero-point-free 128-offset kernel would misread at -128, so the scale is computed here and the
rounding and clamping are left to compressed-tensors' ``quantize``.
"""
from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize

from .observers import observe

QMAX = 127


def int8_row_args() -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)


def quantize_int8_rows(weight: torch.Tensor, observer: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (int8 codes [N, K] in [-127, 127], float32 scales [N])."""
    if weight.dim() != 2:
        raise ValueError(f"int8 row quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    args = int8_row_args()
    stats = observe(w, args, observer)
    absmax = torch.maximum(stats["min_vals"].abs(), stats["max_vals"].abs()).reshape(-1)
    if observer == "mse":  # the MSE observer may clip: keep its range, re-based on 127 levels
        absmax = stats["scale"].reshape(-1).float() * 127.5
    scale = (absmax / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = quantize(w, scale[:, None], torch.zeros_like(scale[:, None], dtype=torch.int8), args, dtype=torch.int8)
    return q.clamp_(-QMAX, QMAX), scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().reshape(-1, 1)
