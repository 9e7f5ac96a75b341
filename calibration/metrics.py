"""Error metrics between a reference tensor and its quantized-then-dequantized version."""
from __future__ import annotations

import math

import torch


def error_metrics(ref: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error, cosine similarity, SQNR (dB) and max absolute error, in float64."""
    r = ref.double().reshape(-1)
    a = approx.double().reshape(-1)
    err = a - r
    ref_norm, err_norm = r.norm().item(), err.norm().item()
    denom = ref_norm * a.norm().item()
    return {
        "rel_error": err_norm / ref_norm if ref_norm else (0.0 if err_norm == 0 else math.inf),
        "cosine": (r @ a).item() / denom if denom else 1.0,
        "sqnr_db": 20 * math.log10(ref_norm / err_norm) if err_norm else math.inf,
        "max_abs_error": err.abs().max().item() if err.numel() else 0.0,
    }


class StreamingMetrics:
    """The same metrics accumulated over chunks, for tensors processed a slice at a time."""

    def __init__(self) -> None:
        self.ref_sq = self.approx_sq = self.err_sq = self.dot = 0.0
        self.max_abs = 0.0

    def update(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        r, a = ref.float().reshape(-1), approx.float().reshape(-1)
        self.update_error(r, a - r)

    def update_error(self, ref: torch.Tensor, err: torch.Tensor) -> None:
        """Accumulate from the reference and the error (approx - ref); ``err`` may be overwritten.
        float32 BLAS dot products per chunk, summed across chunks in float64: three passes and no
        float64 copy of a 4k-row lm-head chunk (relative error of a blocked sdot ~1e-6)."""
        r, e = ref.reshape(-1), err.reshape(-1)
        rr, ee, re_ = float(torch.dot(r, r)), float(torch.dot(e, e)), float(torch.dot(r, e))
        self.update_sums(rr, ee, re_, float(e.abs_().max()) if e.numel() else 0.0)

    def update_sums(self, rr: float, ee: float, re_: float, max_abs: float) -> None:
        """Accumulate one chunk's r.r, e.e, r.e and max |e| (e = approx - ref)."""
        self.ref_sq += rr
        self.err_sq += ee
        self.dot += rr + re_  # r.a = r.r + r.e
        self.approx_sq += rr + 2 * re_ + ee  # |a|^2 = |r + e|^2
        self.max_abs = max(self.max_abs, max_abs)

    def result(self) -> dict[str, float]:
        ref_n, err_n = math.sqrt(self.ref_sq), math.sqrt(self.err_sq)
        denom = ref_n * math.sqrt(self.approx_sq)
        return {
            "rel_error": err_n / ref_n if ref_n else 0.0,
            "cosine": self.dot / denom if denom else 1.0,
            "sqnr_db": 20 * math.log10(ref_n / err_n) if err_n else math.inf,
            "max_abs_error": self.max_abs,
        }
