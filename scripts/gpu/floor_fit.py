"""Run HERE on what the `floor` step brought back: the least-squares fit of the per-step floor, the
spread of the 48-layer variants, the kernel tables and the time per decoder layer of each kind.

    python scripts/gpu/floor_fit.py OUT.json RESULTS.json [RESULTS.json ...] [--kseq FILE.json.gz ...]

Model: ``step_ms = fixed + a * n_linear + b * n_full + bytes / (4426 GB/s)``, fitted by
least squares over every engine's median step (the 48-layer base engines of each round and the
base engine of each other composition), ``bytes`` being ``plan``'s base bytes per token at the
timing's context (``floor_plan.json``). The same model is also fitted to the profiled GPU kernel
time per step. From the kernel sequences (graphs mode: the kernels each replay ran, in order),
each decode step is cut into layers at the routed-experts' ``moe_sum`` kernel (one per layer):
layer l is what runs after layer l-1's ``moe_sum`` up to its own; layer 0's cut also holds the end
of the previous step (final norm, lm-head, sampling, input preparation) and the embedding, which
is the fixed part.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

READ_GBPS = 4426.0  # the H200's read ceiling (4 GiB fp32 sum), as serve/speed/bandwidth.py uses

CATEGORIES = (  # first match wins
    ("INT4 GEMM (Machete: attention/DeltaNet projections, and the int8 head)", r"machete"),
    ("routed experts (Marlin MoE + routing)", r"marlin_moe|topkGating|moe_align|count_and_sort|moe_sum"),
    ("FP8 shared experts (DeepGEMM + activation quant)", r"deep_gemm|per_token_group_quant"),
    ("DeltaNet recurrence + conv", r"gated_delta|causal_conv1d|layer_norm_fwd|l2norm"),
    ("full attention (FA3, KV write, rope)", r"flash|FlashAttn|reshape_and_cache|mrope|rotary"),
    ("int8 head (Triton)", r"int8_gemv"),
    ("cuBLAS BF16 GEMM/GEMV (shared experts, router, head, gate)", r"nvjet|splitKreduce|gemv|Gemv|dot_kernel|cublas"),
    ("elementwise / norms / copies (torch ops)",
     r"at::native|elementwise|reduce_kernel|act_and_mul|memcpy32|Memcpy|Memset"),
)


def category(name: str) -> str:
    for label, pat in CATEGORIES:
        if re.search(pat, name):
            return label
    return "other"


def lstsq(rows: list[list[float]], y: list[float]) -> tuple[np.ndarray, np.ndarray]:
    x, yy = np.array(rows, dtype=float), np.array(y, dtype=float)
    coef, *_ = np.linalg.lstsq(x, yy, rcond=None)
    return coef, yy - x @ coef


def spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2), "n": len(xs)}


def per_layer(path: Path, layer_types: list[str]) -> dict:
    """GPU busy time per layer of each kind and the fixed part, from one kernel sequence."""
    doc = json.load(gzip.open(path, "rt"))
    names, seq = doc["names"], doc["seq"]
    cuts = [i for i, (_, _, n) in enumerate(seq) if "moe_sum" in names[n]]
    n_layers = len(layer_types)
    steps = len(cuts) // n_layers  # the prefill, then the decode steps
    out: dict = {"decode_steps": steps - 1, "kinds": {}, "fixed_us": [], "step_busy_us": [], "step_union_us": []}
    per_kind: dict[str, list[float]] = {}
    per_kind_cat: dict[str, dict[str, float]] = {}
    for s in range(1, steps):  # skip the prefill (step 0)
        base = s * n_layers
        busy = []
        for lay in range(n_layers):
            lo = cuts[base + lay - 1] + 1
            hi = cuts[base + lay] + 1
            seg = seq[lo:hi]
            busy.append(sum(d for _, d, _ in seg))
            if lay > 0:
                kind = layer_types[lay]
                per_kind.setdefault(kind, []).append(busy[-1])
                cats = per_kind_cat.setdefault(kind, {})
                for _, d, n in seg:
                    c = category(names[n])
                    cats[c] = cats.get(c, 0.0) + d
        kind0 = layer_types[0]
        out["fixed_us"].append(busy[0] - statistics.median(per_kind[kind0]))
        whole = seq[cuts[base - 1] + 1: cuts[base + n_layers - 1] + 1]
        out["step_busy_us"].append(sum(d for _, d, _ in whole))
        ends = sorted((t, t + d) for t, d, _ in whole)  # union of kernel intervals: overlap shows
        union, cur_s, cur_e = 0.0, None, None
        for a, b in ends:
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    union += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        union += (cur_e - cur_s) if cur_e is not None else 0.0
        out["step_union_us"].append(union)
    for kind, xs in per_kind.items():
        total = sum(per_kind_cat[kind].values())
        out["kinds"][kind] = {"busy_us_per_layer": round(statistics.median(xs), 2), "layers_seen": len(xs),
                              "by_category_us_per_layer": {c: round(v / len(xs), 2) for c, v in
                                                           sorted(per_kind_cat[kind].items(), key=lambda kv: -kv[1])},
                              "check_total": round(total / len(xs), 2)}
    out["fixed_us"] = round(statistics.median(out["fixed_us"]), 1)
    out["step_busy_us"] = round(statistics.median(out["step_busy_us"]), 1)
    out["step_union_us"] = round(statistics.median(out["step_union_us"]), 1)
    return out


def scrub(text: str) -> str:
    """Paths of the GPU machine as the harness names them ($HOME/work, $HOME/hbsite, scripts/gpu)."""
    text = re.sub(r'/[^\s"\'\\]*?/(work|hbsite|site|hb|hbsrc|floor)/', r'$HOME/\1/', text)
    return re.sub(r'/[^\s"\'\\]*?/scripts/gpu/', "scripts/gpu/", text)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--kseq", type=Path, nargs="*", default=[])
    ap.add_argument("--cpu-streamed", type=Path,
                    help="JSON {pair: compare_streamed(...).report} of the same pairs and token ids, made here")
    a = ap.parse_args()
    calls = [json.loads(p.read_text()) for p in a.results]
    plan = next(c["floor_plan"] for c in calls if c.get("floor_plan"))
    comps = plan["compositions"]
    engines = {}  # key -> step result, the later call's if a key repeats (a skipped one never wins)
    for c in calls:
        for k, v in c["steps"].items():
            if k.startswith(("floor_", "mix_", "eagerprof_", "warm_")) and v.get("decode_tok_s"):
                engines[k] = v

    def comp_of(key: str) -> str:
        return key.split("_")[1]

    # 1. the fit, over the base engines
    rows, y, y_gpu, rows_gpu, points = [], [], [], [], []
    for k, v in sorted(engines.items()):
        if v["mode"] != "graphs" or v["label"] != "base" or k.startswith("warm_"):
            continue
        c = comps[comp_of(k)]
        byte_ms = c["bytes"]["base"] / (READ_GBPS * 1e9) * 1e3
        rows.append([1.0, c["linear"], c["full"]])
        y.append(v["step_ms"] - byte_ms)
        points.append({"engine": k, "linear": c["linear"], "full": c["full"], "step_ms": v["step_ms"],
                       "step_ms_runs": v["step_ms_runs"], "bytes_gb": round(c["bytes"]["base"] / 1e9, 4),
                       "bytes_ms": round(byte_ms, 4)})
        if v.get("profile"):
            rows_gpu.append([1.0, c["linear"], c["full"]])
            y_gpu.append(v["profile"]["gpu_us_per_step"] / 1e3 - byte_ms)
    coef, res = lstsq(rows, y)
    for p, r in zip(points, res):
        p["residual_ms"] = round(float(r), 4)
        p["predicted_step_ms"] = round(p["step_ms"] - float(r), 4)
    fit = {"model": "step_ms = fixed + a * n_linear + b * n_full + bytes / 4426 GB/s",
           "fixed_ms": round(float(coef[0]), 4), "a_linear_ms": round(float(coef[1]), 4),
           "b_full_ms": round(float(coef[2]), 4), "rms_residual_ms": round(float(np.sqrt(np.mean(res ** 2))), 4),
           "max_abs_residual_ms": round(float(np.max(np.abs(res))), 4), "points": points}
    if rows_gpu:
        cg, rg = lstsq(rows_gpu, y_gpu)
        fit["same_model_on_profiled_gpu_kernel_time"] = {
            "fixed_ms": round(float(cg[0]), 4), "a_linear_ms": round(float(cg[1]), 4),
            "b_full_ms": round(float(cg[2]), 4),
            "rms_residual_ms": round(float(np.sqrt(np.mean(rg ** 2))), 4)}
    # 2. the 48-layer variants: median and spread over engines, and over every timing
    variants = {}
    for label in ("base", "dense", "dense-triton-head"):
        eng = [v for k, v in sorted(engines.items()) if k.startswith("floor_L48_") and v["label"] == label]
        if not eng:
            continue
        variants[label] = {"engine_medians_tok_s": [e["decode_tok_s"] for e in eng],
                           "engines": spread([e["decode_tok_s"] for e in eng]),
                           "all_timings": spread([x for e in eng for x in e["decode_tok_s_runs"]]),
                           "step_ms": round(1e3 / statistics.median([e["decode_tok_s"] for e in eng]), 4)}
        prof = [e["profile"] for e in eng if e.get("profile")]
        if prof:
            variants[label]["gpu_us_per_step"] = [p["gpu_us_per_step"] for p in prof]
            variants[label]["launches_per_step"] = [p["launches_per_step"] for p in prof]
    if "base" in variants:
        b = statistics.median(variants["base"]["engine_medians_tok_s"])
        for v in variants.values():
            v["over_base"] = round(statistics.median(v["engine_medians_tok_s"]) / b, 4)
    # 3. kernel tables (first 48-layer engine of each variant) by category, top kernels
    kernels = {}
    for label in ("base", "dense", "dense-triton-head"):
        eng = [v for k, v in sorted(engines.items())
               if k.startswith("floor_L48_") and v["label"] == label and v.get("profile")]
        if not eng:
            continue
        ks = eng[0]["profile"]["kernels_per_step"]
        cats: dict[str, list[float]] = {}
        for r in ks:
            c = cats.setdefault(category(r["kernel"]), [0.0, 0.0])
            c[0] += r["us"]
            c[1] += r["launches"]
        kernels[label] = {"engine": next(k for k, v in sorted(engines.items()) if v is eng[0]),
                          "gpu_us_per_step": eng[0]["profile"]["gpu_us_per_step"],
                          "launches_per_step": eng[0]["profile"]["launches_per_step"],
                          "by_category": {c: {"us": round(v[0], 1), "launches": round(v[1], 1)}
                                          for c, v in sorted(cats.items(), key=lambda kv: -kv[1][0])},
                          "top": ks[:15]}
    eager = {k: {"decode_tok_s": v["decode_tok_s"], "gpu_us_per_step": v["profile"]["gpu_us_per_step"],
                 "launches_per_step": v["profile"]["launches_per_step"], "top": v["profile"]["kernels_per_step"][:10]}
             for k, v in engines.items() if k.startswith("eagerprof_") and v.get("profile")}
    # 4. per layer of each kind, from the kernel sequences
    layers = {}
    for path in a.kseq:
        label = "dense" if "-dense" in path.name else "base"
        layers[label] = per_layer(path, comps["L48"]["layer_types"])
    vcompare = {k: v for c in calls for k, v in c["steps"].items()
                if k.startswith(("vcompare_", "build_35b")) and "error" not in v}
    if a.cpu_streamed:
        vcompare["cpu_streamed_same_ids"] = json.loads(a.cpu_streamed.read_text())
    doc = {"fit": fit, "variants_48": variants, "kernels_48_graphs": kernels, "eager_profile_48": eager,
           "per_layer_from_kernel_sequence": layers, "vcompare": vcompare, "floor_plan": plan,
           "calls": [{"started": c.get("started"), "finished": c.get("finished"), "env": c.get("env"),
                      "env_vars": c.get("env_vars"), "steps": c["steps"]} for c in calls]}
    a.out.write_text(scrub(json.dumps(doc, indent=1)) + "\n")
    print(json.dumps({"fit": {k: v for k, v in fit.items() if k != "points"},
                      "points": [(p["engine"], p["step_ms"], p["residual_ms"]) for p in points],
                      "variants_48": {k: {x: v[x] for x in ("engines", "all_timings", "over_base")}
                                      for k, v in variants.items()},
                      "per_layer": {k: {"fixed_us": v["fixed_us"], "busy": v["step_busy_us"],
                                        "union": v["step_union_us"],
                                        "kinds": {kk: vv["busy_us_per_layer"] for kk, vv in v["kinds"].items()}}
                                    for k, v in layers.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
