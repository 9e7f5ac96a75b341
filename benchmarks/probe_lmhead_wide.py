"""Where the time goes at B = 32 and 64 (issue 28): the shipped config of each class with stages
dropped (no dot, loads only, no output store) and with a bf16 weight through the same kernel
(dequant "none": the dot structure without the int8 dequant), do_bench medians, L2 flushed.

    python benchmarks/probe_lmhead_wide.py --out OUT.json     (a CUDA GPU; ~1 min)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lmhead_gemv import bench_ms, g  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_lmhead_wide: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, n, k = torch.device("cuda"), 248320, 3072
    gen = torch.Generator(device=dev).manual_seed(1234)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev, generator=gen)
    s = torch.rand(n, device=dev, generator=gen) * 0.01 + 1e-3
    wt = g.tile_weight(w)
    big = torch.randn(2**30, device=dev, dtype=torch.float32, generator=gen)
    ceiling = big.numel() * 4 / bench_ms(lambda: big.sum()) / 1e6
    del big
    rows = []
    for b in (16, 32, 64):
        cfg = g.config_for(b, dev, torch.bfloat16, tile=g.TILE)
        x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
        out = torch.empty((b, n), device=dev, dtype=torch.bfloat16)
        for stage in ("full", "no_dot", "load", "no_store"):
            ms = bench_ms(lambda: g._launch(x, wt, s, out, cfg, stage=stage))
            rows.append({"B": b, "variant": f"stage={stage}", "us": ms * 1e3, "frac_ceiling": (n * k + 4 * n) / ms / 1e6 / ceiling})
        w16 = (w.float() * s[:, None]).to(torch.bfloat16)
        c16 = dataclasses.replace(cfg, dequant="none")
        ms = bench_ms(lambda: g._launch(x, w16, s, out, c16))
        rows.append({"B": b, "variant": "bf16 weight, same kernel (row-major, 2x the bytes)", "us": ms * 1e3,
                     "frac_ceiling": (2 * n * k) / ms / 1e6 / ceiling})
        del w16
        for r in rows[-5:]:
            print(f"B={b:2d} {r['variant']:52s} {r['us']:7.1f} us  {r['frac_ceiling']:6.1%}", flush=True)
    a.out.write_text(json.dumps({"ceiling_GBps": ceiling, "config": {str(b): g.config_for(b, dev, torch.bfloat16, tile=g.TILE).as_dict() for b in (16, 32, 64)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
