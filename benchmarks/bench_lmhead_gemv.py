"""Benchmark the int8 lm-head GEMV (serve/runtime/int8_gemv.py) against F.linear on one GPU.

For the lm-head shape [N=248320, K=3072], each batch B and each activation dtype (bf16, fp16)
it reports the time of what ships (``config_for`` on the weight tiled by ``tile_weight``), the
bytes it must move over that time (GB/s), the ratio to the read bandwidth measured in the same run
(a 2 GiB bf16 sum), the weight bytes over the time against the 4 GiB fp32 sum (the ceiling
docs/kernel.md measures against), and the speed-up over ``torch.nn.functional.linear`` of the
dequantized weight in the same dtype. Every timed variant is first checked against the
dequantized fp32 reference (max error within the fp32 accumulation + output rounding bound,
argmax equal), and every dequant mode in both dtypes and both weight layouts on odd shapes.
``--sweep`` also times candidate configs per table class (bf16; ``--classes`` picks some), the
dequant variants and stage-drop variants; ``--ab`` times, at B = 1..16 and in each dtype, the
row-major weight with its table (the kernel before the tiled layout) against the tiled weight with
its table, in interleaved rounds. Writes one JSON file.

    python benchmarks/bench_lmhead_gemv.py --sweep --ab --out OUT.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch


def _load_gemv():
    try:
        from hybrid_build.serve.runtime import int8_gemv
    except ImportError:  # a bare checkout (the GPU machine): load the file itself
        path = Path(__file__).resolve().parents[1] / "serve" / "int8_gemv.py"
        spec = importlib.util.spec_from_file_location("int8_gemv", path)
        int8_gemv = importlib.util.module_from_spec(spec)
        sys.modules["int8_gemv"] = int8_gemv
        spec.loader.exec_module(int8_gemv)
    return int8_gemv


g = _load_gemv()

BATCHES = (1, 2, 4, 8, 13, 16, 24, 32, 48, 64)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Candidates per table class (the largest batch of the class; the sweep times each at that B):
# (weight layout, config). "rows" is the row-major [N, K] weight, "tiled" the weight stored by
# tile_weight() in the config's tile. Earlier sweeps and probes on the same H200 (lab/kernel_history.md,
# lab/results/lmhead_gemv_h200_*.json) dropped what lost everywhere: other hints, x
# through L1, 64 KB tiles, 256-row tiles, persistent grids. The first candidate of each class is
# the row-major table's entry (the control), the second the tiled table's (what ships).
def _candidates() -> dict[int, list[tuple[str, object]]]:
    G, rows_t, tiled_t = g.GemvConfig, g._H200_ROWS_TABLE, g._H200_TABLE
    R = g.dataclasses.replace
    small = [
        ("rows", rows_t[16]),
        ("tiled", tiled_t[16]),
        ("tiled", R(tiled_t[16], o_evict="")),  # the logits written back as the weight streams by
        ("rows", R(rows_t[16], o_evict="evict_last")),
        ("tiled", G(64, 128, 4, 3, block_m=16, o_evict="evict_last")),
        ("tiled", G(128, 128, 4, 4, block_m=16, o_evict="evict_last")),
        ("tiled", G(128, 256, 4, 3, block_m=16, o_evict="evict_last")),
    ]
    # B = 17-64 (the aim: >= 88 % of the ceiling at every B <= 64): at these batches mma.sync runs
    # out of tensor-core rate (B = 64 needs ~150 us of it against a ~200 us budget), so the
    # candidates are wgmma shapes: x as the left operand with the weight staged through shared
    # memory (block_m 64, also padding B = 17-32 to 64), or the weight as the left operand from
    # registers (swap), with 4 or 8 warps and 2-4 stages; every one checked for sm_121's 99 KiB
    # first (tests/serve/runtime/test_int8_gemv.py compiles the shipped ones for sm_121).
    E = "evict_last"
    wide = [
        ("tiled", G(128, 128, 4, 3, block_m=64, o_evict=E)),
        ("tiled", G(128, 128, 8, 3, block_m=64, o_evict=E)),
        ("tiled", G(128, 128, 4, 2, block_m=64, o_evict=E)),
        ("tiled", G(128, 128, 8, 2, block_m=64, o_evict=E)),
        ("tiled", G(128, 128, 4, 3, block_m=64, o_evict=E, swap=True)),
        ("tiled", G(128, 128, 8, 3, block_m=64, o_evict=E, swap=True)),
        ("tiled", G(128, 128, 4, 4, block_m=64, o_evict=E, swap=True)),
    ]
    # The int8 tensor-core form (act="i16": x on a per-row 16-bit grid as two int8 halves, the
    # weight tile fed to the dot as loaded): one or two 128-row tiles per program, 4 / 8 warps,
    # 3-5 stages, x's rows on either side of the dot.
    # tma: both tiles through the Tensor Memory Accelerator; split: the high and low halves of x
    # as two dots with their own accumulators (an element-wise epilogue). The H200 runs of
    # 2026-12-01 (lab/results/lmhead_gemv_h200_i16_sweep*.json) dropped 4 / 5
    # stages, 8 warps on one tile, two tiles per program (block_n 256, 4 or 8 warps, x's L2 reads
    # halved: no faster), L2 hints, and Triton's warp specialization (fails to compile with 4 warps,
    # slower with 8).
    def i16(p: int) -> list:
        cands = [(128, 4, 3, False, True, False), (128, 4, 2, False, True, False),
                 (128, 4, 3, False, True, True), (128, 4, 2, False, True, True), (128, 4, 4, False, True, True),
                 (128, 4, 3, True, True, True), (128, 4, 2, True, True, True), (128, 8, 3, True, True, True),
                 (128, 4, 3, False, False, True), (256, 8, 3, False, False, True), (256, 8, 3, True, False, True)]
        if p == 64:
            cands += [(128, 8, 3, False, True, True), (256, 8, 4, False, False, True)]
        return [("tiled", G(bn, 128, nw, st, block_m=p, act="i16", swap=sw, tma=tma, split_acc=split, o_evict=E))
                for bn, nw, st, sw, tma, split in cands]
    return {
        8: small,
        16: small,
        32: [("rows", rows_t[32]), ("tiled", tiled_t[32]), ("tiled", R(tiled_t[32], o_evict="")),
             ("tiled", G(128, 128, 8, 4, block_m=16, dots=2, o_evict=E)),
             ("tiled", G(128, 128, 4, 4, block_m=32, o_evict=E, swap=True)),
             ("tiled", G(128, 128, 8, 3, block_m=32, o_evict=E, swap=True))] + wide + i16(32),
        64: [("rows", rows_t[64]), ("tiled", tiled_t[64]), ("tiled", R(tiled_t[64], o_evict=""))] + wide[1:] + i16(64),
    }


SWEEP = _candidates()
# --ab: the B <= 16 question (>= 90 % of the read ceiling for every B <= 16?), the
# configs compared in interleaved rounds at each of these batches.
AB_BATCHES = (1, 4, 8, 9, 12, 13, 16)
U32 = 2.0**-24  # fp32 unit roundoff
# Output rounding (relative, absolute) per dtype on the GPU (round to nearest): bf16 8 significant
# bits; fp16 11 (10-bit mantissa), absolute half the spacing of its subnormals below 2^-14.
OUT_ROUNDING = {torch.bfloat16: (2.0**-8, 2.0**-133), torch.float16: (2.0**-11, 2.0**-25)}
SMOKE = False  # --cpu-smoke: CPU + Triton interpreter, tiny shapes, one untimed-quality call


def dq(mode: str) -> str:
    # The interpreter cannot run inline PTX, and its int8 -> bf16 cast is wrong (triton 3.9).
    return "bits" if SMOKE and mode in ("asm", "cvt") else mode


def log(msg: str) -> None:
    print(msg, flush=True)


def bench_ms(fn) -> float:
    import triton.testing

    if SMOKE:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    # Median over ~100 ms of calls; do_bench zeroes a 256 MB buffer before each call, so the
    # L2 holds nothing useful (the 763 MB weight is 12x the L2 anyway).
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def error_bound(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, ref32: torch.Tensor,
                act: str = "native") -> torch.Tensor:
    """Per-element bound on |kernel - reference| after both are rounded to x's dtype.

    Both sum K exact products (bf16 or fp16 x int8 fits fp32) in fp32: each within gamma(K) * S
    of the exact sum, S = sum_k |x_k q_k| * s; the factor 2 covers tensor cores that truncate
    instead of rounding, plus the two scale roundings. Each rounding to x's dtype adds at most
    u * |value| + a (bf16: u = 2^-8; fp16: u = 2^-11, a = 2^-25 for its subnormals). act="i16"
    adds x's rounding to its 16-bit grid (``i16_error_bound``).
    """
    k = x.shape[1]
    gamma = 2 * (k + 2) * U32 / (1 - 2 * (k + 2) * U32)
    mag = torch.nn.functional.linear(x.float().abs(), w.float().abs()) * s.float().abs()[None, :]
    fp32_err = 2 * gamma * mag
    if act == "i16":
        fp32_err = fp32_err + g.i16_error_bound(x, w, s)
    u, a = OUT_ROUNDING[x.dtype]
    # The interpreter truncates fp32 -> bf16 (one ulp, 2^-7) where the GPU rounds (2^-8).
    u_kernel = 2 * u if SMOKE and x.dtype == torch.bfloat16 else u
    return fp32_err + u_kernel * (ref32.abs() + fp32_err) + u * ref32.abs() + 2 * a


def check(out: torch.Tensor, x, w, s, ref32: torch.Tensor, act: str = "native") -> dict:
    """Error against the bound, and argmax agreement.

    With 248k random logits the top two can lie within one bf16 ulp, where rounding may
    legitimately swap them; so the kernel's argmax must either equal the reference's or
    point at a logit whose reference value is within the error bound of the maximum
    ("argmax_equal" counts rows where the two agree exactly).
    """
    bound = error_bound(x, w, s, ref32, act)
    err = (out.float() - ref32.to(out.dtype).float()).abs()
    ok = bool(torch.isfinite(out.float()).all()) and bool((err <= bound).all())
    am_k = out.float().argmax(dim=1)
    am_r = ref32.argmax(dim=1)
    rows = torch.arange(out.shape[0], device=out.device)
    gap = ref32[rows, am_r] - ref32[rows, am_k]
    tied_ok = bool((gap <= bound[rows, am_r] + bound[rows, am_k]).all())
    return {"max_abs_err": float(err.max()), "max_err_over_bound": float((err / bound).max()),
            "within_bound": ok, "argmax_equal_rows": int((am_k == am_r).sum()), "rows": out.shape[0],
            "argmax_equal": tied_ok}


HEADS = ("uniform", "gaussian")


def make_problem(n: int, k: int, device, head: str = "uniform") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's int8 weight [n, k], its fp32 row scales and the generator for what follows.

    "uniform": codes uniform in [-127, 127], the tables' weight: every bit of
    every byte switches half the time, a worst case for the tensor cores' power. "gaussian":
    Gaussian rows through the tool's own quantizer (calibration/int8_rows.py, loaded by path:
    the GPU machine has the checkout, not the package), as `run` quantizes a real head: codes
    with a standard deviation of ~34 at K = 3,072 (a real head's, heavier-tailed, sit nearer 0 still)."""
    gen = torch.Generator(device=device).manual_seed(1234)
    if head == "uniform":
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=gen)
        s = (torch.rand(n, device=device, generator=gen) + 0.5) * (0.05 / 127)
        return w, s, gen
    if head != "gaussian":
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    path = Path(__file__).resolve().parents[1] / "calibration" / "int8_rows.py"
    spec = importlib.util.spec_from_file_location("int8_rows", path)
    rows_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows_mod)
    w = torch.empty((n, k), dtype=torch.int8, device=device)
    s = torch.empty(n, dtype=torch.float32, device=device)
    for r0 in range(0, n, 16384):
        r1 = min(n, r0 + 16384)
        w[r0:r1], s[r0:r1] = rows_mod.quantize_int8_rows(
            torch.randn(r1 - r0, k, device=device, generator=gen) * 0.02)
    return w, s, gen


