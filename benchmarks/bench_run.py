"""`hybrid-build run` on a synthetic checkpoint with the real widths, against `cp -r` of its input.

    python benchmarks/bench_run.py [--gb 5] [--workdir DIR] [--json]

The input has the real hidden size (3072), the real lm-head and embedding (248,320 rows), real
routed experts (256 x 1024), shared experts and attention/DeltaNet shapes, and as many decoder
layers as needed for about --gb gigabytes (>= 4 GB of INT4 shards at the default). Measured in
the same run, best of --repeat each: `cp -r` + sync (the writer syncs before its index), and
`hybrid-build run --no-validate` (calibrate, quantize-head, assemble, record), then `hybrid-build
validate` alone, then the re-run after a recipe edit that changes only a validate threshold (the
same recipe with one threshold raised; its `match` block relaxed to fit the synthetic depth, which
no stage reads). Prints wall-time ratios and each child's peak RSS.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import best_of, folder_bytes, make_synthetic, measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=5.5, help="approximate input size (default 5.5: >= 4 GB of INT4)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layers = max(1, round((args.gb * 1e9 - 3.2e9) / 1.25e9))
    work = Path(tempfile.mkdtemp(prefix="hb-bench-run-", dir=args.workdir))
    exe = shutil.which("hybrid-build") or sys.exit("hybrid-build is not on PATH: pip install -e . first")
    try:
        src = work / "src"
        make_synthetic(src, layers)
        size = folder_bytes(src)
        int4 = sum(p.stat().st_size for p in src.glob("*.safetensors")) - 2 * 248320 * 3072 * 2
        cp_runs, run_runs = [], []
        for _ in range(args.repeat):
            cp_runs.append(measure(["sh", "-c", f"cp -r '{src}' '{work / 'cp'}' && sync"]))
            shutil.rmtree(work / "cp")
            run_runs.append(measure([exe, "run", str(src), "-o", str(work / "out"), "--recipe", "qwen3.5-122b-a10b",
                                     "--force", "--no-validate", "-q"]))
            shutil.rmtree(work / "out")
        measure([exe, "run", str(src), "-o", str(work / "out"), "--recipe", "qwen3.5-122b-a10b", "--force",
                 "--no-validate", "-q"])
        val = measure([exe, "validate", str(work / "out"), "--source", str(src), "-q", "--no-e2e"])
        shards = _shard_stats(work / "out")
        edit = measure([exe, "run", str(src), "-o", str(work / "out"), "--recipe", _threshold_edit(work),
                        "--no-validate", "-q"])
        cp, run = best_of(cp_runs), best_of(run_runs)
        result = {"input_bytes": size, "layers": layers, "cp_sync": cp, "run": run, "validate": val,
                  "threshold_edit_rerun": edit, "shards_rewritten_by_edit": shards != _shard_stats(work / "out"),
                  "run_time_ratio": round(run["seconds"] / cp["seconds"], 3),
                  "run_plus_validate_ratio": round((run["seconds"] + val["seconds"]) / cp["seconds"], 3),
                  "threshold_edit_ratio": round(edit["seconds"] / run["seconds"], 4),
                  "runs": {"cp_sync": cp_runs, "run": run_runs}}
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"input: {size / 1e9:.2f} GB ({layers} decoder layers at the real widths, "
                  f"~{int4 / 1e9:.1f} GB of INT4 shards)")
            print(f"cp -r + sync:           {cp['seconds']:7.2f} s  peak RSS {cp['peak_rss_mb']:7.0f} MB")
            print(f"hybrid-build run:       {run['seconds']:7.2f} s  peak RSS {run['peak_rss_mb']:7.0f} MB"
                  f"   ratio {result['run_time_ratio']:.2f} (target <= 1.5, RSS <= 2048 MB)")
            print(f"hybrid-build validate:  {val['seconds']:7.2f} s  peak RSS {val['peak_rss_mb']:7.0f} MB"
                  f"   run + validate ratio {result['run_plus_validate_ratio']:.2f}")
            rewritten = "yes" if result["shards_rewritten_by_edit"] else "no"
            print(f"threshold edit re-run:  {edit['seconds']:7.2f} s  "
                  f"({result['threshold_edit_ratio']:.3f} of the run; shards rewritten: {rewritten})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _threshold_edit(work: Path) -> str:
    """The shipped 122B recipe with one validate threshold raised, as YAML any version reads."""
    import yaml

    from hybrid_build.recipes.schema import RECIPE_DIR

    data = yaml.safe_load((RECIPE_DIR / "qwen3.5-122b-a10b.yaml").read_text())
    data["match"].pop("num_hidden_layers", None)  # the synthetic has fewer layers; no stage reads match
    data.setdefault("validate", {})["fp8_max_rel_error"] = 0.05
    path = work / "threshold-edit.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _shard_stats(out: Path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.safetensors")}


if __name__ == "__main__":
    main()
