"""GPTQ (auto_round:auto_gptq, symmetric) packing: INT4 unpack for dequantization, int8 pack for
the lm-head, and the bit-exact INT4 repack to compressed-tensors ``pack-quantized``.

Layout: ``qweight`` int32 [K * bits / 32, N] packs codes along the input dim K, low bits first;
``scales`` [K / g, N]; ``qzeros`` int32 [K / g, N * bits / 32] stores zero - 1 (GPTQ v1), so a
symmetric 4-bit checkpoint has every word 0x77777777 (zero 8) and 8-bit has 0x7f7f7f7f (zero 128).
"""
from __future__ import annotations

import torch

SYM_ZERO_WORD = {4: 0x77777777, 8: 0x7F7F7F7F}


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K*bits/32, N] -> unsigned codes int32 [K, N]."""
    per = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    codes = (qweight.to(torch.int32).unsqueeze(1) >> shifts.view(1, per, 1)) & mask
    return codes.reshape(qweight.shape[0] * per, qweight.shape[1])


def dequantize_gptq(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Symmetric GPTQ -> float32 W [N, K]: ``W[n, k] = (code - 2^(bits-1)) * s[k // g, n]``."""
    codes = unpack_codes(qweight, bits).float() - (1 << (bits - 1))
    k = codes.shape[0]
    g = k if group_size in (-1, 0, None) else group_size
    s = scales.float().repeat_interleave(g, 0)[:k]
    return (codes * s).t().contiguous()


def zeros_are_symmetric(qzeros: torch.Tensor, bits: int) -> bool:
    return bool((qzeros.to(torch.int64) & 0xFFFFFFFF).eq(SYM_ZERO_WORD[bits]).all())


def pack_int8_gptq(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-127, 127] -> qweight int32 [K/4, N] (code + 128, low byte first)."""
    n, k = q.shape
    if k % 4:
        raise ValueError(f"GPTQ int8 packing needs K divisible by 4, got {k}")
    u8 = (q.to(torch.int16) + 128).to(torch.uint8).contiguous()
    words = u8.view(torch.int32) if _little_endian() else _pack_le(u8)
    return words.t().contiguous()


def int8_gptq_qzeros(n: int) -> torch.Tensor:
    return torch.full((1, n // 4), SYM_ZERO_WORD[8], dtype=torch.int32)  # 0x7f7f7f7f fits in int32


def _little_endian() -> bool:
    import sys

    return sys.byteorder == "little"


def _pack_le(u8: torch.Tensor) -> torch.Tensor:
    b = u8.to(torch.int64).view(u8.shape[0], -1, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)

