"""Weight-only int8 x bf16/fp16 GEMV for the lm-head: one Triton launch, weight read once per call.

Owns the Triton kernel ``out[B, N] = x[B, K] @ (W_int8[N, K] * s[N]).T``, its launch-config
tables, the weight layout it reads fastest (:func:`tile_weight`), the torch wrapper
:func:`int8_linear`, the pure-torch reference :func:`int8_linear_reference` that the tests and
the runtime fall back to, and the runtime's quantize-at-load of a float head
(:func:`quantize_rows`). Triton is imported lazily, so this module imports on machines without
it. It imports nothing from hybrid_build: the docker runtime patch copies this file into vLLM as
it is.

Design (docs/kernel.md has the numbers): every program owns ``BLOCK_N`` output rows and all
batch rows at once, so each weight byte is read exactly once whatever B is. The int8 tile is
turned into x's dtype (bf16 or fp16, both hold every int8 exactly) in registers and fed to
``tl.dot`` as the right operand of ``x`` (B padded to 16/32/64), which keeps the reduction on
the tensor cores with fp32 accumulation; the per-row scale is applied once to the fp32
accumulator after the K loop, and the result is stored in x's dtype. The weight is best stored
tile by tile (``tile_weight``: each K step of a program reads one contiguous 16 KB block, not 128
strided row pieces), and the logits are stored with L2 priority "evict last", so they stay in L2
(where the sampler reads them next) instead of being written back while the weight streams by.

Wide batches (a verify step of several streams, B = 17-64) can take a second form instead
(``GemvConfig.act="i16"``): x is first quantized per row to 16-bit fixed point (scale
``max|x| / I16_MAX``) and split into two int8 halves, ``q = 256 * hi + lo``, stacked as 2 x B
rows; one int8 x int8 -> int32 tensor-core dot per K step then reads the int8 weight tile as it
was loaded (no dequant in registers, no re-staging), and the epilogue applies ``256 * hi + lo``,
x's row scale and the weight's row scale. Its one extra error is x's rounding to that grid,
bounded by :func:`i16_error_bound` (docs/kernel.md derives it).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

# Bound to triton.language by _kernel() on first use: importing Triton here would fix its
# interpreter mode (read when Triton is first imported) for whoever imports this module.
tl = None

log = logging.getLogger(__name__)

__all__ = [
    "GemvConfig",
    "DEQUANT_MODES",
    "ACTIVATION_DTYPES",
    "ACT_MODES",
    "I16_MAX",
    "TILE",
    "config_for",
    "int8_linear",
    "int8_linear_reference",
    "i16_error_bound",
    "kernel_available",
    "prepare_weight",
    "tile_weight",
    "untile_weight",
]

# The activation (x) dtypes the kernel takes; the logits come back in the same dtype.
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)

# How the int8 tile becomes x's dtype (bf16 or fp16) before the dot:
#   "cvt":  Triton's own int8 -> bf16/fp16 cast. For bf16 on sm_90 it is a bit trick as fast as
#           "asm" (triton 3.6 on the H200); for fp16 triton 3.9 emits one I2F per weight (seen
#           in its sm_90 SASS), which is why fp16 defaults to "asm";
#   "bits": a magic-number trick in plain Triton ops (integer add into an fp32 mantissa, one
#           fp32 subtract, one fp32 -> bf16/fp16 pack); runs under the interpreter, so CPU tests
#           cover it;
#   "asm":  inline PTX, four bytes per 32-bit register. bf16: two byte permutes build bf16
#           values with a known offset, one packed bf16 subtract per pair removes it (sm_90+).
#           fp16: one xor, two byte permutes to 1024 + q + 128, one packed fp16 subtract per
#           pair (sm_53+).
DEQUANT_MODES = ("cvt", "bits", "asm")
# "none" (code 3) is the benchmark's control: a bf16/fp16 weight through the same kernel.
_DEQUANT_CODE = {"cvt": 0, "bits": 1, "asm": 2, "none": 3}
# L2 eviction priorities (Triton's spellings) a config may put on the weight loads and the
# output stores; "" is the default (evict normal). Triton 3.6 lowers every 16-byte cp.async to
# .cg (L2 only) whatever cache modifier a load asks for, so x has no L1 hint here
# (lab/kernel_history.md, "Tiles and the output": x through L1 measured slower anyway).
EVICT_MODES = ("", "evict_first", "evict_last")
# How x meets the weight (GemvConfig.act):
#   "native": x in its own dtype, the weight dequantized to it in registers, bf16/fp16 dots;
#   "i16":    x quantized per row to 16-bit fixed point and split into two int8 halves, int8 dots
#             on the weight as loaded (the wide-batch form; module docstring).
ACT_MODES = ("native", "i16")
# The largest |q| of the 16-bit grid whose high byte still fits int8: 127 * 256 + 127.
I16_MAX = 32639
# The tiled weight layout (block_n, block_k) that tile_weight() writes by default and the tables'
# configs read: [ceil(N / 128), ceil(K / 128), 128, 128].
TILE = (128, 128)


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one kernel instance.

    ``block_m`` is the M of each ``tl.dot`` (x rows, padded): Triton runs M = 16 or 32 on
    mma.sync with the dequantized weight straight from registers, and M = 64 on wgmma with
    the weight staged through shared memory. ``dots`` (1, 2 or 4) dots of ``block_m`` rows
    share one dequantized tile, covering ``dots * block_m`` batch rows. ``block_m=None``
    pads the batch to 16, 32 or 64. ``w_evict`` and ``o_evict`` are the L2 eviction priorities
    of the weight loads and the output stores (``EVICT_MODES``): they change what L2 keeps,
    never the result. With a tiled weight (:func:`tile_weight`), ``block_n`` x ``block_k`` must be
    its tile. ``swap`` makes the dequantized weight the dot's left operand (``acc[block_n, M] =
    W @ x^T``): on sm_90 Triton then runs wgmma (the tensor cores' full rate) with the weight in
    registers and x from shared memory, instead of ``mma.sync`` (B <= 32) or staging the weight
    through shared memory (M = 64); one dot (``dots=1``), M up to 64.

    ``act="i16"`` is the int8 tensor-core form (module docstring): ``block_m`` is then the padded
    batch P (16, 32 or 64; the dot has 2 P rows, x's two int8 halves), ``dots`` is 1, ``dequant``
    is unused, and ``block_n`` may be a multiple of a tiled weight's tile rows (several tiles per
    program), ``block_k`` must be its tile's K. ``tma`` (act="i16", a tiled weight, ``block_n`` its
    tile's rows) loads both tiles with the Tensor Memory Accelerator (sm_90+) instead of per-thread
    copies. ``split_acc`` (act="i16") runs the high and the
    low halves as two dots of P rows with their own accumulators, so the epilogue combines them
    element by element instead of splitting one 2P-row accumulator.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dequant: str = "asm"
    block_m: int | None = None
    dots: int = 1
    w_evict: str = ""
    o_evict: str = ""
    swap: bool = False
    act: str = "native"
    tma: bool = False
    split_acc: bool = False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self, batch: int) -> tuple[int, int]:
        """(M of each dot, number of dots) for ``batch`` rows."""
        m = self.block_m or block_b_for(batch)
        if self.dots not in (1, 2, 4):
            raise ValueError(f"dots must be 1, 2 or 4, got {self.dots}")
        if self.act not in ACT_MODES:
            raise ValueError(f"unknown act {self.act!r}; valid: {', '.join(ACT_MODES)}")
        if (self.swap or self.act == "i16") and self.dots != 1:
            raise ValueError(f"a swapped or act='i16' config runs one dot, got dots={self.dots}")
        if (self.tma or self.split_acc) and self.act != "i16":
            raise ValueError("tma and split_acc need act='i16'")
        if self.act == "i16" and self.block_k % 32:
            raise ValueError(f"act='i16' needs block_k a multiple of 32 (the int8 MMA's K step), got {self.block_k}")
        if m * self.dots < batch:
            raise ValueError(f"config covers {m * self.dots} batch rows, got {batch}")
        return m, self.dots


# Fixed tables per batch class (key: the largest batch of the class: B <= 8, 9-16, 17-32, 33-64),
# chosen by benchmarks/bench_lmhead_gemv.py and lab/probes/probe_lmhead_sched.py on an H200.
# _H200_TABLE is for the tiled weight (TILE), what the runtime serves: every class reads the same
# 128 x 128 tiles; B <= 16 is one config (the B <= 16 probes: 5 programs per SM, logits kept in L2;
# lab/results/lmhead_sched_probes_h200.json, lab/kernel_history.md "Tiles and the output").
_LOGITS_IN_L2 = "evict_last"
_H200_TABLE: dict[int, GemvConfig] = {
    8: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, block_m=16, o_evict=_LOGITS_IN_L2),
    16: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, block_m=16, o_evict=_LOGITS_IN_L2),
    # B = 17-64: the int8 tensor-core form (x on a 16-bit grid, TMA loads; the sweeps in
    # lab/results/lmhead_gemv_h200_i16_sweep*.json): 1.14-1.18x the best dequantizing
    # config at B = 32 and 1.42-1.44x at B = 64, in the same runs.
    32: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, block_m=32, o_evict=_LOGITS_IN_L2,
                   act="i16", tma=True),
    64: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, block_m=64, o_evict=_LOGITS_IN_L2,
                   act="i16", tma=True),
}
# For a row-major [N, K] weight: the earlier sweeps' tiling (lmhead_gemv_h200_first_kernel.json,
# lmhead_gemv_h200_b16_sweep_ab.json), kept for callers that cannot re-lay the weight out.
_H200_ROWS_TABLE: dict[int, GemvConfig] = {
    8: GemvConfig(block_n=128, block_k=256, num_warps=4, num_stages=3, block_m=16),
    16: GemvConfig(block_n=128, block_k=256, num_warps=4, num_stages=3, block_m=16),
    32: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=4, block_m=16, dots=2),
    64: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, block_m=64),
}

MAX_BLOCK_B = 64


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def block_b_for(batch: int) -> int:
    """Batch class of ``batch``: the padded width 16, 32 or 64 (every tl.dot dim is >= 16)."""
    if batch <= 16:
        return 16
    if batch <= 32:
        return 32
    return 64


def table_class(batch: int) -> int:
    """The ``_H200_TABLE`` key for ``batch`` rows: 8, 16, 32 or 64 (64 above: one launch runs at
    most 64 rows)."""
    return next((c for c in sorted(_H200_TABLE) if batch <= c), max(_H200_TABLE))


def config_for(batch: int, device: torch.device | None = None,
               dtype: torch.dtype = torch.bfloat16, *, tile: tuple[int, int] | None = None) -> GemvConfig:
    """Launch config for ``batch`` rows of ``dtype`` activations on ``device``, for a weight tiled
    as ``tile`` (:func:`tile_weight`; the table's configs read ``TILE``, another tile gets the
    same config with its block shape) or, with ``tile=None``, for a row-major [N, K] weight.

    The bf16 inline-PTX dequant needs sm_90 (``sub.bf16x2``): older CUDA GPUs get Triton's own
    cast for bf16. fp16 takes its inline PTX (``sub.f16x2``, sm_53+) everywhere: on the H200 it
    passed every odd-shape check and reads at the bf16 path's rate (194.6 vs 254.0 us for Triton's
    cast at B = 16, ``lab/results/lmhead_gemv_h200_b16_sweep_ab.json``). The interpreter gets the plain-Triton
    "bits" path (it runs no PTX and, in triton 3.9, no correct int8 -> bf16 cast).
    """
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16 or float16, got {dtype}")
    if tile is None:
        cfg = _H200_ROWS_TABLE[table_class(batch)]
    else:
        cfg = _H200_TABLE[table_class(batch)]
        if not _reads_tile(cfg, tuple(tile)):
            cfg = dataclasses.replace(cfg, block_n=tile[0], block_k=tile[1])
    if _interpreting() or device is None or device.type != "cuda":
        return dataclasses.replace(cfg, dequant="bits")
    if cfg.tma and not _tma_available(device):
        cfg = dataclasses.replace(cfg, tma=False)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (9, 0):
        return dataclasses.replace(cfg, dequant="cvt")
    return cfg


def _tma_available(device: torch.device) -> bool:
    """TMA loads need sm_90+ (the Tensor Memory Accelerator) and a Triton with host tensor
    descriptors (``triton.tools.tensor_descriptor``, 3.4+); NVIDIA only (ROCm reports its own
    capability numbers)."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None
    except ImportError:
        return False


