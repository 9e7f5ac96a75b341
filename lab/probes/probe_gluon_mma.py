"""Is the head kernel at B = 33-64 bound by its tensor-core work?

The Gluon candidate (gluon_i16_ws.py, two weight tiles per x slot, 4 stages, one
program per SM) at B = 64 three ways: its real dots (x's high and low halves), the high half's
dot only (half the tensor-core work), and no dot at all (the same loads, barriers and stores).
The two probes give wrong numbers on purpose and are only timed. While each runs in a loop,
`nvidia-smi` samples the SM clock, the power draw and the clock-event reasons, so a slowdown
from power or clocks shows beside the time. Then the same for B = 32 (P = 32: half the rows).

    python lab/probes/probe_gluon_mma.py --out OUT.json     (a CUDA GPU with Gluon; ~1 min)
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_i16_ws as gw  # noqa: E402
from _setup import bench_ms, g, probe_setup  # noqa: E402

FIELDS = "clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active"


def sampled(fn, seconds: float = 1.5) -> dict:
    """``fn`` in a loop for ``seconds`` while nvidia-smi samples every 20 ms: the medians."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.2)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        calls += 50
    wall = time.perf_counter() - t0
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    rows = [ln.split(", ") for ln in out.strip().splitlines()]
    rows = [r for r in rows if len(r) == 4]
    keep = rows[len(rows) // 5:]  # the loop's steady part (sampling began before it)
    num = lambda i: statistics.median(float(r[i]) for r in keep) if keep else None  # noqa: E731
    return {"loop_us_per_call": wall / calls * 1e6, "sm_mhz": num(0), "mem_mhz": num(1), "power_w": num(2),
            "event_reasons": sorted({r[3] for r in keep}), "samples": len(keep)}


def main() -> int:
    out_path, w, s, wt, gen, ceiling = probe_setup(__doc__, "probe_gluon_mma")
    dev, n, k = w.device, *w.shape
    big = torch.randn(2**30, device=dev, dtype=torch.float32, generator=gen)
    idle = sampled(lambda: big.sum(), 1.0)
    del big
    rows = [{"variant": "4 GiB fp32 sum (the ceiling's load)", "us": None, **idle}]
    bytes_ = n * k + 4 * n
    for b in (64, 32):
        x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
        out = torch.empty((b, n), device=dev, dtype=torch.bfloat16)
        calls = {"gluon pair 4 stages: hi + lo dots": gw.make_call(g, x, wt, s, out, 4, True, 2, mma=2),
                 "same, hi dot only (probe)": gw.make_call(g, x, wt, s, out, 4, True, 2, mma=1),
                 "same, no dot (probe)": gw.make_call(g, x, wt, s, out, 4, True, 2, mma=0),
                 "shipped Triton i16 config": lambda: g.int8_linear(x, wt, s, out=out)}
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            ms = bench_ms(fn)
            row = {"B": b, "variant": name, "us": ms * 1e3, "frac_ceiling": bytes_ / ms / 1e6 / ceiling, **sampled(fn)}
            rows.append(row)
            print(f"B={b:2d} {name:36s} {row['us']:7.1f} us {row['frac_ceiling']:6.1%}  loop {row['loop_us_per_call']:6.1f} us"
                  f"  SM {row['sm_mhz']} MHz  mem {row['mem_mhz']} MHz  {row['power_w']} W  {row['event_reasons']}",
                  flush=True)
    print(f"ceiling load: SM {idle['sm_mhz']} MHz, {idle['power_w']} W, {idle['event_reasons']}")
    out_path.write_text(json.dumps({"ceiling_GBps": ceiling, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
