"""The layer-streamed forward (`hybrid_build.validate.streamed`) at the real 122B widths: peak RSS
and seconds per decoder layer, source pass, hybrid pass and both in lockstep, extrapolated to 48.

    python benchmarks/bench_streamed.py [--layers 4] [--texts 3] [--tokens 256] [--device cuda|cpu]
                                        [--workdir DIR] [--json] [--save FILE]

A synthetic source with random data and the real widths (hidden 3072, 256 routed experts of 1024,
DeltaNet 16/64 heads x 128, attention 32/2 heads x 256, vocab 248,320) and --layers decoder layers
(every 4th is full attention) is written by `hybrid_build.pipeline.generators.synthetic`; its hybrid is built
by `hybrid-build run` (the 122B recipe, no validate). Each pass then runs in its own child process,
whose peak RSS is the kernel's rusage of that child alone (measured, page cache excluded):
`source` and `hybrid` are one checkpoint's layers alone; `both` is `compare_streamed`, the real
use: both checkpoints layer by layer (INT4 modules dequantized once for both), then both heads,
read once in vocabulary chunks, folded into the divergence statistics. Token ids are random (the
synthetic checkpoint has no tokenizer), --texts texts of --tokens each: the bundled texts'
length under `validate/transformers_forward.py`'s cap. The synthetic folders are deleted at the end.

48-layer extrapolation: embedding + 48 x (mean of the measured layers that ran the most routed
experts: all 256 in a real model, see ``extrapolate``) + head. Peak RSS is also sampled after
every layer and every head step to show it does not grow with depth.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import folder_bytes, make_synthetic, measure  # noqa: E402

REAL_LAYERS, REAL_FULL = 48, 12
RSS_TARGET_MB = 6000


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, src: str, hyb: str, out: str, texts: int, tokens: int, device: str | None) -> None:
    import torch

    from hybrid_build.validate.streamed import compare_streamed, streamed_hidden_states

    gen = torch.Generator().manual_seed(0)
    ids = {f"text{i}": torch.randint(248320, (tokens,), generator=gen) for i in range(texts)}
    peaks: list[float] = []
    cpu = [time.process_time()]

    def record(done: int, total: int, what: str) -> None:
        peaks.append(round(_peak_mb(), 1))
        cpu.append(time.process_time())

    t0 = time.perf_counter()
    if mode == "both":
        r = compare_streamed(src, hyb, ids, device=device, progress=record)
        result = {"head_seconds": r.head_seconds, "overall": r.report["overall"]}
    else:
        r = streamed_hidden_states([src if mode == "source" else hyb], ids, device=device, progress=record)
        result = {"head_seconds": None}
    n = len(r.layer_seconds)  # CPU seconds of all threads per layer: less sensitive to other load than wall time
    result.update(layer_cpu_seconds=[round(b - a, 2) for a, b in zip(cpu[:n], cpu[1:n + 1])],
                  layer_seconds=r.layer_seconds, layer_experts=r.layer_experts, embed_seconds=r.embed_seconds,
                  device=r.device, seconds=time.perf_counter() - t0, peak_mb_after_step=peaks,
                  peak_rss_mb_self=round(_peak_mb(), 1))
    Path(out).write_text(json.dumps(result))


def build_hybrid(src: Path, out: Path) -> dict:
    exe = shutil.which("hybrid-build") or sys.exit("hybrid-build is not on PATH: pip install -e . first")
    return measure([exe, "run", str(src), "-o", str(out), "--recipe", "qwen3.5-122b-a10b", "--force",
                    "--no-validate", "-q"])


def extrapolate(r: dict, types: list[str]) -> dict:
    """Per-kind means as measured, and the 48-layer time from the layers that ran the most experts:
    random routing in a synthetic model can collapse onto a few experts (its full-attention layer
    ran ~100 of 256), while a real model's 765 tokens x top-8 reach nearly all 256 in every layer,
    and the experts' dequantization is most of a layer's time."""
    def mean_of(times: list[float], keep) -> float:
        sel = [t for t, k in zip(times, keep) if k]
        return sum(sel) / len(sel)

    busiest = [e == max(r["layer_experts"]) for e in r["layer_experts"]]
    per_layer, per_layer_cpu = mean_of(r["layer_seconds"], busiest), mean_of(r["layer_cpu_seconds"], busiest)
    return {"s_per_linear_layer": round(mean_of(r["layer_seconds"], [t == "linear_attention" for t in types]), 2),
            "s_per_full_layer": round(mean_of(r["layer_seconds"], [t == "full_attention" for t in types]), 2),
            "s_per_layer_all_experts": round(per_layer, 2), "cpu_s_per_layer_all_experts": round(per_layer_cpu, 2),
            "seconds_48_layers": round(r["embed_seconds"] + REAL_LAYERS * per_layer + (r["head_seconds"] or 0), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers, >= 4 so one is full attention (default 4)")
    ap.add_argument("--texts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per text (default 256)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees one)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON figures to this file")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "SRC", "HYB", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, src, hyb, out = args.child
        return child(mode, src, hyb, out, args.texts, args.tokens, args.device)
    if args.layers < 4:
        sys.exit("--layers must be >= 4: the 4th layer is the first full-attention one")
    work = Path(tempfile.mkdtemp(prefix="hb-bench-streamed-", dir=args.workdir))
    load_before = os.getloadavg()[0]
    try:
        src, hyb = work / "src", work / "hybrid"
        t = time.perf_counter()
        make_synthetic(src, args.layers)
        made_s = time.perf_counter() - t
        built = build_hybrid(src, hyb)
        types = json.loads((src / "config.json").read_text())["text_config"]["layer_types"]
        results = {}
        for mode in ("source", "hybrid", "both"):
            out = work / f"{mode}.json"
            cmd = [sys.executable, __file__, "--child", mode, str(src), str(hyb), str(out),
                   "--texts", str(args.texts), "--tokens", str(args.tokens)]
            cmd += ["--device", args.device] if args.device else []
            m = measure(cmd, env={"TOKENIZERS_PARALLELISM": "false"})
            r = json.loads(out.read_text())
            r.update(peak_rss_mb=m["peak_rss_mb"], wall_seconds=m["seconds"], **extrapolate(r, types))
            results[mode] = r
        summary = {"layers": args.layers, "layer_types": types, "texts": args.texts, "tokens_per_text": args.tokens,
                   "source_bytes": folder_bytes(src), "hybrid_bytes": folder_bytes(hyb),
                   "synthetic_seconds": round(made_s, 1), "build": built, "passes": results,
                   "rss_target_mb": RSS_TARGET_MB, "load_average_1min": [load_before, os.getloadavg()[0]],
                   "max_peak_rss_mb": max(r["peak_rss_mb"] for r in results.values())}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.save:
        args.save.write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"synthetic source: {summary['source_bytes'] / 1e9:.2f} GB, hybrid {summary['hybrid_bytes'] / 1e9:.2f} GB, "
          f"{args.layers} layers ({', '.join(t.split('_')[0] for t in types)}), {args.texts} x {args.tokens} tokens, "
          f"device {results['both']['device']}, {os.cpu_count()} CPUs, 1-min load average "
          f"{summary['load_average_1min'][0]:.1f} before / {summary['load_average_1min'][1]:.1f} after")
    print(f"{'pass':8s} {'peak RSS':>10s} {'s/layer*':>9s} {'CPU s/layer*':>13s} {'DeltaNet':>9s} {'full':>6s} "
          f"{'head':>6s} {'48 layers':>10s}   peak RSS after each layer (MB); experts run per layer")
    for mode, r in results.items():
        head = f"{r['head_seconds']:6.1f}" if r["head_seconds"] is not None else "     -"
        print(f"{mode:8s} {r['peak_rss_mb']:7.0f} MB {r['s_per_layer_all_experts']:9.2f} "
              f"{r['cpu_s_per_layer_all_experts']:13.2f} {r['s_per_linear_layer']:9.2f} {r['s_per_full_layer']:6.2f} "
              f"{head} {r['seconds_48_layers'] / 60:6.1f} min   {r['peak_mb_after_step'][:args.layers]}; "
              f"{r['layer_experts']}")
    print("* mean of the layers that ran the most experts (see extrapolate()); 48 layers = embedding + 48 of those "
          "+ head")
    o = results["both"]["overall"]
    print(f"both: mean KL {o['mean_kl']:.3g} (random weights and tokens: not a quality figure), "
          f"{o['tokens']} positions")
    print(f"max peak RSS {summary['max_peak_rss_mb']:.0f} MB (target <= {RSS_TARGET_MB} MB whatever the depth)")


if __name__ == "__main__":
    main()
