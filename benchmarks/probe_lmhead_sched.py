"""Where the int8 lm-head kernel loses its last percent: the schedule, not the bytes (issue 17).

Diagnostics on one GPU for the [N=248320, K=3072] head, each printed as a ratio to the shipped
config measured in the same run (interleaved rounds, median and spread):

* ``--variants``: the shipped grid (one program per 128-row tile, 1940 programs) against a
  persistent grid (one program per resident slot, equal row runs, so no part-empty last
  wave), a rotated K order (programs start their K walk at different offsets, so they do not all
  read the same x lines at once), and combinations, at B = 1, 8, 16;
* ``--waves``: the shipped grid at N = 7 and 8 full waves of 128-row tiles over the resident
  slots against the head's N (7.35 waves): the cost of the last wave's empty slots;
* ``--flush``: do_bench's L2 flush zeroes 256 MB, so up to an L2 of dirty lines is written back
  during the timed call; the same timings after a read-only flush (a 256 MB sum) for comparison.

    python benchmarks/probe_lmhead_sched.py --variants --waves --flush --out probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lmhead_gemv import check, g, median, reference  # noqa: E402


def timer(flush: str, cache: torch.Tensor):
    """Median ms of fn over ``reps`` calls, each after a flush of the L2 ("zero" as do_bench,
    "read": a sum over the same buffer, which leaves the L2 clean)."""

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


def set_carveout(ck, pct: int | None) -> None:
    """Ask the driver for ``pct`` % of the SM's shared-memory maximum as shared memory (the rest is
    L1) for kernel ``ck``; None restores Triton's setting (prefer shared memory, no carveout)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(ck.function)
    # CU_FUNC_CACHE_PREFER_NONE = 0, CU_FUNC_CACHE_PREFER_SHARED = 1;
    # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9 (-1: the driver's default)
    r1 = cuda.cuFuncSetCacheConfig(fn, ctypes.c_int(1 if pct is None else 0))
    r2 = cuda.cuFuncSetAttribute(fn, ctypes.c_int(9), ctypes.c_int(-1 if pct is None else pct))
    if r1 or r2:
        raise RuntimeError(f"cuFuncSetCacheConfig / cuFuncSetAttribute returned {r1} / {r2}")


