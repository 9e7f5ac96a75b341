"""``bench --trace ... --duration S``: the soak. The trace's conversations loop for ``S`` seconds,
``concurrency`` at once (``bench_trace``'s replay, each loop its own cache salt), and the turns are
reported per window of ``window`` seconds (by when each started): requests, errors by kind, TTFT
and per-turn decode tok/s p50/p95, the server's decode throughput (its generated tokens per second
of the window: vLLM's ``generation_tokens`` counter, else the window's turns), the KV cache's share
in use as the window closes (vLLM's ``kv_cache_usage_perc`` gauge), the prefix-cache hit rate and
the draft acceptance from vLLM's counters read as each window closes (server-wide), and whether the
server restarted or was gone.

The windows close on events, not on a timer: after each turn, a clock reading past the open
window's end reads the counters and closes it (and any empty ones between). The clock is
injectable (a test's fake clock). Every loop is bounded: no turn starts after the deadline, every
request has its own, and the whole run is cancelled at ``duration + timeout + 30 s``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path

from hybrid_build.core.errors import CannotRun

from .bench_trace import (
    GENERATION_TOKENS,
    REPORT_KIND,
    SCHEMA_VERSION,
    ReplayOptions,
    Server,
    _fit,
    _gather,
    _servers,
    delta,
    play,
    read_counters,
    restarted,
    select,
)
from .trace_formats import Trace
from .trace_report import Counters, TurnResult, fit_line, percentile, reason_lines, summarize

log = logging.getLogger(__name__)
GRACE_S = 30.0


class Windows:
    """The soak's windows, closed as the clock passes their ends; the counters read at each close."""

    def __init__(self, server: Server, t0: float, window: float, clock):
        self.server, self.t0, self.window, self.clock = server, t0, window, clock
        self.closed: list[dict] = []
        self.reading: dict | None = None
        self.lock = asyncio.Lock()

    async def open(self) -> None:
        self.reading = await read_counters(self.server)

    async def tick(self, _turn: TurnResult | None = None, final: bool = False) -> None:
        async with self.lock:
            now = self.clock() - self.t0
            while (len(self.closed) + 1) * self.window <= now or final:
                after = await read_counters(self.server)
                self.closed.append({"index": len(self.closed), "start_s": len(self.closed) * self.window,
                                    "before": self.reading, "after": after})
                self.reading = after
                if final:
                    return


