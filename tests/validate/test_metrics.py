"""The per-block and per-row bounds: why they exist next to the per-tensor error."""
from __future__ import annotations

import math

import torch

from hybrid_build.calibration.fp8_block import dequantize_fp8_block, quantize_fp8_block
from hybrid_build.calibration.int8_rows import dequantize_int8_rows, quantize_int8_rows
from hybrid_build.calibration.metrics import error_metrics
from hybrid_build.recipes.schema import ValidateSpec
from hybrid_build.validate.checks import block_rel_errors, logit_metrics, row_rel_errors


def test_one_bad_block_is_diluted_in_a_real_sized_tensor_but_not_per_block():
    spec = ValidateSpec()
    w = torch.randn(1024, 3072, generator=torch.Generator().manual_seed(0)) * 0.02  # a real shared-expert down_proj
    q, s = quantize_fp8_block(w)
    s_bad = s.clone()
    s_bad[3, 5] *= 1.5  # one of 192 blocks
    deq = dequantize_fp8_block(q, s_bad)
    # 0.5 / sqrt(192) = 0.036 added in quadrature to ~0.026: under the tensor bound
    assert error_metrics(w, deq)["rel_error"] < spec.fp8_max_rel_error
    blocks = block_rel_errors(w, deq)
    assert blocks.shape == (8, 24)
    assert blocks[3, 5] > spec.fp8_max_block_rel_error
    others = blocks.clone()
    others[3, 5] = 0
    assert others.max() < 2 ** -4  # E4M3 rounding: each value within 2^-4 relative


def test_ragged_blocks_and_row_bound():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8_block(w)
    assert block_rel_errors(w, dequantize_fp8_block(q, s)).shape == (2, 3)
    # adversarial rows (one outlier) still stay inside the symmetric per-row bound sqrt(K) / 254
    h = torch.randn(64, 3072, generator=torch.Generator().manual_seed(2))
    h[:, 0] = 200.0
    qi, si = quantize_int8_rows(h)
    err = row_rel_errors(h, dequantize_int8_rows(qi, si))
    assert err.max() <= math.sqrt(3072) / 254
    assert err.max() < ValidateSpec().int8_max_row_rel_error


def test_logit_metrics_identity_and_swap():
    ref = torch.randn(32, 100, generator=torch.Generator().manual_seed(3))
    same = logit_metrics(ref, ref.clone())
    assert same["top1_agreement"] == 1.0 and same["top5_overlap"] == 1.0 and same["kl"] < 1e-12
    swapped = ref.clone()
    top = ref.argmax(-1)
    swapped[torch.arange(32), top] = ref.min(-1).values - 1  # every argmax demoted
    m = logit_metrics(ref, swapped)
    assert m["top1_agreement"] == 0.0 and m["kl"] > 0