def resident_slots(cfg, x, w, s, out) -> int:
    """Programs of ``cfg`` resident at once on this GPU, from the compiled kernel's registers and
    shared memory (1 KB of shared memory reserved per program, as on Hopper)."""
    ck = g._launch(x, w, s, out, cfg)
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(x.device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs = ck.n_regs * 32 * cfg.num_warps
    per_sm = min(regs_sm // max(regs, 1), smem_sm // (ck.metadata.shared + 1024), 32)
    print(f"  {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: {ck.n_regs} regs, "
          f"{ck.metadata.shared} B shared -> {per_sm} per SM", flush=True)
    return props.multi_processor_count * per_sm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--waves", action="store_true")
    ap.add_argument("--flush", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,8,9,13,16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    n, k = 248320, 3072
    gen = torch.Generator(device=dev).manual_seed(1234)
    n_max = 270336
    w_all = torch.randint(-127, 128, (n_max, k), dtype=torch.int8, device=dev, generator=gen)
    s_all = (torch.rand(n_max, device=dev, generator=gen) + 0.5) * (0.05 / 127)
    w, s = w_all[:n], s_all[:n]
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    t_zero, t_read = timer("zero", cache), timer("read", cache)
    res: dict = {"gpu": torch.cuda.get_device_name(dev), "sms": torch.cuda.get_device_properties(dev).multi_processor_count}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")

    big = torch.randn(2**30, device=dev, dtype=torch.float32, generator=gen)
    ceil = {f: big.numel() * 4 / t(lambda: big.sum(), reps=30) / 1e6 for f, t in (("zero", t_zero), ("read", t_read))}
    del big
    res["ceiling_GBps"] = ceil
    print("ceiling GB/s (4 GiB fp32 sum):", {f: round(v) for f, v in ceil.items()}, flush=True)
    base = g._H200_TABLE[16]
    x16 = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
    out16 = torch.empty(16, n, device=dev, dtype=torch.bfloat16)
    slots = resident_slots(base, x16, w, s, out16)
    slots_s = resident_slots(g.GemvConfig(128, 128, 4, 3, block_m=16), x16, w, s, out16)
    res["slots"] = {"128x256": slots, "128x128": slots_s}
    print("resident slots:", res["slots"], flush=True)

    def frac(ms, rows=n):
        return rows * k / ms / 1e6 / ceil["zero"]

    R = g.dataclasses.replace
    G = g.GemvConfig
    # name -> (config, shared-memory carveout in % of the SM's 228 KB or None for Triton's default,
    # weight layout: "rows" (row-major [N, K]) or "tiled" (tile_weight for the config's tile), stage).
    # The driver rounds a carveout up to its next size: 37 % -> 100 KB, 55 % -> 132 KB, 71 % -> 164 KB
    # (the rest of the SM's 256 KB is L1, where the 8-byte "narrow" x copies are cached).
    T = G(128, 128, 4, 3, block_m=16)
    small = {
        "control": (base, None, "rows", "full"),
        "t128x128s3": (T, None, "tiled", "full"),
        "t_o_last": (R(T, o_evict="evict_last"), None, "tiled", "full"),
        "t_o_last_w_first": (R(T, o_evict="evict_last", w_evict="evict_first"), None, "tiled", "full"),
        "t_o_first": (R(T, o_evict="evict_first"), None, "tiled", "full"),
        "t_no_store": (T, None, "tiled", "no_store"),
        "control_no_store": (base, None, "rows", "no_store"),
        "control_o_last": (R(base, o_evict="evict_last"), None, "rows", "full"),
    }
    large = {  # B = 17-64: the table's config of the class on both layouts
        32: {"control": (g._H200_TABLE[32], None, "rows", "full"), "t_table": (g._H200_TABLE[32], None, "tiled", "full"),
             "t128x128m32": (G(128, 128, 4, 3, block_m=32), None, "tiled", "full")},
        64: {"control": (g._H200_TABLE[64], None, "rows", "full"), "t_table": (g._H200_TABLE[64], None, "tiled", "full"),
             "t128x128m32x2": (G(128, 128, 4, 3, block_m=32, dots=2), None, "tiled", "full")},
    }
    cands = dict(small)
    weights = {}

    def weight_for(c, layout):
        if layout == "rows":
            return w
        key = (c.block_n, c.block_k)
        if key not in weights:
            weights[key] = g.tile_weight(w, *key)
        return weights[key]

    compiled = {}

    def launcher(name, x, out):
        c, cv, layout, stage = cands[name]
        wt = weight_for(c, layout)

        def fn():
            return g._launch(x, wt, s, out, c, stage=stage)

        ck = fn()
        set_carveout(ck, cv)
        compiled[(name, id(ck))] = compiled[name] = ck
        return fn

    if args.variants:
        rows = []
        for b in [int(v) for v in args.batches.split(",")]:
            cands.clear()
            cands.update(small if b <= 16 else large[g.table_class(b)])
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
            out = torch.empty(b, n, device=dev, dtype=torch.bfloat16)
            ref = reference(x, w, s, {})
            checks = {}
            for name in cands:
                out.fill_(float("nan"))
                launcher(name, x, out)()
                checks[name] = check(out, x, w, s, ref) if cands[name][3] == "full" else None
            del ref
            times = {name: [] for name in cands}
            for _ in range(args.rounds):
                for name in cands:
                    fn = launcher(name, x, out)
                    times[name].append(t_zero(fn))
            row = {"B": b}
            for name, t in times.items():
                ck = compiled[name]
                chk = checks[name]
                row[name] = {"ms": t, "ms_median": median(t), "spread": max(t) - min(t), "frac_ceiling": frac(median(t)),
                             "ratio": median(t) / median(times["control"]), "config": cands[name][0].as_dict(),
                             "carveout_pct": cands[name][1], "layout": cands[name][2], "stage": cands[name][3],
                             "regs": ck.n_regs, "shared": ck.metadata.shared,
                             "check_ok": None if chk is None else chk["within_bound"] and chk["argmax_equal"]}
            rows.append(row)
            print(f"B={b:2d} " + "  ".join(f"{nm} {row[nm]['ms_median']*1e3:.1f}us({row[nm]['frac_ceiling']:.1%},"
                                          f"{ {True: 'ok', False: 'BAD', None: '-'}[row[nm]['check_ok']]})"
                                          for nm in cands), flush=True)
            res["variants"] = rows
            save()
        for ck in compiled.values():
            set_carveout(ck, None)
    if args.waves:
        rows = []
        for nn in (slots * 7 * 128, n, slots * 8 * 128):
            for b in (1, 16):
                x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
                out = torch.empty(b, nn, device=dev, dtype=torch.bfloat16)
                ww, ss = w_all[:nn], s_all[:nn]
                r = {"N": nn, "B": b, "waves": nn / 128 / slots}
                for name in ("control",):
                    c = cands[name][0]
                    r[name] = t_zero(lambda: g._launch(x, ww, ss, out, c))
                    r[name + "_frac"] = frac(r[name], nn)
                rows.append(r)
                print(f"waves N={nn} B={b} ({r['waves']:.2f} waves): control {r['control']*1e3:.1f}us "
                      f"{r['control_frac']:.1%}", flush=True)
        res["waves"] = rows
        save()
    if args.flush:
        rows = []
        for b in (1, 16):
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
            out = torch.empty(b, n, device=dev, dtype=torch.bfloat16)
            for name in ("control",):
                c = cands[name][0]
                tz = t_zero(lambda: g._launch(x, w, s, out, c))
                tr = t_read(lambda: g._launch(x, w, s, out, c))
                rows.append({"B": b, "config": name, "zero_flush_ms": tz, "read_flush_ms": tr,
                             "frac_zero": n * k / tz / 1e6 / ceil["zero"], "frac_read": n * k / tr / 1e6 / ceil["read"]})
                print(f"flush B={b} {name}: zero {tz*1e3:.1f}us ({rows[-1]['frac_zero']:.1%})  "
                      f"read {tr*1e3:.1f}us ({rows[-1]['frac_read']:.1%})", flush=True)
        res["flush"] = rows
        save()
    save()
    return 0


def ncu_launches() -> None:
    """One launch of each ncu target at B = 16 (run under ncu -k regex:int8_gemv)."""
    dev = torch.device("cuda")
    n, k = 248320, 3072
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
    s = torch.rand(n, device=dev) * 1e-3
    R = g.dataclasses.replace
    base = g._H200_TABLE[16]
    s128 = g.GemvConfig(128, 128, 4, 3, block_m=16)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(16, n, device=dev, dtype=torch.bfloat16)
    T = g.GemvConfig(128, 128, 4, 3, block_m=16)
    wt = g.tile_weight(w, 128, 128)
    for b in (1, 16):
        x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(b, n, device=dev, dtype=torch.bfloat16)
        for c in (T, R(T, o_evict="evict_last")):
            g._launch(x, wt, s, out, c)
            print("ncu target", b, c.as_dict(), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ncu"]:
        ncu_launches()
        raise SystemExit(0)
    raise SystemExit(main())