def reference(x, w, s, w32_cache: dict) -> torch.Tensor:
    if "w32" not in w32_cache:
        w32_cache["w32"] = w.float() * s.float()[:, None]
    return torch.nn.functional.linear(x.float(), w32_cache["w32"])


def marlin_contender(w_lin: torch.Tensor, dev) -> tuple[object, str]:
    """vLLM's stock int8 weight-only kernel (GPTQ-Marlin, uint8b128, per-channel scales) on the same
    dequantized weight, as a stored 8-bit GPTQ head runs in vLLM: ``(fn(x), note)``, or ``(None,
    why)`` where vLLM cannot be imported. Its own quantization of the weight, so only its time is
    compared."""
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.scalar_type import scalar_types
    except Exception as exc:  # no vLLM here: a contender that could not run, said so
        return None, f"not run: vLLM not importable ({type(exc).__name__}: {str(exc)[:120]})"
    n, k = w_lin.shape
    wtype = scalar_types.uint8b128
    _, q, ms, g_idx, sort_idx, _ = marlin_quantize(w_lin.t().contiguous(), wtype, -1, False)
    workspace = mu.marlin_make_workspace_new(dev)
    zp = mu.marlin_make_empty_g_idx(dev)

    def fn(x):
        return mu.apply_gptq_marlin_linear(x, q, ms, zp, g_idx, sort_idx, workspace, wtype, n, k, True)

    import vllm

    return fn, f"vLLM {vllm.__version__} apply_gptq_marlin_linear, uint8b128, channelwise"


