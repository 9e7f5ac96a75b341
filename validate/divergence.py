"""How far a quantized model's next-token distributions are from its reference's, teacher-forced.

The figures are the ones llama.cpp's KL-divergence mode (``llama-perplexity --kl-divergence``)
reports: mean, median, 99th and 99.9th percentile of KL(reference || test) per position, the share
of positions where both models' top-1 token is the same, the RMS of the probability difference
``p_test - p_ref`` of the observed next token (llama.cpp's "RMS Δp"), the perplexity of both on
the observed next tokens and their ratio, plus a seeded bootstrap 95% interval on the mean KL and
on same-top-1. ``rms_delta_p_top`` is the same RMS measured on the reference's top-1 token instead
of the observed one (how much the most likely continuation moved).

Work is split in two: ``DivergenceAccumulator`` reduces both models' logits, fed one vocabulary
chunk at a time, to a few numbers per position (``position_stats`` does it for whole logits), so
a caller never holds ``[tokens, vocab]`` logits; ``summarize`` / ``divergence_report`` turn the
per-position numbers into the figures. Plain torch; float64 for everything after the logits.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import torch

BOOTSTRAP_RESAMPLES = 1000
VOCAB_CHUNK = 8192  # columns reduced at a time by ``position_stats``


@dataclass
class PositionStats:
    """Per-position figures, float64 [P] each (``same_top1`` bool)."""

    kl: torch.Tensor  # KL(reference || test) in nats
    same_top1: torch.Tensor
    nll_ref: torch.Tensor  # -log p_ref(observed next token)
    nll_test: torch.Tensor
    delta_p: torch.Tensor  # p_test - p_ref of the observed next token
    delta_p_top: torch.Tensor  # p_test - p_ref of the reference's top-1 token

    def __len__(self) -> int:
        return self.kl.numel()

    @classmethod
    def cat(cls, parts: list[PositionStats]) -> PositionStats:
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def slice(self, start: int, stop: int) -> PositionStats:
        return PositionStats(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})


class DivergenceAccumulator:
    """Per-position statistics of two models' logits at the same P positions, fed one vocabulary
    chunk at a time (in order), so that neither model's ``[P, vocab]`` logits ever exist whole.

    An online softmax in float64: per position the running max ``m`` of each model's logits, the
    running ``s = sum exp(z - m)`` and, for the reference, ``a = sum exp(z_ref - m) (z_ref - z_test)``,
    rescaled whenever the max moves. At the end ``KL = a / s - lse_ref + lse_test``; argmaxes, the
    observed tokens' logits and the test logit at the reference's argmax are tracked alongside.
    Two identical inputs give exactly 0."""

    def __init__(self, targets: torch.Tensor) -> None:
        self.targets = targets.long()
        self.next = 0
        self.m_ref = self.m_test = None

    def update(self, start: int, ref: torch.Tensor, test: torch.Tensor) -> None:
        """Logits [P, C] of both models for vocabulary ids ``start:start + C``."""
        if start != self.next:
            raise ValueError(f"vocabulary chunks must come in order: expected column {self.next}, got {start}")
        if ref.shape != test.shape or ref.dim() != 2 or ref.shape[0] != self.targets.numel():
            raise ValueError(f"logit chunks must be two [{self.targets.numel()}, C] tensors of one shape, got "
                             f"{tuple(ref.shape)} and {tuple(test.shape)}")
        zp, zq = ref.double(), test.double()
        c = zp.shape[1]
        cm_p, ci_p = zp.max(-1)
        cm_q, ci_q = zq.max(-1)
        zq_at_cmax = zq.gather(-1, ci_p[:, None])[:, 0]
        if self.m_ref is None:
            self.m_ref, self.m_test = cm_p, cm_q
            self.s_ref = self.s_test = self.a_ref = 0.0
            self.top_ref, self.top_test, self.zq_at_top = ci_p + start, ci_q + start, zq_at_cmax
            nan = torch.full_like(cm_p, float("nan"))
            self.z_t_ref, self.z_t_test = nan, nan.clone()
        else:
            # the first maximum wins ties, as argmax over the whole vocabulary would
            new_p, new_q = cm_p > self.m_ref, cm_q > self.m_test
            self.top_ref = torch.where(new_p, ci_p + start, self.top_ref)
            self.zq_at_top = torch.where(new_p, zq_at_cmax, self.zq_at_top)
            self.top_test = torch.where(new_q, ci_q + start, self.top_test)
        m_p, m_q = torch.maximum(self.m_ref, cm_p), torch.maximum(self.m_test, cm_q)
        e = (zp - m_p[:, None]).exp_()
        scale_p = (self.m_ref - m_p).exp()
        self.s_ref = self.s_ref * scale_p + e.sum(-1)
        self.a_ref = self.a_ref * scale_p + (e * (zp - zq)).sum(-1)
        del e
        self.s_test = self.s_test * (self.m_test - m_q).exp() + (zq - m_q[:, None]).exp_().sum(-1)
        self.m_ref, self.m_test = m_p, m_q
        t = self.targets.to(zp.device)
        inside = (t >= start) & (t < start + c)
        col = (t - start).clamp(0, c - 1)[:, None]
        self.z_t_ref = torch.where(inside, zp.gather(-1, col)[:, 0], self.z_t_ref)
        self.z_t_test = torch.where(inside, zq.gather(-1, col)[:, 0], self.z_t_test)
        self.next = start + c

    def result(self) -> PositionStats:
        if self.m_ref is None:
            raise ValueError("no logits were given")
        if bool(self.z_t_ref.isnan().any()):
            raise ValueError(f"a target token id is not below the {self.next} vocabulary columns given")
        lse_p, lse_q = self.m_ref + self.s_ref.log(), self.m_test + self.s_test.log()
        kl = self.a_ref / self.s_ref - lse_p + lse_q
        lp_t, lq_t = self.z_t_ref - lse_p, self.z_t_test - lse_q
        lp_top, lq_top = self.m_ref - lse_p, self.zq_at_top - lse_q
        return PositionStats(kl=kl.cpu(), same_top1=(self.top_ref == self.top_test).cpu(), nll_ref=(-lp_t).cpu(),
                             nll_test=(-lq_t).cpu(), delta_p=(lq_t.exp() - lp_t.exp()).cpu(),
                             delta_p_top=(lq_top.exp() - lp_top.exp()).cpu())


def position_stats(ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor,
                   vocab_chunk: int = VOCAB_CHUNK) -> PositionStats:
    """Per-position statistics from whole logits [P, V] of both models and the observed next
    tokens ``targets`` [P] (through ``DivergenceAccumulator``, ``vocab_chunk`` columns at a time)."""
    if ref_logits.shape != test_logits.shape or ref_logits.dim() != 2:
        raise ValueError(f"logits must be two [positions, vocab] tensors of one shape, got "
                         f"{tuple(ref_logits.shape)} and {tuple(test_logits.shape)}")
    if targets.shape != ref_logits.shape[:1]:
        raise ValueError(f"{targets.numel()} targets for {ref_logits.shape[0]} positions")
    acc = DivergenceAccumulator(targets)
    for lo in range(0, ref_logits.shape[1], vocab_chunk):
        acc.update(lo, ref_logits[:, lo:lo + vocab_chunk], test_logits[:, lo:lo + vocab_chunk])
    return acc.result()


@dataclass
class DivergenceStats:
    """The summary of one set of positions (one text, or all of them)."""

    tokens: int
    mean_kl: float
    median_kl: float
    p99_kl: float
    p999_kl: float
    max_kl: float
    same_top1: float  # fraction in [0, 1]
    rms_delta_p: float
    rms_delta_p_top: float
    ppl_ref: float
    ppl_test: float
    ppl_ratio: float  # ppl_test / ppl_ref
    mean_kl_ci95: tuple[float, float]
    same_top1_ci95: tuple[float, float]

    def to_json(self) -> dict:
        d = asdict(self)
        d["mean_kl_ci95"], d["same_top1_ci95"] = list(self.mean_kl_ci95), list(self.same_top1_ci95)
        return d


def bootstrap_mean_ci(values: torch.Tensor, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                      confidence: float = 0.95, batch: int = 100) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (positions resampled with
    replacement, ``resamples`` times, from a generator seeded with ``seed``)."""
    x = values.double().flatten().cpu()
    n = x.numel()
    if n == 0:
        return (math.nan, math.nan)
    gen = torch.Generator().manual_seed(seed)
    means = []
    for lo in range(0, resamples, batch):  # [batch, n] indices at a time
        idx = torch.randint(n, (min(batch, resamples - lo), n), generator=gen)
        means.append(x[idx].mean(dim=1))
    m = torch.cat(means)
    alpha = (1.0 - confidence) / 2
    lo_q, hi_q = torch.quantile(m, torch.tensor([alpha, 1.0 - alpha], dtype=m.dtype))
    return (float(lo_q), float(hi_q))


