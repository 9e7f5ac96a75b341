"""The speculative-page cost: how many speculative tokens the 122B's DFlash profiles should draft.

For each hardware and each number of drafted tokens K it prints and writes (argv[1], JSON):
- the pool and the 100k / 32k streams that fit, from ``memory_plan`` on the ``plan`` inputs (the
  recipe's profile with K instead of 12: GDN state pages and conv width shrink with K);
- the tokens a step emits, L(K) = (1 - a^(K+1)) / (1 - a), with a the per-position acceptance that
  gives the measured L(12) of each workload (a geometric model: each drafted position accepted with
  the same probability, given the ones before; DFlash drafts a block at once, so this is the model,
  not a measurement);
- tok/s from ``plan``'s speed model at that L, two ways: the experts of the K + 1 verified positions
  read (``--verify-block``: a longer draft costs a longer verify), and ``plan``'s calibrated default
  (the experts of the accepted positions: the step's bytes depend on L only); each as a ratio to
  K = 12 at the same workload.

Usage: python lab/probes/spec_tokens_tradeoff.py OUT.json  (CPU; ``plan`` reads headers only)
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

from hybrid_build.pipeline.generators import synthetic as syn
from hybrid_build.recipes.schema import load_recipe
from hybrid_build.serve.speed import memory_plan as mem

KS = (12, 10, 8, 6, 4)
WORKLOADS = {"agent turns": 8.3, "harness": 6.5, "code": 5.4, "prose": 2.3}  # L at K = 12 (plan's published rows)


def per_position(l12: float, k: int = 12) -> float:
    lo, hi = 0.0, 0.999999
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (1 - mid ** (k + 1)) / (1 - mid) < l12 else (lo, mid)
    return lo


def length(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def plan_json(hw: str, k: int | None, accepts: list[float], profile: str) -> dict:
    block = ["--verify-block", str(k + 1)] if k else []
    argv = [sys.executable, "-m", "hybrid_build.pipeline.cli", "plan", "synthetic:qwen3.5-122b-a10b", "--hardware", hw,
            "--profile", "dense", *block, "--accept", *[f"{x:.4f}" for x in accepts], "--json"]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def main() -> int:
    out = {"basis": __doc__.split("Usage")[0].strip(), "rows": []}
    for profile in ("dense",):  # dense and dflash share every memory input but the weights: dense's shown
        prof = load_recipe("qwen3.5-122b-a10b").serve.profiles[profile]
        for hw in ("gb10", "h200"):
            base = None
            every = sorted({round(length(per_position(l12), k), 4) for l12 in WORKLOADS.values() for k in KS})
            accepted = {round(r["accept"], 4): r["tok_s"] for r in plan_json(hw, None, every, profile)["speculative"]}
            for k in KS:
                ls = {w: length(per_position(l12), k) for w, l12 in WORKLOADS.items()}
                d = plan_json(hw, k, list(ls.values()), profile)
                m = d["memory"]
                i = mem.profile_inputs(dict(syn.QWEN35_122B_TEXT_CONFIG), prof, m["engine"], mem.DFLASH_DRAFTER,
                                       total_bytes=m["total_bytes"], weights_bytes=m["weights_bytes"],
                                       drafter_bytes=m["drafter_bytes"], reserve_bytes=m["reserve_bytes"],
                                       reserve_basis=m["reserve_basis"])
                p = mem.plan_memory(replace(i, num_speculative_tokens=k))
                tok = {w: r["tok_s"] for w, r in zip(ls, d["speculative"])}
                tok_acc = {w: accepted[round(x, 4)] for w, x in ls.items()}
                row = {"profile": profile, "hardware": hw, "k": k, "layout": p.inputs.layout,
                       "pool_tokens": p.pool_tokens, "state_gb_per_stream": p.state_bytes_per_stream / 1e9,
                       "streams_100k": p.streams_that_fit(100_000).whole,
                       "next_100k": p.streams_that_fit(100_000).next_tokens,
                       "streams_32k": p.streams_that_fit(32_768).whole,
                       "accept": {w: round(x, 2) for w, x in ls.items()},
                       "tok_s": {w: round(x, 1) for w, x in tok.items()},
                       "tok_s_accepted_model": {w: round(x, 1) for w, x in tok_acc.items()}}
                base = base or row
                row["pool_vs_12"] = p.pool_tokens / base["pool_tokens"] - 1
                row["tok_s_vs_12"] = {w: round(tok[w] / base["tok_s"][w] - 1, 3) for w in tok}
                row["tok_s_accepted_model_vs_12"] = {
                    w: round(tok_acc[w] / base["tok_s_accepted_model"][w] - 1, 3) for w in tok}
                out["rows"].append(row)
                print(f"{profile:6} {hw:5} K={k:2} pool {p.pool_tokens:>9,} ({row['pool_vs_12']:+.1%}) "
                      f"100k streams {row['streams_100k']} (+{row['next_100k']:,}) 32k {row['streams_32k']}  "
                      + "  ".join(f"{w} L {ls[w]:.2f} {row['tok_s_vs_12'][w]:+.1%} / "
                                  f"{row['tok_s_accepted_model_vs_12'][w]:+.1%}" for w in ls))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
