"""What the probes share: the benchmark's helpers (``benchmarks/bench_lmhead_gemv.py``, put on the
path here) and ``probe_setup``, the probes' command line and problem."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_lmhead_gemv import (  # noqa: E402,F401  (re-exported for the probes)
    DTYPES,
    bench_ms,
    check,
    g,
    graph_ms,
    log,
    make_problem,
    median,
    reference,
)


def probe_setup(doc: str, name: str, n: int = 248320, k: int = 3072):
    """The probes' command line and setup (probe_lmhead_wide.py, probe_gluon_mma.py,
    probe_head_power.py, bench_gluon.py): ``--out``, the head's int8 weight, its scales, the tiled
    weight, the generator and the 4 GiB fp32 sum's bandwidth (GB/s) on this GPU. Without a CUDA
    GPU it says so on stderr and exits with 2."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    out = ap.parse_args().out
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    dev = torch.device("cuda")
    w, s, gen = make_problem(n, k, dev)
    big = torch.randn(2**30, device=dev, dtype=torch.float32, generator=gen)
    ceiling = big.numel() * 4 / bench_ms(lambda: big.sum()) / 1e6
    return out, w, s, g.tile_weight(w), gen, ceiling
