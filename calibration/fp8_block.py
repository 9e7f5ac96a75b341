"""BF16 -> FP8 E4M3 with one scale per [128, 128] block, as Qwen's FP8 checkpoints store it.

``weight_scale_inv`` is a multiplier: ``w ~= fp8 * scale_inv`` with ``scale_inv = block absmax /
448`` under the min-max observer. Ragged edges (N or K not a multiple of 128) get partial blocks.

The ``minmax`` observer is computed here with plain torch: it is llm-compressor's memoryless
min-max observer followed by compressed-tensors' ``calculate_qparams`` and ``quantize``, step for
step (tests/calibration check equal scales and equal FP8 bits), without importing either library
(their imports pull in transformers: ~4.4 s of start-up on the development machine). ``mse`` goes through
llm-compressor's observer.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_F32_EPS = torch.finfo(torch.float32).eps  # calculate_qparams' replacement for a zero scale


def fp8_block_args(block: int = BLOCK):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[block, block],
                            symmetric=True, dynamic=False)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-padded view [N/b, b, K/b, b] of ``w`` (padding does not change a block's absmax)."""
    n, k = w.shape
    pn, pk = -n % block, -k % block
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w.view(w.shape[0] // block, block, w.shape[1] // block, block)


def quantize_fp8_block_minmax(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Memoryless min-max FP8 block quantization of a float32 [N, K] weight, in plain torch.

    Same arithmetic as llm-compressor + compressed-tensors: scale = max(|min|, |max|) of the block
    (with 0 always in range) / 448, a zero scale replaced by float32 eps, codes = clamp(w / scale
    + 0, -448, 448) cast to E4M3 (the ``+ 0`` is their zero point; it turns -0.0 into +0.0)."""
    n, k = w.shape
    b = _blocks(w, block)
    scale = torch.maximum(b.amax(dim=(1, 3)), b.amin(dim=(1, 3)).neg_()).div_(FP8_MAX)  # = |w| max, no copy
    scale = torch.where(scale == 0, torch.tensor(_F32_EPS, dtype=scale.dtype), scale)
    q = torch.div(b, scale[:, None, :, None]).add_(0.0).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(b.shape[0] * block, b.shape[2] * block)[:n, :k]
    return (q if q.is_contiguous() else q.contiguous()), scale


def quantize_fp8_block(weight: torch.Tensor, observer: str = "minmax",
                       block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (``float8_e4m3fn`` [N, K], float32 ``scale_inv`` [ceil(N/block), ceil(K/block)])."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()  # float32 in -> float32 scales out
    if observer == "minmax":
        return quantize_fp8_block_minmax(w, block)
    return quantize_fp8_block_observed(w, observer, block)


def quantize_fp8_block_observed(w: torch.Tensor, observer: str,
                                block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Through llm-compressor's observer registry and compressed-tensors' ``quantize`` (any observer)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from .observers import observe

    args = fp8_block_args(block)
    qp = observe(w.float(), args, observer)
    scale = qp["scale"].float()
    q = quantize(w.float(), scale, qp["zero_point"], args, dtype=torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weight from FP8 codes and per-block multipliers (any N, K)."""
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s

