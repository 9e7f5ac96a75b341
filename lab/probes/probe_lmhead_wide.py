"""Where the time goes at B = 32 and 64: the shipped config of each class with stages
dropped (no dot, loads only, no output store) and with a bf16 weight through the same kernel
(dequant "none": the dot structure without the int8 dequant), do_bench medians, L2 flushed.

    python lab/probes/probe_lmhead_wide.py --out OUT.json     (a CUDA GPU; ~1 min)
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import bench_ms, g, probe_setup  # noqa: E402


def main() -> int:
    out_path, w, s, wt, gen, ceiling = probe_setup(__doc__, "probe_lmhead_wide")
    dev, n, k = w.device, *w.shape
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
    out_path.write_text(json.dumps({"ceiling_GBps": ceiling, "config": {str(b): g.config_for(b, dev, torch.bfloat16, tile=g.TILE).as_dict() for b in (16, 32, 64)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
