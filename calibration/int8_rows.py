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


GPTQ_OFFSET_WORD = -0x7F7F7F80  # 0x80808080 as int32: XOR flips each byte's top bit, i.e. code + 128


class RowChunkQuantizer:
    """``quantize_int8_rows`` for a large weight fed in row chunks, fused for speed, with the
    codes already in the stored byte layout and the error metrics of what is stored.

    Same codes and scales as ``quantize_int8_rows`` (tests check it bit for bit), in fewer passes
    over memory: the absmax from one max and one min pass (no ``abs`` copy), one division chain
    into a reused buffer, codes + 128 by flipping each byte's top bit on int32 words, the error
    ``q * s - w`` in two in-place passes and its dot products (w.w, w.e, e.e) from one batched
    2 x 2 Gram product per row. ``scale_dtype`` is how the scales are stored (float16 for GPTQ):
    the error is measured against the rounded scales. Chunks should be a few thousand rows or
    fewer so that the buffers stay in cache."""

    def __init__(self, k: int, max_rows: int, scale_dtype: torch.dtype = torch.float32) -> None:
        if k % 4:
            raise ValueError(f"int8 row packing needs K divisible by 4, got {k}")
        from .metrics import StreamingMetrics

        self.k, self.max_rows, self.scale_dtype = k, max_rows, scale_dtype
        self._x = torch.empty(2, max_rows * k)  # row 0: the weight in float32, row 1: the error
        self._q = torch.empty(max_rows, k)
        self.metrics = StreamingMetrics()

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [R, K] (any float dtype, R <= max_rows) -> (words int32 [R, K/4]: the bytes
        ``code + 128`` row-major, low byte first; stored scales [R] in ``scale_dtype``)."""
        r, k = rows.shape
        if k != self.k or r > self.max_rows:
            raise ValueError(f"chunk of shape {tuple(rows.shape)} does not fit [{self.max_rows}, {self.k}]")
        x = self._x[:, : r * k]
        w, err = x[0].view(r, k), x[1].view(r, k)
        w.copy_(rows)
        absmax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_())
        scale = (absmax / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
        qf = torch.div(w, scale[:, None], out=self._q[:r]).round_().clamp_(-QMAX, QMAX)
        codes = qf.to(torch.int8)
        stored = scale.to(self.scale_dtype)
        # the error of the float32 dequantized weight, as a reader computes it: q*s rounded, then
        # minus w (exact: the two are close); a fused multiply-add would skip that rounding
        torch.mul(qf, stored.float()[:, None], out=err).sub_(w)
        # [[w.w, w.e], [w.e, e.e]] row by row (float32 sums over K only), then summed in float64:
        # ~1e-7 relative, where one float32 dot over a whole chunk errs by ~1e-4
        xr = x.view(2, r, k)
        gram = torch.bmm(xr.transpose(0, 1), xr.permute(1, 2, 0)).double().sum(0)
        lo, hi = torch.aminmax(err)
        self.metrics.update_sums(float(gram[0, 0]), float(gram[1, 1]), float(gram[0, 1]),
                                 max(float(hi), -float(lo)))
        words = codes.view(torch.int32).bitwise_xor_(GPTQ_OFFSET_WORD) if _LITTLE else _words_be(codes)
        return words, stored


_LITTLE = __import__("sys").byteorder == "little"


def _words_be(codes: torch.Tensor) -> torch.Tensor:
    from .gptq import _pack_le

    return _pack_le((codes.to(torch.int16) + 128).to(torch.uint8))
