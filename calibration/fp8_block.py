"""BF16 -> FP8 E4M3 with one scale per [128, 128] block, as Qwen's FP8 checkpoints store it.

``weight_scale_inv`` is a multiplier: ``w ~= fp8 * scale_inv`` with ``scale_inv = block absmax /
448`` under the min-max observer. Ragged edges (N or K not a multiple of 128) get partial blocks.
"""
from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

from .observers import observe

BLOCK = 128


def fp8_block_args(block: int = BLOCK) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[block, block],
                            symmetric=True, dynamic=False)


def quantize_fp8_block(weight: torch.Tensor, observer: str = "minmax",
                       block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (``float8_e4m3fn`` [N, K], float32 ``scale_inv`` [ceil(N/block), ceil(K/block)])."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()  # float32 in -> float32 scales out
    args = fp8_block_args(block)
    qp = observe(w, args, observer)
    scale = qp["scale"].float()
    q = quantize(w, scale, qp["zero_point"], args, dtype=torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weight from FP8 codes and per-block multipliers (any N, K)."""
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def dequantize_fp8_block_ct(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The same through compressed-tensors (used by tests to cross-check our own expansion)."""
    args = fp8_block_args(block)
    return dequantize(q, scale_inv, torch.zeros_like(scale_inv), args).float()
