"""lm-head BF16 -> int8 weight-only, symmetric, one scale per output row.

The scale is ``row absmax / 127`` so codes stay in [-127, 127]: the symmetric range that GPTQ
8-bit (``uint8b128``: code + 128 in [1, 255]) and a plain int8 kernel both represent exactly.
compressed-tensors' int8 channel scheme uses absmax / 127.5 with range [-128, 127], which a
zero-point-free 128-offset kernel would misread at -128, so this small transform is written
here rather than taken from it. It runs on row chunks of the 248,320-row head, in place where
it can, because it is the only part of `run` that touches every byte of a large tensor.
"""
from __future__ import annotations

import torch

QMAX = 127


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (int8 codes [N, K] in [-127, 127], float32 scales [N]); round half to even."""
    if weight.dim() != 2:
        raise ValueError(f"int8 row quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    scale = (w.abs().amax(dim=1) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.div(w, scale[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().reshape(-1, 1)