def tiled_shape(n: int, k: int, tile: tuple[int, int] = TILE) -> tuple[int, int, int, int]:
    """Shape of an [N, K] weight stored tile by tile: [ceil(N / bn), ceil(K / bk), bn, bk]."""
    bn, bk = tile
    return (-(-n // bn), -(-k // bk), bn, bk)


def tile_weight(w_int8: torch.Tensor, tile: tuple[int, int] = TILE) -> torch.Tensor:
    """``w_int8`` [N, K] stored tile by tile for :func:`int8_linear`: ``tiled_shape(N, K, tile)``,
    tile (i, j) = rows [i*bn, (i+1)*bn) x columns [j*bk, (j+1)*bk), zero-padded past N and K.

    Each K step of a program then reads one contiguous block instead of ``bn`` row pieces of
    ``bk`` bytes ``K`` bytes apart (on the H200: 0.5-2.5 % faster at B <= 16, docs/kernel.md). Made
    once when the head is loaded; the copy is the weight's size plus its padding."""
    if w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        raise ValueError(f"w_int8 must be a 2-D int8 tensor [N, K], got {w_int8.dtype} {tuple(w_int8.shape)}")
    n, k = w_int8.shape
    tn, tk, bn, bk = tiled_shape(n, k, tile)
    w = w_int8
    if (tn * bn, tk * bk) != (n, k):
        w = torch.nn.functional.pad(w_int8, (0, tk * bk - k, 0, tn * bn - n))
    return w.reshape(tn, bn, tk, bk).permute(0, 2, 1, 3).contiguous()


ROW_QMAX = 127  # symmetric codes: what GPTQ 8-bit (code + 128) and this kernel both hold exactly


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's quantize-at-load of a float head [N, K]: (int8 codes [N, K] in [-127, 127],
    float32 scales [N]), scale = row absmax / 127, round half to even. The build's quantizer is
    ``calibration/int8_rows.py``'s ``quantize_int8_rows``; this is the same arithmetic, bit for bit
    (tests/serve/runtime/test_int8_gemv.py compares the two), written here because this file runs inside
    vLLM on its own (the docker path copies it alone) and imports nothing else of hybrid_build."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / ROW_QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.div(w, scale[:, None]).round_().clamp_(-ROW_QMAX, ROW_QMAX).to(torch.int8)
    return q, scale


def prepare_weight(w_int8: torch.Tensor) -> torch.Tensor:
    """The head's int8 [N, K] weight as :func:`int8_linear` reads it fastest on its device: tiled
    (``tile_weight``, ``TILE``) where the Triton kernel runs, row-major elsewhere (the torch
    reference reads that as it is)."""
    return tile_weight(w_int8) if kernel_available(w_int8.device) else w_int8


def untile_weight(w_tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major [N, K] weight back from :func:`tile_weight`'s layout."""
    tn, tk, bn, bk = w_tiled.shape
    return w_tiled.permute(0, 2, 1, 3).reshape(tn * bn, tk * bk)[:n, :k]


def kernel_available(device: torch.device) -> bool:
    """True when :func:`int8_linear` runs the Triton kernel (not the reference) on ``device``."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or _interpreting()


def int8_linear_reference(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (w_int8 * scale[:, None]).T`` through a dequantized fp32 weight, cast to x's dtype
    (``w_int8`` row-major [N, K] or tiled by :func:`tile_weight`)."""
    _check_shapes(x, w_int8, scale)
    if w_int8.dim() == 4:
        w_int8 = untile_weight(w_int8, scale.numel(), x.shape[-1])
    w = w_int8.to(torch.float32) * scale.reshape(-1, 1).to(torch.float32)
    return torch.nn.functional.linear(x.to(torch.float32), w).to(x.dtype)


def i16_error_bound(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, N] bound on what act="i16" adds to the exact ``x @ (w_int8 * scale).T``: x's rounding
    to its row's 16-bit grid.

    Row b is held as q * t_b, t_b = max|x_b| / I16_MAX, q an integer from rounding x / t_b in
    fp32 (t_b and 1 / t_b each rounded once): |x_k - q_k t_b| <= t_b (1/2 + 3 I16_MAX 2^-24)
    <= 0.506 t_b. Summed against the exact int8 products: |error_bn| <= 0.506 t_b |s_n| sum_k
    |w_nk|. The integer dot is exact (int32, |sum| < 2^31 for K < 2^17); the epilogue's fp32
    rounding is inside the fp32 accumulation term every form's bound already carries. ``w_int8``
    row-major [N, K] or tiled."""
    _check_shapes(x, w_int8, scale)
    if w_int8.dim() == 4:
        w_int8 = untile_weight(w_int8, scale.numel(), x.shape[-1])
    t = x.float().abs().amax(dim=-1, keepdim=True) / I16_MAX
    w_l1 = w_int8.float().abs().sum(dim=1) * scale.reshape(-1).float().abs()
    return 0.506 * t * w_l1


def _check_shapes(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor) -> None:
    """N comes from the scale and K from x for a tiled weight, which must be ``tiled_shape(N, K)``
    of its own tile."""
    if w_int8.dtype != torch.int8 or w_int8.dim() not in (2, 4):
        raise ValueError(f"w_int8 must be an int8 tensor [N, K] or tiled by tile_weight, "
                         f"got {w_int8.dtype} {tuple(w_int8.shape)}")
    k = x.shape[-1]
    if w_int8.dim() == 4:
        n = scale.numel()
        want = tiled_shape(n, k, tuple(w_int8.shape[2:]))
        if tuple(w_int8.shape) != want:
            raise ValueError(f"tiled w_int8 {tuple(w_int8.shape)} does not hold [N={n}, K={k}] "
                             f"(N from the scale, K from x): expected {want}")
        return
    n, kw = w_int8.shape
    if k != kw:
        raise ValueError(f"x has K={k} but w_int8 is [N={n}, K={kw}]")
    if scale.numel() != n:
        raise ValueError(f"scale has {scale.numel()} elements, expected one per output row (N={n})")


def _reads_tile(cfg: GemvConfig, tile: tuple[int, int]) -> bool:
    """Whether ``cfg`` reads a weight tiled ``tile``: its own block shape, or for act="i16" whole
    tiles, several per program along N."""
    if cfg.act == "i16":
        return cfg.block_k == tile[1] and cfg.block_n % tile[0] == 0 and (not cfg.tma or cfg.block_n == tile[0])
    return (cfg.block_n, cfg.block_k) == tuple(tile)


def _check_config(cfg: GemvConfig, w: torch.Tensor, batch: int) -> tuple[int, int]:
    """A config that cannot run ``batch`` rows over ``w`` (its tile, its hints) fails here; returns
    its (dot M, dots) for that batch."""
    rows = cfg.rows(batch)
    if cfg.tma and w.dim() != 4:
        raise ValueError("a tma config reads a tiled weight (tile_weight)")
    if w.dim() == 4 and not _reads_tile(cfg, (w.shape[2], w.shape[3])):
        raise ValueError(f"weight tiled {tuple(w.shape[2:])} does not match the config's {cfg.block_n} x {cfg.block_k}")
    if cfg.dequant not in _DEQUANT_CODE:
        raise ValueError(f"unknown dequant mode {cfg.dequant!r}; valid: {', '.join(DEQUANT_MODES)}")
    if cfg.w_evict not in EVICT_MODES or cfg.o_evict not in EVICT_MODES:
        raise ValueError(f"unknown eviction priority w_evict={cfg.w_evict!r} / o_evict={cfg.o_evict!r}; "
                         f"valid: {EVICT_MODES}")
    return rows


def int8_linear(
    x: torch.Tensor,
    w_int8: torch.Tensor,
    scale: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``out[..., N] = x[..., K] @ (w_int8[N, K] * scale[N]).T`` with fp32 accumulation.

    ``x`` is bf16 or fp16 (the output has x's dtype), ``w_int8`` int8 [N, K] row-major or, faster,
    tiled by :func:`tile_weight`, K a multiple of 16, ``scale`` any float dtype with N elements
    ([N], [N, 1] or [1, N]). Up to 64
    rows of ``x`` run in one launch that reads the weight once; larger batches run in chunks of
    64. Without Triton, or on a device that is neither CUDA nor the Triton interpreter, this
    computes the reference.
    """
    _check_shapes(x, w_int8, scale)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    n, k = scale.numel(), x.shape[-1]
    tile = tuple(w_int8.shape[2:]) if w_int8.dim() == 4 else None
    if k % 16:
        raise ValueError(f"K must be a multiple of 16, got {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w_int8 if w_int8.is_contiguous() else w_int8.contiguous()
    s = scale.reshape(-1)
    if not s.is_contiguous():
        s = s.contiguous()
    if out is None:
        out2 = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    else:
        if out.shape != (*lead, n) or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(*lead, n)}")
        out2 = out.view(-1, n)

    if not kernel_available(x.device):
        if config is not None:  # refused here too, not only by the launch
            _check_config(config, w, min(x2.shape[0], MAX_BLOCK_B))
        log.debug("int8_linear: no Triton kernel for device %s, using the torch reference", x.device)
        out2.copy_(int8_linear_reference(x2, w, s))
        return out2.view(*lead, n)

    for b0 in range(0, x2.shape[0], MAX_BLOCK_B):
        xb = x2[b0 : b0 + MAX_BLOCK_B]
        cfg = config or config_for(xb.shape[0], x.device, x.dtype, tile=tile)
        _launch(xb, w, s, out2[b0 : b0 + MAX_BLOCK_B], cfg)
    return out2.view(*lead, n)


def _launch(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, cfg: GemvConfig, *,
            stage: str = "full"):
    """One launch over all rows of ``x`` (at most 64); returns Triton's compiled kernel (the
    benchmarks read its registers and shared memory).

    ``stage`` and ``dequant="none"`` (with a ``w`` of x's dtype) are the benchmark's diagnostics:
    "no_dot" dequantizes and adds the tile up without the dot, "load" only xors the loaded
    bytes together (both write meaningless values); "no_store" computes everything and stores
    nothing but NaN results (the cost of writing the logits, by difference).
    """
    batch, k = x.shape
    n = s.numel()
    block_h, dots = _check_config(cfg, w, batch)
    if x.dtype not in ACTIVATION_DTYPES or out.dtype != x.dtype:
        raise ValueError(f"x and out must both be bfloat16 or both float16, got {x.dtype} and {out.dtype}")
    if cfg.act == "i16":
        if stage not in ("full", "quant_only", "dot_only"):
            raise ValueError(f"act='i16' runs stage full, quant_only or dot_only, not {stage!r}")
        return _launch_i16(x, w, s, out, cfg, block_h, stage)
    if stage not in ("full", "no_dot", "load", "no_store"):
        raise ValueError(f"unknown stage {stage!r}")
    kernel = _kernel(_interpreting())
    grid = (-(-n // cfg.block_n),)
    return kernel[grid](
        x, w, s, out, batch, n, k, x.stride(0), out.stride(0),
        BLOCK_H=block_h, N_DOTS=dots, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DEQUANT=_DEQUANT_CODE[cfg.dequant], EVEN_K=(k % cfg.block_k == 0), X_F16=(x.dtype == torch.float16),
        STAGE={"full": 0, "no_dot": 1, "load": 2, "no_store": 3}[stage], W_EVICT=cfg.w_evict,
        W_TILED=(w.dim() == 4), O_EVICT=cfg.o_evict, SWAP=cfg.swap,
        # The interpreter (triton 3.9) multiplies bf16 dot operands as their raw uint16 bits;
        # upcasting both is exact (bf16, fp16 and int8 values are fp32 values) and keeps the
        # dequant arithmetic under test.
        DOT_F32=_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_i16(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, cfg: GemvConfig,
                block_p: int, stage: str = "full"):
    """act="i16": quantize x's rows to the 16-bit grid as 2 x ``block_p`` int8 rows (high bytes,
    then low bytes; rows past B are never read back), then one int8 dot kernel over the weight.
    Returns the dot kernel's compiled form. The benchmark's ``stage`` "quant_only" / "dot_only"
    runs one of the two (the dot then reads whatever the buffers hold)."""
    batch, k = x.shape
    n = s.numel()
    interpret = _interpreting()
    xq, xs, xa = _i16_workspace(x.device, block_p, k, cfg.block_k, cfg.split_acc, cfg.tma)
    if stage != "dot_only":
        # one load per row up to K = 8192 (the row stays in registers between max and rounding)
        block_k = min(8192, _pow2_at_least(k))
        quant = _kernel(interpret, "quant_i16")[(batch,)](
            x, xq, xs, k, x.stride(0), BLOCK_P=block_p, BLOCK_K=block_k, ONE_PASS=(k <= block_k), I16=I16_MAX,
            num_warps=4 if block_k <= 4096 else 8)
        if stage == "quant_only":
            return quant
    tile_n = w.shape[2] if w.dim() == 4 else cfg.block_n
    wa = _weight_descriptor(w) if cfg.tma else w
    return _kernel(interpret, "i16")[(-(-n // cfg.block_n),)](
        xa, xs, wa, s, out, batch, n, k, out.stride(0), TMA=cfg.tma, SPLIT=cfg.split_acc,
        BLOCK_P=block_p, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TILE_N=tile_n,
        EVEN_K=(k % cfg.block_k == 0), W_TILED=(w.dim() == 4), SWAP=cfg.swap,
        W_EVICT=cfg.w_evict, O_EVICT=cfg.o_evict,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@functools.lru_cache(maxsize=16)
def _i16_workspace(device: torch.device, block_p: int, k: int, block_k: int, split: bool, tma: bool):
    """x's int8 halves [2P, K], its row scales [P] and, for TMA, the halves' descriptor: made once
    per (device, P, K) and reused by every call (one launch at a time on one stream, as the head
    runs; a fixed address also suits CUDA graphs), which keeps the host's work per call to the two
    launches."""
    xq = torch.empty((2 * block_p, k), dtype=torch.int8, device=device)
    xs = torch.empty((block_p,), dtype=torch.float32, device=device)
    xa = xq
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(xq, [block_p if split else 2 * block_p, block_k])
    return xq, xs, xa


_W_DESCRIPTORS: dict = {}


def _weight_descriptor(w: torch.Tensor):
    """The TMA descriptor of a tiled weight, the tiles stacked as rows (tile (i, j) is rows
    [(i * tk + j) * bn, ... + bn) of [-1, bk]), kept per weight (address, shape, device): it only
    encodes those."""
    key = (w.data_ptr(), tuple(w.shape), str(w.device))
    desc = _W_DESCRIPTORS.get(key)
    if desc is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if len(_W_DESCRIPTORS) >= 8:
            _W_DESCRIPTORS.clear()
        desc = _W_DESCRIPTORS[key] = TensorDescriptor.from_tensor(w.view(-1, w.shape[3]), [w.shape[2], w.shape[3]])
    return desc


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


@functools.lru_cache(maxsize=6)
def _kernel(interpret: bool, which: str = "gemv"):
    """Wrap a kernel source on first use: interpreted or compiled, as asked (cached per mode):
    "gemv" the dequantizing kernel, "i16" the int8 dot kernel, "quant_i16" x's quantizer.

    Wrapping here rather than at import keeps the mode a call-time choice: ``triton.jit``
    otherwise fixes it from TRITON_INTERPRET when this module is first imported.
    """
    global tl
    import triton.language

    tl = triton.language
    fn = {"gemv": _int8_gemv_kernel, "i16": _int8_i16_kernel, "quant_i16": _quant_i16_kernel}[which]
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


# The kernel source: a plain function here, wrapped by _kernel(). Its annotations stay strings
# (postponed evaluation), which is how Triton reads constexpr parameters anyway.
def _int8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr,
    B, N, K, stride_xb, stride_ob,
    BLOCK_H: tl.constexpr, N_DOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEQUANT: tl.constexpr, EVEN_K: tl.constexpr, STAGE: tl.constexpr, DOT_F32: tl.constexpr,
    X_F16: tl.constexpr, W_EVICT: tl.constexpr, W_TILED: tl.constexpr, O_EVICT: tl.constexpr,
    SWAP: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N re-read row N-1 instead of masking, so the weight loads stay unmasked
    # 16-byte vectors; their results are dropped by the masked store.
    rows = tl.where(offs_n < N, offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if W_TILED:
        # The weight stored tile by tile ([N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K], zero-padded,
        # tile_weight()): each K step of a program reads one contiguous BLOCK_N * BLOCK_K block.
        w_ptrs = (w_ptr + pid.to(tl.int64) * (tl.cdiv(K, BLOCK_K) * BLOCK_N * BLOCK_K)
                  + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + offs_k[None, :])
    else:
        w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
    # N_DOTS dots of BLOCK_H x rows each share one dequantized tile: dot j covers rows
    # [j * BLOCK_H, (j + 1) * BLOCK_H) (e.g. four M = 16 dots stay on mma.sync where one
    # M = 64 dot is wgmma). Unused accumulators are dead code and cost nothing.
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + offs_h[:, None] * stride_xb + offs_k[None, :]
    x_step = BLOCK_H * stride_xb
    h_ok = offs_h[:, None] < B
    h1_ok = (offs_h[:, None] + BLOCK_H) < B
    h2_ok = (offs_h[:, None] + 2 * BLOCK_H) < B
    h3_ok = (offs_h[:, None] + 3 * BLOCK_H) < B
    if SWAP:
        acc_t = tl.full((BLOCK_N, BLOCK_H), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_H, BLOCK_N), 0.0, dtype=tl.float32)
    acc1 = tl.full((BLOCK_H, BLOCK_N), 0.0, dtype=tl.float32)
    acc2 = tl.full((BLOCK_H, BLOCK_N), 0.0, dtype=tl.float32)
    acc3 = tl.full((BLOCK_H, BLOCK_N), 0.0, dtype=tl.float32)
    if STAGE == 1:
        acc_w = tl.full((BLOCK_N, BLOCK_K), 0.0, dtype=x_ptr.dtype.element_ty)
    else:
        acc_w = tl.full((BLOCK_N, BLOCK_K), 0, dtype=tl.int8)
    for k0 in range(0, K, BLOCK_K):
        # Masks only along rows when K needs no tail, so loads stay 16-byte vectors (a tiled
        # weight is zero-padded: never masked).
        if EVEN_K or W_TILED:
            q = tl.load(w_ptrs, eviction_policy=W_EVICT)
        if EVEN_K:
            xa = tl.load(x_ptrs, mask=h_ok, other=0.0)
            if N_DOTS > 1:
                xa1 = tl.load(x_ptrs + x_step, mask=h1_ok, other=0.0)
            if N_DOTS > 2:
                xa2 = tl.load(x_ptrs + 2 * x_step, mask=h2_ok, other=0.0)
                xa3 = tl.load(x_ptrs + 3 * x_step, mask=h3_ok, other=0.0)
        else:
            k_ok = (k0 + offs_k[None, :]) < K
            if not W_TILED:
                q = tl.load(w_ptrs, mask=k_ok, other=0, eviction_policy=W_EVICT)
            xa = tl.load(x_ptrs, mask=h_ok & k_ok, other=0.0)
            if N_DOTS > 1:
                xa1 = tl.load(x_ptrs + x_step, mask=h1_ok & k_ok, other=0.0)
            if N_DOTS > 2:
                xa2 = tl.load(x_ptrs + 2 * x_step, mask=h2_ok & k_ok, other=0.0)
                xa3 = tl.load(x_ptrs + 3 * x_step, mask=h3_ok & k_ok, other=0.0)
        if STAGE == 2:
            acc_w = acc_w ^ q
        else:
            if DEQUANT == 3:
                wb = q
            elif DEQUANT == 0:
                wb = q.to(x_ptr.dtype.element_ty)
            elif DEQUANT == 1:
                # fp32 bits 0x4B000080 + q read as 2^23 + 128 + q (q sits in the low mantissa
                # bits); subtracting 2^23 + 128 leaves q exactly, and q fits bf16 and fp16 exactly.
                magic = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True)
                wb = (magic - 8388736.0).to(x_ptr.dtype.element_ty)
            elif X_F16:
                # fp16 bits 0x64 | byte read as 1024 + byte (the byte fills the low mantissa bits,
                # whose unit is 1 at that exponent). Flipping the sign bit first makes the byte
                # q + 128, so subtracting 1152 (0x6480) leaves q exactly. Four bytes per register:
                # one xor, two prmt, one packed subtract per pair (sub.f16x2: sm_53+).
                wb = tl.inline_asm_elementwise(
                    asm="""
                    {
                    .reg .b32 u, p0, p1, m;
                    xor.b32 u, $2, 0x80808080;
                    prmt.b32 p0, u, 0x64, 0x4140;
                    prmt.b32 p1, u, 0x64, 0x4342;
                    mov.b32 m, 0x64806480;
                    sub.f16x2 $0, p0, m;
                    sub.f16x2 $1, p1, m;
                    }
                    """,
                    constraints="=r,=r,r",
                    args=[q],
                    dtype=tl.float16,
                    is_pure=True,
                    pack=4,
                )
            else:
                # bf16 bits 0x43 | byte read as 128 + (q & 0x7f), or as 256 + 2 * (q & 0x7f) when
                # the byte's sign bit lands in the exponent's low bit. Clearing that bit and
                # subtracting the matching power of two (128 or 256) leaves q exactly. Four bytes
                # per register: two prmt build the bf16 pairs, one packed subtract per pair.
                wb = tl.inline_asm_elementwise(
                    asm="""
                    {
                    .reg .b32 p0, p1, v0, v1, o0, o1;
                    prmt.b32 p0, $2, 0x43, 0x4140;
                    prmt.b32 p1, $2, 0x43, 0x4342;
                    and.b32 v0, p0, 0xff7fff7f;
                    and.b32 v1, p1, 0xff7fff7f;
                    and.b32 o0, p0, 0xff80ff80;
                    and.b32 o1, p1, 0xff80ff80;
                    sub.bf16x2 $0, v0, o0;
                    sub.bf16x2 $1, v1, o1;
                    }
                    """,
                    constraints="=r,=r,r",
                    args=[q],
                    dtype=tl.bfloat16,
                    is_pure=True,
                    pack=4,
                )
            if STAGE == 1:
                acc_w += wb
            elif SWAP:
                # The weight is the left operand (M = BLOCK_N rows of W, N = the batch): wgmma
                # with the weight from registers and x^T from shared memory on sm_90.
                if DOT_F32:
                    acc_t = tl.dot(wb.to(tl.float32), tl.trans(xa.to(tl.float32)), acc_t, input_precision="ieee")
                else:
                    acc_t = tl.dot(wb, tl.trans(xa), acc_t)
            elif DOT_F32:
                wt = tl.trans(wb.to(tl.float32))
                acc = tl.dot(xa.to(tl.float32), wt, acc, input_precision="ieee")
                if N_DOTS > 1:
                    acc1 = tl.dot(xa1.to(tl.float32), wt, acc1, input_precision="ieee")
                if N_DOTS > 2:
                    acc2 = tl.dot(xa2.to(tl.float32), wt, acc2, input_precision="ieee")
                    acc3 = tl.dot(xa3.to(tl.float32), wt, acc3, input_precision="ieee")
            else:
                # x is the left operand (M = batch rows). For M < 64 Triton uses mma.sync with the
                # weight as the register operand, 4 consecutive K bytes per register, so the
                # dequant needs no byte shuffles; M = 64 is wgmma via shared memory.
                wt = tl.trans(wb)
                acc = tl.dot(xa, wt, acc)
                if N_DOTS > 1:
                    acc1 = tl.dot(xa1, wt, acc1)
                if N_DOTS > 2:
                    acc2 = tl.dot(xa2, wt, acc2)
                    acc3 = tl.dot(xa3, wt, acc3)
        if W_TILED:
            w_ptrs += BLOCK_N * BLOCK_K
        else:
            w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc_t)
    if STAGE == 1 or STAGE == 2:
        # Keep the loads alive for the stage-drop timings; the values are meaningless.
        acc += tl.sum(acc_w.to(tl.float32), axis=1)[None, :]
    # One scale per output row, applied once to the fp32 sum.
    s = tl.load(s_ptr + rows).to(tl.float32)[None, :]
    n_ok = offs_n[None, :] < N
    o_ptrs = o_ptr + offs_h[:, None] * stride_ob + offs_n[None, :]
    o_ok = h_ok & n_ok
    if STAGE == 3:
        # the diagnostic without the output write: stores nothing unless the result is NaN
        o_ok = o_ok & (acc != acc)
    tl.store(o_ptrs, (acc * s).to(o_ptr.dtype.element_ty), mask=o_ok, eviction_policy=O_EVICT)
    o_step = BLOCK_H * stride_ob
    if N_DOTS > 1:
        tl.store(o_ptrs + o_step, (acc1 * s).to(o_ptr.dtype.element_ty), mask=h1_ok & n_ok, eviction_policy=O_EVICT)
    if N_DOTS > 2:
        tl.store(o_ptrs + 2 * o_step, (acc2 * s).to(o_ptr.dtype.element_ty), mask=h2_ok & n_ok, eviction_policy=O_EVICT)
        tl.store(o_ptrs + 3 * o_step, (acc3 * s).to(o_ptr.dtype.element_ty), mask=h3_ok & n_ok, eviction_policy=O_EVICT)


def _quant_i16_kernel(x_ptr, q_ptr, t_ptr, K, stride_xb,
                      BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, I16: tl.constexpr):
    """Row b of x as integers q on the grid t_b = max|x_b| / I16 (round half up), written as its
    high bytes (row b of q_ptr) and low bytes (row BLOCK_P + b): q = 256 * hi + lo, lo in
    [-128, 127], |hi| <= 127. A NaN or inf in the row makes t_b non-finite, so its logits are too.
    ``ONE_PASS`` (K <= BLOCK_K): the row is loaded once."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    v0 = tl.load(x_ptr + b * stride_xb + offs, mask=offs < K, other=0.0).to(tl.float32)
    a = tl.abs(v0)
    amax = tl.where(a == a, a, float("inf"))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        v = tl.load(x_ptr + b * stride_xb + k0 + offs, mask=(k0 + offs) < K, other=0.0).to(tl.float32)
        a = tl.abs(v)
        amax = tl.maximum(amax, tl.where(a == a, a, float("inf")))
    m = tl.max(amax, axis=0)
    tl.store(t_ptr + b, m / I16)
    inv = tl.where((m > 0) & (m < float("inf")), I16 / m, 0.0)
    for k0 in range(0, K, BLOCK_K):
        ok = (k0 + offs) < K
        if ONE_PASS:
            v = v0
        else:
            v = tl.load(x_ptr + b * stride_xb + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        r = tl.floor(v * inv + 0.5)
        r = tl.minimum(tl.maximum(tl.where(r == r, r, 0.0), -I16), I16)
        q = r.to(tl.int32)
        lo = ((q + 128) & 255) - 128
        hi = (q - lo) >> 8
        tl.store(q_ptr + b * K + k0 + offs, hi.to(tl.int8), mask=ok)
        tl.store(q_ptr + (BLOCK_P + b) * K + k0 + offs, lo.to(tl.int8), mask=ok)


def _int8_i16_kernel(
    q_ptr, t_ptr, w_ptr, s_ptr, o_ptr,
    B, N, K, stride_ob,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_N: tl.constexpr,
    EVEN_K: tl.constexpr, W_TILED: tl.constexpr, SWAP: tl.constexpr,
    W_EVICT: tl.constexpr, O_EVICT: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr,
):
    """act="i16": ``out[b, n] = (256 acc[b, n] + acc[P + b, n]) * t_b * s_n``, acc the int32 dot of
    x's 2P int8 rows with the int8 weight rows, both tiles fed to the tensor cores as loaded."""
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    if TMA:
        # q_ptr and w_ptr are tensor descriptors: x's [2P, K] rows; the tiles stacked as rows,
        # tile (i, j) at row (i * kt + j) * TILE_N (BLOCK_N == TILE_N: one tile per program)
        w_row = pid * tl.cdiv(K, BLOCK_K) * TILE_N
    elif W_TILED:
        # BLOCK_N // TILE_N whole tiles per program ([N / TILE_N, K / BLOCK_K, TILE_N, BLOCK_K],
        # zero-padded); a tile past the last one re-reads the last (its rows are never stored).
        r = tl.arange(0, BLOCK_N)
        tn = tl.cdiv(N, TILE_N)
        tile = tl.minimum(pid * (BLOCK_N // TILE_N) + r // TILE_N, tn - 1).to(tl.int64)
        w_ptrs = (w_ptr + (tile * (tl.cdiv(K, BLOCK_K) * TILE_N * BLOCK_K))[:, None]
                  + ((r % TILE_N) * BLOCK_K)[:, None] + offs_k[None, :])
        w_step = TILE_N * BLOCK_K
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_ptrs = w_ptr + tl.where(offs_n < N, offs_n, N - 1).to(tl.int64)[:, None] * K + offs_k[None, :]
        w_step = BLOCK_K
    # XR x rows per dot: all 2P (one accumulator, split in the epilogue), or with SPLIT the P high
    # rows (acc) and the P low rows (acc_lo) in dots of their own
    XR: tl.constexpr = BLOCK_P if SPLIT else 2 * BLOCK_P
    if not TMA:
        x_ptrs = q_ptr + tl.arange(0, XR)[:, None] * K + offs_k[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, XR), dtype=tl.int32)
        acc_lo = tl.zeros((BLOCK_N, XR), dtype=tl.int32)
    else:
        acc = tl.zeros((XR, BLOCK_N), dtype=tl.int32)
        acc_lo = tl.zeros((XR, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            # out-of-range columns of x read as zeros; the tiled weight is zero-padded
            xq = q_ptr.load([0, k0])
            if SPLIT:
                xl = q_ptr.load([BLOCK_P, k0])
            wq = w_ptr.load([w_row + (k0 // BLOCK_K) * TILE_N, 0])
        elif EVEN_K:
            xq = tl.load(x_ptrs)
            if SPLIT:
                xl = tl.load(x_ptrs + BLOCK_P * K)
            wq = tl.load(w_ptrs, eviction_policy=W_EVICT)
        else:
            k_ok = (k0 + offs_k[None, :]) < K
            xq = tl.load(x_ptrs, mask=k_ok, other=0)
            if SPLIT:
                xl = tl.load(x_ptrs + BLOCK_P * K, mask=k_ok, other=0)
            if W_TILED:
                wq = tl.load(w_ptrs, eviction_policy=W_EVICT)
            else:
                wq = tl.load(w_ptrs, mask=k_ok, other=0, eviction_policy=W_EVICT)
        if SWAP:
            acc = tl.dot(wq, tl.trans(xq), acc, out_dtype=tl.int32)
            if SPLIT:
                acc_lo = tl.dot(wq, tl.trans(xl), acc_lo, out_dtype=tl.int32)
        else:
            acc = tl.dot(xq, tl.trans(wq), acc, out_dtype=tl.int32)
            if SPLIT:
                acc_lo = tl.dot(xl, tl.trans(wq), acc_lo, out_dtype=tl.int32)
        if not TMA:
            w_ptrs += w_step
            x_ptrs += BLOCK_K
    offs_b = tl.arange(0, BLOCK_P)
    b_ok = offs_b < B
    t = tl.load(t_ptr + offs_b, mask=b_ok, other=0.0)
    if SPLIT:
        hi = acc
        lo = acc_lo
        if SWAP:
            hi = tl.trans(hi)
            lo = tl.trans(lo)
    else:
        if SWAP:
            acc = tl.trans(acc)
        # rows [0, P) hold the high bytes' sums, [P, 2P) the low bytes'
        hi, lo = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_P, BLOCK_N)), (1, 2, 0)))
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(s_ptr + tl.where(offs_n < N, offs_n, N - 1)).to(tl.float32)
    val = (hi.to(tl.float32) * 256.0 + lo.to(tl.float32)) * t[:, None] * s[None, :]
    o_ptrs = o_ptr + offs_b[:, None] * stride_ob + offs_n[None, :]
    tl.store(o_ptrs, val.to(o_ptr.dtype.element_ty), mask=b_ok[:, None] & (offs_n[None, :] < N),
             eviction_policy=O_EVICT)