def summarize(stats: PositionStats, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> DivergenceStats:
    n = len(stats)
    if n == 0:
        raise ValueError("no positions to summarize")
    kl = stats.kl.double()
    same = stats.same_top1.double()
    q = torch.quantile(kl, torch.tensor([0.5, 0.99, 0.999], dtype=kl.dtype))
    ppl_ref = math.exp(float(stats.nll_ref.double().mean()))
    ppl_test = math.exp(float(stats.nll_test.double().mean()))
    return DivergenceStats(
        tokens=n, mean_kl=float(kl.mean()), median_kl=float(q[0]), p99_kl=float(q[1]), p999_kl=float(q[2]),
        max_kl=float(kl.max()), same_top1=float(same.mean()),
        rms_delta_p=float(stats.delta_p.double().square().mean().sqrt()),
        rms_delta_p_top=float(stats.delta_p_top.double().square().mean().sqrt()),
        ppl_ref=ppl_ref, ppl_test=ppl_test, ppl_ratio=ppl_test / ppl_ref,
        mean_kl_ci95=bootstrap_mean_ci(kl, resamples, seed), same_top1_ci95=bootstrap_mean_ci(same, resamples, seed))


def divergence_report(per_text: Mapping[str, PositionStats], resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = 0) -> dict:
    """``{"overall": {...}, "texts": {name: {...}}}`` with ``DivergenceStats.to_json`` entries."""
    if not per_text:
        raise ValueError("no texts to summarize")
    texts = {name: summarize(s, resamples, seed).to_json() for name, s in per_text.items()}
    overall = summarize(PositionStats.cat(list(per_text.values())), resamples, seed).to_json()
    return {"overall": overall, "texts": texts}
