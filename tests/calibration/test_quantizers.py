"""FP8 block, int8 rows and GPTQ packing: exact properties and error bounds from the formats."""
from __future__ import annotations

import math

import pytest
import torch

from hybrid_build.calibration.fp8_block import BLOCK, dequantize_fp8_block, fp8_block_args, quantize_fp8_block
from hybrid_build.calibration.gptq import (
    dequantize_gptq,
    int8_gptq_qzeros,
    pack_int8_gptq,
    unpack_codes,
    zeros_are_symmetric,
)
from hybrid_build.calibration.int8_rows import dequantize_int8_rows, quantize_int8_rows
from hybrid_build.calibration.metrics import StreamingMetrics, error_metrics

FP8_MAX = 448.0


def dequantize_fp8_block_ct(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The FP8 block expansion through compressed-tensors: the oracle for our own."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    return dequantize(q, scale_inv, torch.zeros_like(scale_inv), fp8_block_args(block)).float()


def gptq_to_pack_quantized(qweight: torch.Tensor,
                           scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric INT4 GPTQ -> compressed-tensors pack-quantized as the format defines it:
    ``weight_packed = qweight.T`` [N, K/8], ``weight_scale = scales.T`` [N, K/g], ``weight_shape = [N, K]``."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    return qweight.t().contiguous(), scales.t().contiguous(), torch.tensor([n, k], dtype=torch.int64)


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (129, 1000), (1024, 384)])
def test_fp8_block_scales_and_bounds(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.02
    q, s = quantize_fp8_block(w)
    n, k = shape
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (math.ceil(n / 128), math.ceil(k / 128))
    # min-max: each block's scale is its absmax / 448, so the block's largest value maps to +-448
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            assert s[bi, bj].item() == pytest.approx(block.abs().max().item() / FP8_MAX, rel=1e-6)
    d = dequantize_fp8_block(q, s)
    assert torch.equal(d, dequantize_fp8_block_ct(q, s))  # our expansion == compressed-tensors'
    # E4M3 has 3 mantissa bits: round-to-nearest error is at most 2^-4 of the value's binade top,
    # i.e. |err| <= |x| / 16 for normal values; subnormals (< 2^-6 * scale) err by <= 2^-10 * scale
    err = (d - w).abs()
    s_full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert bool((err <= w.abs() / 16 + s_full * 2 ** -10 + 1e-12).all())
    m = error_metrics(w, d)
    assert 0.018 < m["rel_error"] < 0.032  # Gaussian data: ~0.026 measured on 1024x3072


def test_fp8_mse_observer_is_no_worse():
    torch.manual_seed(1)
    w = torch.randn(256, 512)
    e_minmax = error_metrics(w, dequantize_fp8_block(*quantize_fp8_block(w, "minmax")))["rel_error"]
    e_mse = error_metrics(w, dequantize_fp8_block(*quantize_fp8_block(w, "mse")))["rel_error"]
    assert e_mse <= e_minmax * 1.001


@pytest.mark.parametrize("k", [256, 3072])
def test_int8_rows_codes_scales_and_bound(k):
    torch.manual_seed(2)
    w = torch.randn(500, k) * 0.02
    w[3] = 0  # an all-zero row must not divide by zero
    q, s = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -127 and int(q.max()) <= 127
    nz = torch.arange(500) != 3
    assert torch.allclose(s[nz], w[nz].abs().amax(1) / 127)
    assert bool((q[nz].abs().amax(1) == 127).all())  # the row's absmax lands on the last code
    d = dequantize_int8_rows(q, s)
    assert bool(((d - w).abs() <= s[:, None] / 2 + 1e-9).all())  # round to nearest: half a step
    assert torch.equal(d[3], torch.zeros(k))
    # RMS error of uniform rounding is step/sqrt(12); the row absmax of K Gaussians ~ sqrt(2 ln K)
    rel = error_metrics(w[nz], d[nz])["rel_error"]
    expected = math.sqrt(2 * math.log(k)) / 127 / math.sqrt(12)
    assert 0.7 * expected < rel < 1.3 * expected


def test_gptq_int8_pack_round_trip():
    torch.manual_seed(3)
    q = torch.randint(-127, 128, (12, 16), dtype=torch.int8)
    qw = pack_int8_gptq(q)
    assert qw.shape == (4, 12) and qw.dtype == torch.int32
    codes = unpack_codes(qw, 8)
    assert torch.equal(codes.t() - 128, q.to(torch.int32))
    # the low byte of the first word is element (n=0, k=0) + 128
    assert int(qw[0, 0]) & 0xFF == int(q[0, 0]) + 128
    s = torch.rand(12) + 0.5
    assert torch.allclose(dequantize_gptq(qw, s[None, :], 8, -1), q.float() * s[:, None])
    z = int8_gptq_qzeros(12)
    assert z.shape == (1, 3) and zeros_are_symmetric(z, 8)


def test_int4_unpack_and_ct_repack():
    torch.manual_seed(4)
    codes = torch.randint(0, 16, (256, 8), dtype=torch.int32)  # K=256, N=8
    words = torch.zeros(32, 8, dtype=torch.int64)
    for i in range(8):
        words |= codes[i::8].to(torch.int64) << (4 * i)
    qweight = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    assert torch.equal(unpack_codes(qweight, 4), codes)
    scales = torch.rand(2, 8, dtype=torch.float16)
    w = dequantize_gptq(qweight, scales, 4, 128)
    assert torch.allclose(w, ((codes.float() - 8) * scales.float().repeat_interleave(128, 0)).t())
    packed, scale, shape = gptq_to_pack_quantized(qweight, scales)
    assert torch.equal(packed, qweight.t()) and shape.tolist() == [8, 256] and torch.equal(scale, scales.t())


def test_streaming_metrics_equal_one_shot():
    torch.manual_seed(5)
    a, b = torch.randn(1000, 64), torch.randn(1000, 64)
    b = a + 0.01 * b
    sm = StreamingMetrics()
    for lo in range(0, 1000, 128):
        sm.update(a[lo:lo + 128], b[lo:lo + 128])
    one = error_metrics(a, b)
    for key, value in sm.result().items():
        assert value == pytest.approx(one[key], rel=1e-5), key


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (129, 1000), (1024, 384), (3, 5)])
def test_fp8_minmax_fast_path_equals_llm_compressor(shape):
    """The plain-torch min-max path gives exactly llm-compressor's memoryless min-max observer
    + compressed-tensors' quantize: equal scales, equal FP8 bits (zero blocks, -0.0, ragged
    edges and values far apart in magnitude included)."""
    from hybrid_build.calibration.fp8_block import quantize_fp8_block_observed

    torch.manual_seed(6)
    n, k = shape
    w = torch.randn(n, k) * torch.logspace(-4, 1, k)[None, :]
    w[: min(n, 128), : min(k, 128)] = 0  # an all-zero block: the zero scale is replaced
    w[-1, -1] = -0.0
    if n > 2 and k > 2:
        w[1, 2] = 1e-30  # underflows in FP8
    w = w.to(torch.bfloat16).float()  # the checkpoint's values
    q, s = quantize_fp8_block(w, "minmax")
    q_ref, s_ref = quantize_fp8_block_observed(w, "minmax")
    assert s.dtype == s_ref.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_row_chunk_quantizer_equals_int8_rows_and_gptq_packing(scale_dtype):
    """The fused chunked quantizer stores exactly what quantize_int8_rows + pack_int8_gptq give
    (codes, scales, GPTQ words) and measures the error of the stored scales."""
    from hybrid_build.calibration.int8_rows import RowChunkQuantizer

    torch.manual_seed(7)
    n, k = 700, 384
    w = (torch.randn(n, k) * 0.02 * torch.rand(n, 1)).to(torch.bfloat16)
    w[5] = 0
    w[6, :] = -0.0
    qz = RowChunkQuantizer(k, 256, scale_dtype)
    words, scales = [], []
    for lo in range(0, n, 256):  # ragged last chunk
        out_words, s = qz(w[lo:lo + 256])
        words.append(out_words.clone())
        scales.append(s)
    words, scales = torch.cat(words), torch.cat(scales)
    q_ref, s_ref = quantize_int8_rows(w)
    assert scales.dtype == scale_dtype and torch.equal(scales, s_ref.to(scale_dtype))
    assert torch.equal(words.t(), pack_int8_gptq(q_ref))  # qweight [K/4, N] is the transpose
    ref = error_metrics(w.float(), q_ref.float() * scales.float()[:, None])
    for key, value in qz.metrics.result().items():
        assert value == pytest.approx(ref[key], rel=1e-6), key
