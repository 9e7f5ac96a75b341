"""Copy a multi-GB synthetic checkpoint through hybrid-build's reader and streaming writer, and
compare with `cp -r` of the same files in the same run: wall-time ratio and peak RSS.

    python benchmarks/bench_io.py [--gb 4] [--workdir DIR] [--json]

The checkpoint has the real 122B widths (hidden 3072, 256 experts of 1024) and as many decoder
layers as needed for about --gb gigabytes of random data. Runs alternate (cp, ours, cp, ours, ...)
and the best of each is compared, so page-cache warmth favours neither side.
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

COPY = r"""
import sys
from pathlib import Path
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.safetensors_io import ByteRange, OutTensor, plan_shards, write_index, write_shard
src, dst = Checkpoint.read_folder(Path(sys.argv[1])), Path(sys.argv[2])
dst.mkdir()
tensors = [OutTensor(t.name, t.dtype, t.shape, ByteRange(src.path_of(t), t.start, t.nbytes))
           for t in src.tensors.values()]
plans = plan_shards(tensors, 5_000_000_000)
for p in plans:
    write_shard(p, dst)
if len(sys.argv) > 3:  # "nosync": the same copy without the final os.sync(), to compare with plain cp
    (dst / "model.safetensors.index.json").write_text("{}")
else:
    write_index(dst, plans)
"""


def layers_for(gb: float) -> int:
    per_layer = 256 * 3 * (3072 * 1024 // 2 + 3072 * 1024 // 128 * 2 * 9 // 8) + 50e6
    return max(1, round((gb * 1e9 - 3.1e9) / per_layer))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0, help="approximate checkpoint size (default 4)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hb-bench-io-", dir=args.workdir))
    try:
        src = work / "src"
        make_synthetic(src, layers_for(args.gb))
        size = folder_bytes(src)
        cp_runs, our_runs = [], []
        # our writer syncs once before writing the index (the folder is complete only when its
        # shards are on disk): the like-for-like baseline is cp followed by sync; plain cp and our
        # copy without the sync are measured too
        cps_runs, ns_runs = [], []
        for _ in range(args.repeat):
            for runs, cmd in ((cp_runs, ["cp", "-r", str(src), str(work / "cp")]),
                              (cps_runs, ["sh", "-c", f"cp -r '{src}' '{work / 'cp'}' && sync"]),
                              (our_runs, [sys.executable, "-c", COPY, str(src), str(work / "ours")]),
                              (ns_runs, [sys.executable, "-c", COPY, str(src), str(work / "ours"), "nosync"])):
                runs.append(measure(cmd))
                shutil.rmtree(work / "cp", ignore_errors=True)
                shutil.rmtree(work / "ours", ignore_errors=True)
        cp, cps, ours, ns = best_of(cp_runs), best_of(cps_runs), best_of(our_runs), best_of(ns_runs)
        result = {"bytes": size, "cp": cp, "cp_sync": cps, "hybrid_build_copy": ours, "hybrid_build_copy_nosync": ns,
                  "time_ratio_nosync_vs_plain_cp": round(ns["seconds"] / cp["seconds"], 3),
                  "time_ratio": round(ours["seconds"] / cps["seconds"], 3),
                  "time_ratio_vs_plain_cp": round(ours["seconds"] / cp["seconds"], 3),
                  "ours_gb_per_s": round(size / ours["seconds"] / 1e9, 3),
                  "runs": {"cp": cp_runs, "cp_sync": cps_runs, "ours": our_runs, "ours_nosync": ns_runs}}
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"checkpoint: {size / 1e9:.2f} GB")
            print(f"cp -r:        {cp['seconds']:.2f} s  peak RSS {cp['peak_rss_mb']:.0f} MB")
            print(f"cp -r + sync: {cps['seconds']:.2f} s")
            print(f"hybrid-build: {ours['seconds']:.2f} s  peak RSS {ours['peak_rss_mb']:.0f} MB")
            print(f"hybrid-build without the final sync: {ns['seconds']:.2f} s "
                  f"(ratio to plain cp {result['time_ratio_nosync_vs_plain_cp']:.2f})")
            print(f"time ratio ours / (cp + sync): {result['time_ratio']:.2f}  (target <= 1.3); "
                  f"ours / plain cp: {result['time_ratio_vs_plain_cp']:.2f}; peak RSS target < 1024 MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
