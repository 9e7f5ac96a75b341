"""Check and time the Gluon candidate (gluon_i16_ws.py) at B = 33 / 48 / 64 in both dtypes: each
variant (stages, persistent grid, weight tiles per unit) first checked against the dequantized
fp32 reference with the i16 bound, then timed plain and replayed from a CUDA graph, as a share of
the 4 GiB fp32 sum's bandwidth. (Until the kernel left the product this was
``bench_lmhead_gemv.py --gluon``; its results are ``lab/results/lmhead_gemv_h200_gluon*.json``.)

    python lab/probes/bench_gluon.py --out OUT.json     (a CUDA GPU with Gluon; ~1 min)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import DTYPES, bench_ms, check, graph_ms, log, probe_setup, reference  # noqa: E402

# (stages, persistent grid, weight tiles per unit): one tile per unit fits 6 stages in shared
# memory (200 KiB), two tiles 4 (208 KiB). The first calls timed 2-6 stages with programs
# striding over the units (best: 6 stages, persistent); each program now takes a contiguous run.
GLUON_CANDIDATES = ((5, True, 1), (6, True, 1), (3, True, 2), (4, True, 2), (4, False, 2))


def run_gluon(g, w, s, w_t, gen, ceiling: float) -> dict:
    """Every candidate at B = 33 / 48 / 64 in both dtypes, or why it could not run (a Triton
    without that Gluon API)."""
    try:
        import gluon_i16_ws as gw
    except Exception as exc:
        return {"not_run": f"{type(exc).__name__}: {str(exc)[:200]}"}
    n, k = w.shape
    w32_cache: dict = {}

    def frac_ceiling(ms: float) -> float:
        return (n * k + n * s.element_size()) / ms / 1e6 / ceiling

    rows = []
    for dtype in DTYPES.values():
        for b in (33, 48, 64):
            x = torch.randn(b, k, device=w.device, dtype=dtype, generator=gen)
            for stages, persistent, halves in GLUON_CANDIDATES:
                out = torch.full((b, n), float("nan"), device=w.device, dtype=dtype)
                rec = {"B": b, "dtype": str(dtype)[6:], "stages": stages, "persistent": persistent,
                       "halves": halves}
                try:
                    call = gw.make_call(g, x, w_t, s, out, stages, persistent, halves)
                    call()
                    torch.cuda.synchronize()
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows.append(rec)
                    log(f"gluon B={b} {rec['dtype']} {stages=} {persistent=} {halves=}: {rec['error']}")
                    continue
                rec["check"] = check(out, x, w, s, reference(x, w, s, w32_cache), "i16")
                if rec["check"]["within_bound"]:
                    rec["ms"] = bench_ms(call)
                    rec["graph_ms"] = graph_ms(call)
                    rec["frac_ceiling"] = frac_ceiling(rec["ms"])
                rows.append(rec)
                log(f"gluon B={b} {rec['dtype']} {stages=} {persistent=} {halves=}: within bound "
                    f"{rec['check']['within_bound']} {rec.get('ms', 0) * 1e3:.1f} us ({rec.get('frac_ceiling', 0):.1%})")
    return {"rows": rows}


def main() -> int:
    from _setup import g

    out_path, w, s, w_t, gen, ceiling = probe_setup(__doc__, "bench_gluon")
    result = {"ceiling_GBps": ceiling, "gluon_i16_ws": run_gluon(g, w, s, w_t, gen, ceiling)}
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