def window_row(index: int, start: float, length: float, turns: list[TurnResult], before: dict | None,
               after: dict | None) -> dict:
    s = summarize(turns, length, None, delta(before, after) or Counters())
    ok = [t for t in turns if t.ok]
    dec = [t.decode_tok_s for t in ok if t.decode_tok_s is not None]
    pc = s["prefix_cache"]
    same = before and after and not before.get("gone") and not after.get("gone") and not restarted(before, after)
    generated = (after[GENERATION_TOKENS] - before[GENERATION_TOKENS]
                 if same and after.get(GENERATION_TOKENS) is not None and before.get(GENERATION_TOKENS) is not None
                 else None)
    decoded = generated if generated is not None else sum(t.completion_tokens for t in ok)
    return {"window": index, "start_s": start, "requests": len(turns), "errors": s["errors"],
            "error_reasons": s["error_reasons"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p95_s": s["ttft_s"]["p95"],
            "decode_p50_tok_s": percentile(dec, 50), "decode_p95_tok_s": percentile(dec, 95),
            "decode_tok_s": decoded / length if length > 0 else None,
            "decode_tok_s_from": "server" if generated is not None else "turns",
            "kv_usage": (after or {}).get("kv_usage"),
            "hit_rate": pc["usage_hit_rate"] if pc.get("counter_hit_rate") is None else pc["counter_hit_rate"],
            "acceptance_length": (s.get("acceptance") or {}).get("mean_acceptance_length"),
            "restarted": restarted(before, after),
            "server_gone": bool((after or {}).get("gone")) or any(t.error == "unreachable" for t in turns)}


def soak(url: str, trace: Trace, opts: ReplayOptions, model: str | None = None, api_key: str | None = None,
         synthetic: dict | None = None, clock=time.perf_counter, on_turn=None, on_note=None) -> dict:
    """Loop the trace for ``opts.duration`` seconds; the per-window report (``on_note``: what the check
    before the replay found, ``bench_trace.fit_check``)."""
    convs = select(trace, opts.conversations, opts.seed)
    duration = float(opts.duration)

    async def main():
        async with AsyncExitStack() as stack:
            (server,) = await _servers([url], model, api_key, opts, stack)
            fit = await _fit(server, convs, opts, on_note)
            t0 = clock()
            deadline = t0 + duration
            windows = Windows(server, t0, opts.window, clock)
            await windows.open()
            first = windows.reading
            out: list[TurnResult] = []
            feed = ((loop, c) for loop in itertools.count(1) for c in convs)

            async def on(res: TurnResult) -> None:
                if on_turn:
                    on_turn(res)
                await windows.tick(res)

            async def worker():
                while clock() < deadline:
                    loop, conv = next(feed)
                    await play(server, conv, opts, f"{opts.salt}-{opts.seed}-{loop}", clock, t0, loop, deadline,
                               out, on)

            try:
                await asyncio.wait_for(_gather([worker() for _ in range(opts.concurrency)]),
                                       duration + opts.timeout + GRACE_S)
            except asyncio.TimeoutError:
                raise CannotRun(f"the soak did not end within {duration + opts.timeout + GRACE_S:.0f} s "
                                f"(duration + one request's timeout + {GRACE_S:.0f} s)")
            wall = clock() - t0
            await windows.tick(final=True)
            rows = []
            for w in windows.closed:
                lo = w["start_s"]
                hi = lo + opts.window if w is not windows.closed[-1] else float("inf")
                mine = [t for t in out if lo <= t.start_s < hi]
                if not mine and w is windows.closed[-1] and rows:
                    continue  # the closing read after the last window's turns
                rows.append(window_row(w["index"], lo, min(opts.window, wall - lo), mine, w["before"], w["after"]))
            last = windows.reading
            overall = summarize(out, wall, opts.slo, delta(first, last) or Counters())
            return {"kind": REPORT_KIND + " soak", "schema_version": SCHEMA_VERSION, "base_url": server.base_url,
                    "model": server.model, "trace": {"format": trace.format, "name": trace.name},
                    "conversations": len(convs), "concurrency": opts.concurrency, "duration_s": duration,
                    "window_s": opts.window, "wall_s": wall, "max_tokens": opts.max_tokens,
                    "feed_back": opts.feed_back, "loops": max((t.loop for t in out), default=0),
                    "overall": overall, "windows": rows, "fit": fit, "restarts": sum(r["restarted"] for r in rows),
                    "server_gone_windows": sum(r["server_gone"] for r in rows), "synthetic": synthetic,
                    "failed_requests": sum(1 for t in out if not t.ok)}

    return asyncio.run(main())


def soak_table(r: dict) -> str:
    def f(v, fmt="{:.1f}", k=1.0):
        return "-" if v is None else fmt.format(v * k)

    lines = [f"soak: {r['trace']['format']} {r['trace']['name']}, {r['conversations']} conversations looped "
             f"{r['loops']} times in {r['wall_s']:.0f} s, {r['concurrency']} at once; {r['base_url']} ({r['model']}); "
             f"windows of {r['window_s']:g} s",
             f"{'window':>6} {'start s':>8} {'req':>5} {'errors':<18} {'TTFT p50':>8} {'p95 ms':>7} "
             f"{'dec p50':>7} {'p95':>6} {'gen/s':>7} {'KV':>5} {'hit':>5} {'acc':>5}  server"]
    for w in r["windows"]:
        errs = ",".join(f"{k}:{v}" for k, v in sorted(w["errors"].items())) or "0"
        server = "RESTARTED" if w["restarted"] else "GONE" if w["server_gone"] else "up"
        lines.append(f"{w['window']:>6} {w['start_s']:>8.0f} {w['requests']:>5} {errs:<18} "
                     f"{f(w['ttft_p50_s'], '{:.0f}', 1000):>8} {f(w['ttft_p95_s'], '{:.0f}', 1000):>7} "
                     f"{f(w['decode_p50_tok_s']):>7} {f(w['decode_p95_tok_s']):>6} {f(w.get('decode_tok_s')):>7} "
                     f"{f(w.get('kv_usage'), '{:.0%}'):>5} {f(w['hit_rate'], '{:.0%}'):>5} "
                     f"{f(w['acceptance_length'], '{:.2f}'):>5}  {server}")
    o = r["overall"]
    lines.append(f"all: {o['requests']} requests, {r['failed_requests']} failed, {r['restarts']} restart(s), "
                 f"{r['server_gone_windows']} window(s) with the server gone; gen/s: the server's generated tokens "
                 f"per second of the window; KV: its KV cache in use as the window closed")
    lines += reason_lines(o.get("error_reasons") or [])
    if r.get("fit"):
        lines.append(fit_line(r["fit"]))
    return "\n".join(lines)


def draw(r: dict, png: Path) -> Path | None:
    """The windows as a PNG (TTFT p95, decode tok/s, KV cache in use, hit rate, acceptance, errors over
    time), where matplotlib
    (the ``plot`` extra) is installed; None where it is not. Written to a temp name, then renamed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ws = r["windows"]
    x = [w["start_s"] / 60 for w in ws]
    fig, axes = plt.subplots(6, 1, figsize=(8, 12), sharex=True)
    acc = [w["acceptance_length"] for w in ws]
    # (label, values, y range): rates on their whole scale, so that noise does not look like a trend
    series = (("TTFT p95 (ms)", [None if w["ttft_p95_s"] is None else w["ttft_p95_s"] * 1000 for w in ws], (0, None)),
              ("decode tok/s (server)", [w.get("decode_tok_s") for w in ws], (0, None)),
              ("KV cache in use", [w.get("kv_usage") for w in ws], (0, 1.05)),
              ("prefix-cache hit rate", [w["hit_rate"] for w in ws], (0, 1.05)),
              ("acceptance length", acc, (1, max([a for a in acc if a is not None], default=1) + 0.5)),
              ("failed requests", [sum(w["errors"].values()) for w in ws], (0, None)))
    for ax, (label, ys, (lo, hi)) in zip(axes, series):
        ax.plot(x, [float("nan") if y is None else y for y in ys], marker="o")
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=lo, top=hi)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        for w in ws:
            if w["restarted"] or w["server_gone"]:
                ax.axvline(w["start_s"] / 60, color="red", alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(f"soak: {r['trace']['name']}, {r['concurrency']} at once, {r['model']}", fontsize=9)
    tmp = png.with_name(png.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    tmp.replace(png)
    return png
