"""Where the int8 lm-head kernel loses its last percent at B <= 16, measured on one GPU.

For the [N=248320, K=3072] head, each figure a ratio to a baseline measured in the same run:

* ``--variants``: the row-major weight with its table (the kernel before the tiled layout: the
  control) against the weight tiled by ``tile_weight`` with its table (what ships), and two
  diagnostics: the tiled kernel without its output store, and the row-major kernel with the
  logits kept in L2. Interleaved rounds per batch and dtype; the median, the spread and the share
  of the 4 GiB fp32 sum's bandwidth (the ceiling), every variant checked first;
* ``--waves``: both at N = 7 and 8 full waves of 128-row tiles over the resident programs against
  the head's N (7.35 waves): what a part-empty last wave costs;
* ``--flush``: the timer zeroes 256 MB before every call, as ``triton.testing.do_bench`` does, so
  up to an L2 of dirty lines is written back during the timed call; the same after a read-only
  flush (a 256 MB sum), which leaves the L2 clean, as before an lm-head in a decode step.

Its own timer (CUDA events around each call, one flush before each) keeps the rounds within
about a microsecond. ``--ncu`` only launches the kernels ncu profiles:

    python lab/probes/probe_lmhead_sched.py --variants --waves --flush --out probe.json
    ncu --clock-control none -k regex:int8_gemv --section SpeedOfLight python lab/probes/probe_lmhead_sched.py --ncu

Earlier versions of this script (git history, the results in
``lab/results/lmhead_sched_probes_h200.json``) also timed a persistent grid, a
rotated K order, x through L1 with shared-memory carveouts, and other tilings: all slower.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import DTYPES, check, g, median, reference  # noqa: E402

N, K = 248320, 3072


def timer(flush: str, cache: torch.Tensor):
    """Median ms of ``fn`` over ``reps`` calls, each after a flush of the L2: "zero" (as do_bench:
    leaves the L2 full of dirty lines) or "read" (a sum over the same buffer: leaves it clean)."""

    def run(fn, reps: int = 200) -> float:
        for _ in range(5):
            fn()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if flush == "zero":
                cache.zero_()
            else:
                cache.sum(dtype=torch.int32)
            start[i].record()
            fn()
            end[i].record()
        torch.cuda.synchronize()
        return median([s.elapsed_time(e) for s, e in zip(start, end)])

    return run


def resident_programs(cfg, x, w, s, out) -> int:
    """Programs of ``cfg`` resident at once on this GPU, from the compiled kernel's registers and
    shared memory (1 KB of shared memory reserved per program, as on Hopper)."""
    ck = g._launch(x, w, s, out, cfg)
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(x.device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    per_sm = min(regs_sm // max(ck.n_regs * 32 * cfg.num_warps, 1), smem_sm // (ck.metadata.shared + 1024), 32)
    print(f"  {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: {ck.n_regs} regs, "
          f"{ck.metadata.shared} B shared -> {per_sm} per SM", flush=True)
    return props.multi_processor_count * per_sm


def variants() -> dict[str, tuple[str, object, str]]:
    """name -> (weight layout, config, stage), the B <= 16 entries of each table."""
    R = g.dataclasses.replace
    rows, tiled = g._H200_ROWS_TABLE[16], g._H200_TABLE[16]
    return {
        "control": ("rows", rows, "full"),
        "tiled": ("tiled", tiled, "full"),
        "tiled_no_store": ("tiled", tiled, "no_store"),
        "rows_logits_in_l2": ("rows", R(rows, o_evict="evict_last"), "full"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--waves", action="store_true")
    ap.add_argument("--flush", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,2,4,8,9,12,13,16")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_lmhead_sched: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234)
    n_max = 270336  # room for 8 full waves of 264 programs x 128 rows
    w_all = torch.randint(-127, 128, (n_max, K), dtype=torch.int8, device=dev, generator=gen)
    s_all = (torch.rand(n_max, device=dev, generator=gen) + 0.5) * (0.05 / 127)
    w, s = w_all[:N], s_all[:N]
    weights = {"rows": w, "tiled": g.tile_weight(w)}
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    t_zero, t_read = timer("zero", cache), timer("read", cache)
    res: dict = {"gpu": torch.cuda.get_device_name(dev), "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
                 "timing": "median of 200 calls per round, CUDA events, 256 MB zeroed before each call"}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")

    big = torch.randn(2**30, device=dev, dtype=torch.float32, generator=gen)
    ceil = {f: big.numel() * 4 / t(lambda: big.sum(), reps=30) / 1e6 for f, t in (("zero", t_zero), ("read", t_read))}
    del big
    res["ceiling_GBps"] = ceil
    print("ceiling GB/s (4 GiB fp32 sum):", {f: round(v) for f, v in ceil.items()}, flush=True)

    def frac(ms, rows=N, flush="zero"):
        return rows * K / ms / 1e6 / ceil[flush]

    x16 = torch.randn(16, K, device=dev, dtype=torch.bfloat16, generator=gen)
    out16 = torch.empty(16, N, device=dev, dtype=torch.bfloat16)
    res["resident_programs"] = {lay: resident_programs(g._H200_ROWS_TABLE[16] if lay == "rows" else g._H200_TABLE[16],
                                                       x16, weights[lay], s, out16) for lay in weights}
    cands = variants()

    if args.variants:
        rows = []
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for b in [int(v) for v in args.batches.split(",")]:
                x = torch.randn(b, K, device=dev, dtype=dtype, generator=gen)
                out = torch.empty(b, N, device=dev, dtype=dtype)
                ref = reference(x, w, s, {})
                checks, times = {}, {name: [] for name in cands}
                for name, (lay, c, stage) in cands.items():
                    out.fill_(float("nan"))
                    g._launch(x, weights[lay], s, out, c, stage=stage)
                    checks[name] = check(out, x, w, s, ref) if stage == "full" else None
                del ref
                for _ in range(args.rounds):
                    for name, (lay, c, stage) in cands.items():
                        times[name].append(t_zero(lambda: g._launch(x, weights[lay], s, out, c, stage=stage)))
                row = {"B": b, "dtype": dname}
                for name, t in times.items():
                    lay, c, stage = cands[name]
                    chk = checks[name]
                    row[name] = {"ms": t, "ms_median": median(t), "spread": max(t) - min(t),
                                 "frac_ceiling": frac(median(t)), "ratio": median(t) / median(times["control"]),
                                 "layout": lay, "config": c.as_dict(), "stage": stage,
                                 "check_ok": None if chk is None else chk["within_bound"] and chk["argmax_equal"]}
                rows.append(row)
                print(f"{dname} B={b:2d} " + "  ".join(
                    f"{nm} {row[nm]['ms_median'] * 1e3:.1f}us (+-{row[nm]['spread'] * 1e3:.1f}, "
                    f"{row[nm]['frac_ceiling']:.1%}, {({True: 'ok', False: 'BAD', None: '-'})[row[nm]['check_ok']]})"
                    for nm in cands), flush=True)
                res["variants"] = rows
                save()
    if args.waves:
        rows = []
        per_wave = res["resident_programs"]["rows"] * 128
        tiled_all = g.tile_weight(w_all)
        for nn in (per_wave * 7, N, per_wave * 8):
            for b in (1, 16):
                x = torch.randn(b, K, device=dev, dtype=torch.bfloat16, generator=gen)
                out = torch.empty(b, nn, device=dev, dtype=torch.bfloat16)
                r = {"N": nn, "B": b, "waves_rows": nn / per_wave}
                for name, wl in (("control", w_all[:nn]), ("tiled", tiled_all[:nn // 128])):
                    lay, c, stage = cands[name]
                    r[name] = t_zero(lambda: g._launch(x, wl, s_all[:nn], out, c))
                    r[name + "_frac"] = frac(r[name], nn)
                rows.append(r)
                print(f"waves N={nn} B={b} ({r['waves_rows']:.2f} waves of the row-major grid): control "
                      f"{r['control'] * 1e3:.1f}us {r['control_frac']:.1%}  tiled {r['tiled'] * 1e3:.1f}us "
                      f"{r['tiled_frac']:.1%}", flush=True)
        del tiled_all
        res["waves"] = rows
        save()
    if args.flush:
        rows = []
        for b in (1, 16):
            x = torch.randn(b, K, device=dev, dtype=torch.bfloat16, generator=gen)
            out = torch.empty(b, N, device=dev, dtype=torch.bfloat16)
            for name in ("control", "tiled"):
                lay, c, stage = cands[name]
                tz = t_zero(lambda: g._launch(x, weights[lay], s, out, c))
                tr = t_read(lambda: g._launch(x, weights[lay], s, out, c))
                rows.append({"B": b, "variant": name, "zero_flush_ms": tz, "read_flush_ms": tr,
                             "frac_zero": frac(tz), "frac_read": frac(tr, flush="read")})
                print(f"flush B={b} {name}: zero {tz * 1e3:.1f}us ({rows[-1]['frac_zero']:.1%})  "
                      f"read {tr * 1e3:.1f}us ({rows[-1]['frac_read']:.1%})", flush=True)
        res["flush"] = rows
        save()
    save()
    return 0


def ncu_launches() -> None:
    """One launch of each variant at B = 1 and 16, bf16 (run under ncu -k regex:int8_gemv)."""
    dev = torch.device("cuda")
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
    s = torch.rand(N, device=dev) * 1e-3
    weights = {"rows": w, "tiled": g.tile_weight(w)}
    for b in (1, 16):
        x = torch.randn(b, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(b, N, device=dev, dtype=torch.bfloat16)
        for name, (lay, c, stage) in variants().items():
            g._launch(x, weights[lay], s, out, c, stage=stage)
            print("ncu target", b, name, flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ncu"]:
        ncu_launches()
        raise SystemExit(0)
    raise SystemExit(main())