def graph_ms(fn) -> float | None:
    """``fn``'s time replayed from a CUDA graph (no host work between the kernels: how a server
    that captures the head runs it), or None on the CPU smoke run."""
    if SMOKE:
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=248320)
    ap.add_argument("--k", type=int, default=3072)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--dtypes", default="bf16,fp16", help="activation dtypes of the table and the checks")
    ap.add_argument("--sweep", action="store_true", help="time candidate configs and diagnostic variants (bf16)")
    ap.add_argument("--ab", action="store_true",
                    help="B <= 16: the <= 8 entry vs the 9-16 entry (and the sweep's best) in interleaved rounds")
    ap.add_argument("--ab-rounds", type=int, default=7)
    ap.add_argument("--classes", default=None, help="table classes the sweep times (default: all, 8,16,32,64)")
    ap.add_argument("--out", type=Path, required=True, help="JSON output path")
    ap.add_argument("--table-from-sweep", action="store_true",
                    help="the table times the sweep's fastest tiled config per swept class (what a table edit "
                         "would ship) instead of config_for's")
    ap.add_argument("--head", choices=HEADS, default="uniform",
                    help="the weight's codes: uniform int8 (the tables' worst case for power) or Gaussian rows "
                         "through the tool's quantizer (as a real head); see make_problem")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every step on the CPU under TRITON_INTERPRET=1 at --n/--k (checks the script only)")
    args = ap.parse_args(argv)
    global SMOKE
    SMOKE = args.cpu_smoke
    if SMOKE:
        if not g._interpreting():
            print("bench_lmhead_gemv: --cpu-smoke needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        dev = torch.device("cpu")
        gpu_name, sms = "cpu (interpreter smoke run)", 0
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        gpu_name, sms = props.name, props.multi_processor_count
    else:
        print("bench_lmhead_gemv: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    import triton

    n, k = args.n, args.k
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    result: dict = {
        "schema_version": 2,
        "shape": {"N": n, "K": k},
        "env": {"gpu": gpu_name, "sms": sms, "torch": torch.__version__,
                "triton": triton.__version__, "python": platform.python_version()},
        "timing": "triton.testing.do_bench median, L2 flushed before each call; int8_graph_ms: the same call "
                  "replayed from a CUDA graph (no host work between its kernels)",
        "metrics": "GBps: weight + scales + x + output bytes over the time; frac_read_bw: that over the 2 GiB "
                   "bf16 sum; frac_ceiling: the int8 weight and its scales over the time, over the larger of "
                   "the 4 GiB fp32 sum and the 2 GiB bf16 sum (docs/kernel.md's metric and ceiling: the aim is "
                   ">= 0.88 at every B <= 64 and >= 0.90 for B <= 16)",
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    t0 = time.time()
    w, s, gen = make_problem(n, k, dev, args.head)
    result["head"] = args.head
    w32_cache: dict = {}

    # Read bandwidth: the sum of a 2 GiB bf16 tensor (docs/kernel.md's first ceiling), and of a
    # 4 GiB fp32 tensor (the ceiling docs/kernel.md uses, 4,426 GB/s); one read, a negligible write.
    big16 = torch.randn(2**30 if not SMOKE else 2**16, device=dev, dtype=torch.bfloat16, generator=gen)
    t_sum = bench_ms(lambda: big16.sum(dtype=torch.float32))
    read_gbs = big16.numel() * 2 / t_sum / 1e6
    big16 = None  # freed before the next (the lambda that read it is gone)
    big32 = torch.randn(2**30 if not SMOKE else 2**16, device=dev, dtype=torch.float32, generator=gen)
    t_sum32 = bench_ms(lambda: big32.sum())
    ceiling_gbs = big_gbs32 = big32.numel() * 4 / t_sum32 / 1e6
    big32 = None
    t_sum_w = bench_ms(lambda: w.sum(dtype=torch.int32))
    # The ceiling: the larger of the two sums, measured here.
    ceiling_gbs = max(ceiling_gbs, read_gbs)
    result["read_bandwidth"] = {"bf16_sum_2GiB_GBps": read_gbs, "ms": t_sum, "fp32_sum_4GiB_GBps": big_gbs32,
                                "ceiling_GBps": ceiling_gbs, "int8_weight_sum_GBps": w.numel() / t_sum_w / 1e6}
    log(f"read bandwidth: {read_gbs:.0f} GB/s (2 GiB bf16 sum), ceiling {ceiling_gbs:.0f} GB/s (4 GiB fp32 sum); "
        f"int8 weight sum {w.numel() / t_sum_w / 1e6:.0f} GB/s")

    def kernel_bytes(b: int, w_bytes: int = 1) -> int:
        return n * k * w_bytes + n * 4 + b * k * 2 + b * n * 2

    def frac_ceiling(ms: float) -> float:
        """The int8 weight and its scales over the time, over the ceiling."""
        return (n * k + n * s.element_size()) / ms / 1e6 / ceiling_gbs

    tiled_cache: dict = {}

    def weight_in(layout: str, cfg):
        """The weight as the config reads it: row-major, or tiled in the config's tile (cached)."""
        if layout == "rows":
            return w
        key = (cfg.block_n, cfg.block_k)
        if key not in tiled_cache:
            tiled_cache.clear()  # one tiled copy at a time (763 MB each)
            tiled_cache[key] = g.tile_weight(w, key)
        return tiled_cache[key]

    def run_variant(b: int, cfg, dtype=torch.bfloat16, stage="full", weight=None, verify=True,
                    layout="rows") -> dict:
        x = torch.randn(b, k, device=dev, dtype=dtype, generator=gen)
        out = torch.full((b, n), float("nan"), device=dev, dtype=dtype)
        wt = weight_in(layout, cfg) if weight is None else weight
        rec = {"B": b, "dtype": str(dtype).replace("torch.", ""), "layout": layout, "config": cfg.as_dict(),
               "stage": stage}
        try:
            g._launch(x, wt, s, out, cfg, stage=stage)
            if not SMOKE:
                torch.cuda.synchronize()
        except Exception as exc:  # a config the compiler rejects is a data point, not a crash
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            return rec
        if verify and stage == "full":
            ref = reference(x, w, s, w32_cache) if weight is None else torch.nn.functional.linear(
                x.float(), wt.float())
            rec["check"] = check(out, x, w, s, ref, cfg.act) if weight is None else {
                "max_abs_err": float((out.float() - ref).abs().max())}
        ms = bench_ms(lambda: g._launch(x, wt, s, out, cfg, stage=stage))
        rec["ms"] = ms
        rec["GBps"] = kernel_bytes(b, wt.element_size()) / ms / 1e6
        rec["frac_read_bw"] = rec["GBps"] / read_gbs
        rec["frac_ceiling"] = frac_ceiling(ms)
        return rec

    best: dict[int, dict] = {}
    if args.sweep:
        sweep_rows = []
        classes = [int(c) for c in args.classes.split(",")] if args.classes else list(SWEEP)
        for cls, cands in ((c, SWEEP[c]) for c in classes):
            for layout, c in cands:
                cfg = g.dataclasses.replace(c, dequant=dq(c.dequant))
                rec = run_variant(cls, cfg, layout=layout)
                sweep_rows.append(rec)
                log(f"sweep B={cls:2d} {layout} {cfg} -> {rec.get('ms', rec.get('error'))}")
                if "ms" in rec and rec["check"]["within_bound"] and (cls not in best or rec["ms"] < best[cls]["ms"]):
                    best[cls] = rec
        result["sweep"] = sweep_rows
        result["sweep_best"] = {str(c): dict(r["config"], layout=r["layout"]) for c, r in best.items()}
        save()
        # act="i16" winners: x's quantizer alone and the int8 dot alone (their sum against the full call)
        split = []
        for cls, rec in best.items():
            if rec["config"].get("act") == "i16":
                for stage in ("quant_only", "dot_only"):
                    i16_cfg = g.GemvConfig(**rec["config"])
                    split.append(dict(run_variant(cls, i16_cfg, stage=stage, layout=rec["layout"]), full_ms=rec["ms"]))
                    log(f"i16 B={cls} {stage}: {split[-1].get('ms', split[-1].get('error'))} ms of {rec['ms']}")
        result["i16_split"] = split
        save()
        # Diagnostics at B=16 with the best config: dequant variants (both dtypes), stage drops
        # (no dot, loads only, no output store), a bf16 weight (row-major) through the same kernel.
        base, lay = (best[16]["config"], best[16]["layout"]) if 16 in best else (g._H200_TABLE[16].as_dict(), "tiled")
        diag = []
        for dtype in dtypes:
            for mode in ("cvt", "bits", "asm"):
                diag.append(dict(run_variant(16, g.GemvConfig(**{**base, "dequant": dq(mode)}), dtype, layout=lay),
                                 variant=f"{str(dtype)[6:]} dequant={mode}"))
        for stage in ("no_dot", "load", "no_store"):
            diag.append(dict(run_variant(16, g.GemvConfig(**base), stage=stage, layout=lay), variant=f"stage={stage}"))
        w_bf16 = (w.float() * s[:, None]).to(torch.bfloat16)
        diag.append(dict(run_variant(16, g.GemvConfig(**{**base, "dequant": "none"}), weight=w_bf16),
                         variant="bf16 weight (row-major), same kernel"))
        del w_bf16
        for d in diag:
            log(f"diag {d['variant']:28s} {d.get('ms', d.get('error'))} ms  {d.get('GBps', 0):.0f} GB/s")
        result["diagnostics_B16"] = diag
        save()

    # Odd shapes through the kernel (masking, K tail, batch chunking past 64), every dequant mode,
    # dtype and weight layout, each batch chunk with the config of its class for that layout; mode
    # "i16" runs that config in the int8 tensor-core form (act="i16") at every batch.
    odd = []
    shapes = [(13, 1000, 272), (33, 517, 3072), (64, 4097, 48), (100, 300, 160), (1, n, k), (16, n, k)]
    for b, nn, kk in shapes if not SMOKE else [(13, 40, 48), (100, 30, 32)]:
        ws = torch.randint(-127, 128, (nn, kk), dtype=torch.int8, device=dev, generator=gen)
        ss = torch.rand(nn, device=dev, generator=gen) * 0.01 + 1e-3
        w_tiled = g.tile_weight(ws)
        modes = ("cvt", "bits", "asm", "i16")
        for dtype, layout, mode in ((d, lay, m) for d in dtypes for lay in ("rows", "tiled") for m in modes):
            x = torch.randn(b, kk, device=dev, dtype=dtype, generator=gen)
            ref = torch.nn.functional.linear(x.float(), ws.float() * ss[:, None])
            out = torch.full((b, nn), float("nan"), device=dev, dtype=dtype)
            rec = {"B": b, "N": nn, "K": kk, "dtype": str(dtype)[6:], "layout": layout, "dequant": mode}
            tile = g.TILE if layout == "tiled" else None
            try:
                for b0 in range(0, b, 64):
                    xb = x[b0:b0 + 64]
                    cfg = g.config_for(xb.shape[0], dev, dtype, tile=tile)
                    if mode == "i16":
                        cfg = g.dataclasses.replace(cfg, act="i16", dots=1, swap=False,
                                                    block_m=g.block_b_for(xb.shape[0]))
                    else:
                        cfg = g.dataclasses.replace(cfg, dequant=dq(mode))
                    g._launch(xb, w_tiled if tile else ws, ss, out[b0:b0 + 64], cfg)
            except Exception as exc:
                odd.append({**rec, "within_bound": False, "argmax_equal": False,
                            "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            odd.append({**rec, **check(out, x, ws, ss, ref, cfg.act)})
    result["odd_shapes"] = odd
    log("odd shapes: " + ("all within bound, argmax equal" if all(
        o["within_bound"] and o["argmax_equal"] for o in odd) else json.dumps(odd)))
    save()

    if args.ab:
        # The B <= 16 question: the row-major weight with its table (the control: the kernel as it
        # was before the tiled layout) against the tiled weight with its table (what ships), and
        # the sweep's B <= 16 best where it is neither, in interleaved rounds, so that drift (clocks,
        # temperature) hits every config alike, in every dtype: the median per config, the spread
        # (max - min) of its rounds, and each candidate first checked against the reference.
        cands = {"control": ("rows", g._H200_ROWS_TABLE[16]), "tiled": ("tiled", g._H200_TABLE[16])}
        if 16 in best:
            bc = (best[16]["layout"], g.GemvConfig(**best[16]["config"]))
            if (bc[0], g.dataclasses.replace(bc[1], dequant="asm")) not in [
                    (lay, g.dataclasses.replace(c, dequant="asm")) for lay, c in cands.values()]:
                cands["sweep_best16"] = bc
        ab = []
        for dtype in dtypes:
            checks = {}
            for name, (lay, c) in cands.items():
                c = g.dataclasses.replace(c, dequant=dq(g.config_for(16, dev, dtype).dequant))
                cands[name] = (lay, c)
                checks[name] = run_variant(16 if not SMOKE else 13, c, dtype, layout=lay).get("check")
            for b in AB_BATCHES if not SMOKE else (1, 13):
                x = torch.randn(b, k, device=dev, dtype=dtype, generator=gen)
                out = torch.empty((b, n), device=dev, dtype=dtype)
                times: dict[str, list[float]] = {name: [] for name in cands}
                for _ in range(args.ab_rounds if not SMOKE else 1):
                    for name, (lay, cfg) in cands.items():
                        wl = weight_in(lay, cfg)
                        times[name].append(bench_ms(lambda: g._launch(x, wl, s, out, cfg)))
                row = {"B": b, "dtype": str(dtype)[6:], "configs": {name: dict(c.as_dict(), layout=lay)
                                                                    for name, (lay, c) in cands.items()},
                       "checks_B16": checks}
                for name, t in times.items():
                    row[name] = {"ms_median": median(t), "ms_spread": max(t) - min(t), "ms": t,
                                 "frac_ceiling": frac_ceiling(median(t)),
                                 "ratio_to_control": median(t) / median(times["control"])}
                ab.append(row)
                log(f"ab {str(dtype)[6:]} B={b:2d} " + "  ".join(
                    f"{name} {row[name]['ms_median'] * 1e3:6.1f} us (+-{row[name]['ms_spread'] * 1e3:.1f}, "
                    f"{row[name]['frac_ceiling']:5.1%})" for name in cands))
        result["ab_b16"] = ab
        save()

    # What ships: the weight tiled by tile_weight, config_for's config per batch and dtype (the
    # tiled table's), against F.linear of a dequantized weight in the same dtype.
    table = []
    tiled_cache.clear()
    w_t = g.tile_weight(w)
    for dtype in dtypes:
        w_lin = (w.float() * s[:, None]).to(dtype)
        marlin_fn, result["marlin"] = marlin_contender(w_lin, dev) if not SMOKE else (None, "not run: CPU smoke run")
        for b in batches:
            cfg = g.config_for(b, dev, dtype, tile=g.TILE)
            picked = best.get(g.table_class(b)) if args.table_from_sweep else None
            if picked is not None and picked["layout"] == "tiled":
                cfg = g.dataclasses.replace(g.GemvConfig(**picked["config"]), dequant=cfg.dequant)
            cfg = g.dataclasses.replace(cfg, dequant=dq(cfg.dequant))
            x = torch.randn(b, k, device=dev, dtype=dtype, generator=gen)
            out = torch.full((b, n), float("nan"), device=dev, dtype=dtype)
            g.int8_linear(x, w_t, s, out=out, config=cfg)
            chk = check(out, x, w, s, reference(x, w, s, w32_cache), cfg.act)
            t_int8 = bench_ms(lambda: g.int8_linear(x, w_t, s, out=out, config=cfg))
            t_graph = graph_ms(lambda: g.int8_linear(x, w_t, s, out=out, config=cfg))
            t_lin = bench_ms(lambda: torch.nn.functional.linear(x, w_lin))
            t_marlin = bench_ms(lambda: marlin_fn(x)) if marlin_fn is not None else None
            gbs = kernel_bytes(b) / t_int8 / 1e6
            gbs_lin = kernel_bytes(b, 2) / t_lin / 1e6
            dname = str(dtype)[6:]
            row = {"B": b, "dtype": dname, "layout": "tiled", "config": cfg.as_dict(),
                   "int8_ms": t_int8, "int8_GBps": gbs, "int8_frac_read_bw": gbs / read_gbs,
                   "int8_frac_ceiling": frac_ceiling(t_int8),
                   "linear_ms": t_lin, "linear_GBps": gbs_lin, "linear_frac_read_bw": gbs_lin / read_gbs,
                   "speedup_vs_linear": t_lin / t_int8, "check": chk,
                   "marlin_ms": t_marlin, "marlin_frac_ceiling": frac_ceiling(t_marlin) if t_marlin else None,
                   "int8_graph_ms": t_graph, "int8_graph_frac_ceiling": frac_ceiling(t_graph) if t_graph else None}
            table.append(row)
            log(f"{dname} B={b:2d} int8 {t_int8 * 1e3:7.1f} us {gbs:6.0f} GB/s ({gbs / read_gbs:5.1%}; "
                f"ceiling {frac_ceiling(t_int8):5.1%})  F.linear {t_lin * 1e3:7.1f} us ({gbs_lin / read_gbs:5.1%})  "
                f"x{t_lin / t_int8:4.2f}  err/bound {chk['max_err_over_bound']:.2f} "
                f"argmax {'ok' if chk['argmax_equal'] else 'DIFF'}"
                + (f"  Marlin {t_marlin * 1e3:7.1f} us ({frac_ceiling(t_marlin):5.1%})" if t_marlin else "")
                + (f"  graph {t_graph * 1e3:7.1f} us ({frac_ceiling(t_graph):5.1%})" if t_graph else ""))
        w_lin = marlin_fn = None  # freed before the next dtype's copy
    result["table"] = table
    result["not_run_here"] = {
        "seed_v3": "the seed's patch_int8_lmhead_v3 kernel: its source is not available here; ../shared/FACTS.md "
                   "records ~251 us at B = 1 on this H200",
        "albond_v2": "albond's v2 kernel: source not available here; FACTS.md records 219 us at B = 1 and 440 us "
                     "at B = 4 (a loop over rows above B = 4)"}
    result["wall_s"] = time.time() - t0
    save()
    log(f"wrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
