"""Where the head kernel's time goes at B = 1-64, and what the board's power limit allows.

For each B the shipped kernel (bf16 x) is timed on the benchmark table's uniform int8 weight
and on a Gaussian head quantized by the tool's own quantizer, then run in a loop while
`nvidia-smi` samples the SM clock, the power draw and the clock-event reasons
(probe_gluon_mma.sampled): its energy per call is the median power times the loop's time per
call. At B = 64 (uniform head) the parts of the call are timed alone: the quantizer of x (a
separate launch) and the dot kernel alone; then the shipped kernel on operands that switch no
bits (x all zero, x one constant: the same instructions and bytes); and at B = 33, 48, 64 the
Gluon candidate with both dots, the high half's only and none, beside a write of the logits
alone (bytes the read ceiling does not count). The board's power limits (enforced, default,
max) are read, not changed. lab/kernel_history.md "The budget at B = 33-64" reads the results.

    python lab/probes/probe_head_power.py --out OUT.json     (a CUDA GPU with Gluon; ~2 min)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_i16_ws as gw  # noqa: E402
from _setup import bench_ms, g, make_problem, probe_setup  # noqa: E402
from probe_gluon_mma import sampled  # noqa: E402

LIMITS = "power.limit,enforced.power.limit,power.default_limit,power.max_limit,clocks.max.sm,clocks.max.mem"


def board_limits() -> dict:
    """The board's power limits and top clocks as nvidia-smi reports them (read only)."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={LIMITS}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout.strip().splitlines()
    return dict(zip(LIMITS.split(","), (v.strip() for v in out[0].split(",")))) if out else {}


def timed(name: str, fn, bytes_: int, ceiling: float, **extra) -> dict:
    fn()
    torch.cuda.synchronize()
    ms = bench_ms(fn)
    row = {"variant": name, "us": ms * 1e3, "frac_ceiling": bytes_ / ms / 1e6 / ceiling, **extra, **sampled(fn)}
    row["mJ_per_call"] = row["power_w"] * row["loop_us_per_call"] / 1e3 if row["power_w"] else None
    print(f"{name:44s} {row['us']:7.1f} us {row['frac_ceiling']:6.1%}  SM {row['sm_mhz']} MHz  "
          f"{row['power_w']} W  {row['mJ_per_call'] or 0:6.1f} mJ  {row['event_reasons']}", flush=True)
    return row


def main() -> int:
    out_path, w, s, wt, gen, ceiling = probe_setup(__doc__, "probe_head_power")
    dev, n, k = w.device, *w.shape
    limits = board_limits()
    print("board:", limits, f"ceiling {ceiling:.0f} GB/s", flush=True)
    bytes_ = n * k + 4 * n  # what the ceiling counts: int8 weight + fp32 scales
    rows = []
    # the tables' uniform codes, and Gaussian rows through the tool's quantizer (make_problem)
    wg, sg, _ = make_problem(n, k, dev, "gaussian")
    heads = {"uniform": (wt, s), "gaussian": (g.tile_weight(wg), sg)}
    del wg
    for head, (w_h, s_h) in heads.items():
        for b in (1, 16, 32, 33, 48, 64):
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
            out = torch.empty((b, n), device=dev, dtype=torch.bfloat16)
            rows.append(timed(f"B={b} shipped, {head} head", lambda: g.int8_linear(x, w_h, s_h, out=out),
                              bytes_, ceiling, B=b, head=head))
        rows.append(timed(f"B=64 gluon pair 4 stages, {head} head", gw.make_call(g, x, w_h, s_h, out, 4, True, 2),
                          bytes_, ceiling, B=64, head=head))
    # B = 64 in parts (same x and out as the last row)
    cfg = g.config_for(64, dev, torch.bfloat16, tile=tuple(wt.shape[2:]))
    rows.append(timed("B=64 quantizer of x alone", lambda: g._launch(x, wt, s, out, cfg, stage="quant_only"),
                      bytes_, ceiling, B=64))
    rows.append(timed("B=64 dot kernel alone", lambda: g._launch(x, wt, s, out, cfg, stage="dot_only"),
                      bytes_, ceiling, B=64))
    # The same instructions and bytes with other operand values: the tensor cores' power depends on
    # how many operand bits switch, so a kernel bound by the power limiter speeds up on these.
    for what, xv in (("x all zero", torch.zeros_like(x)), ("x one constant", torch.full_like(x, 0.5))):
        rows.append(timed(f"B=64 shipped, {what}", lambda xv=xv: g.int8_linear(xv, wt, s, out=out), bytes_, ceiling,
                          B=64))
    # What the dots cost at each B of 33-64: the Gluon candidate with both, the high half's only,
    # none (the probes give wrong numbers and are only timed), next to a write of the logits alone.
    for b in (33, 48, 64):
        x = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=gen)
        out = torch.empty((b, n), device=dev, dtype=torch.bfloat16)
        for mma, what in ((2, "hi + lo dots"), (1, "hi dot only (probe)"), (0, "no dot (probe)")):
            rows.append(timed(f"B={b} gluon pair 4 stages, {what}", gw.make_call(g, x, wt, s, out, 4, True, 2, mma=mma),
                              bytes_, ceiling, B=b, mma=mma))
        rows.append(timed(f"B={b} logits write alone (out.zero_())", out.zero_, bytes_, ceiling, B=b,
                          out_bytes=out.numel() * out.element_size()))
    out_path.write_text(json.dumps({"ceiling_GBps": ceiling, "board": limits, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
