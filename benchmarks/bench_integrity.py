"""What the artifact integrity check (``core.integrity``) adds to `hybrid-build serve --dry-run`, warm
and cold, on the demo artifact; and the 122B's figures from a read rate measured here.

    python benchmarks/bench_integrity.py [--repeat 5] [--rate-gb 1] [--workdir DIR] [--json] [--out FILE]

Builds the demo artifact (`hybrid-build run -o WORK/demo-out`: the tiny model, validated), lets
its files age past ``core.integrity.RACY_NS`` (files written just before are never cached), then
times the whole `serve ART --profile base --dry-run` in a child process, alternating the three
and keeping the best of --repeat each:

- baseline: the same command with the check switched off in that child (``serve.command.
  _check_artifact`` replaced by a no-op): what serve's dry run costs without it;
- warm: the check answered by its hash cache (one ``stat`` per file);
- cold: the hash cache removed before each run (every file hashed; its bytes from the page cache).

Each is printed against the baseline. Then the 122B: its artifact's size and files are what
`run synthetic:qwen3.5-122b-a10b --dry-run` plans. Cold: the check's own read-and-hash rate is
measured here on two files of --rate-gb/2 GB each (its two hashing threads), from the page cache
(the CPU's sha256 rate) and after dropping the files' pages (``posix_fadvise DONTNEED``: read from
the disk too); the 122B's size divided by the lower of the two is its cold check. Warm: measured,
the check on a folder with the 122B's files at their planned sizes (sparse) whose hash cache is
filled, so every file is one cache hit, as after a first check.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import best_of, measure  # noqa: E402

CHILD = ("import sys\n"
         "from hybrid_build.serve import command\n"
         "if sys.argv[1] == 'off':\n"
         "    command._check_artifact = lambda args: None\n"
         "from hybrid_build.pipeline.cli import main\n"
         "sys.exit(main(sys.argv[2:]))\n")


def serve_dry_run(art: Path, check: str) -> dict:
    return measure([sys.executable, "-c", CHILD, check, "serve", str(art), "--profile", "base", "--dry-run", "-q"])


def build_demo(work: Path) -> Path:
    exe = shutil.which("hybrid-build") or sys.exit("hybrid-build is not on PATH: pip install -e . first")
    out = work / "demo-out"
    measure([exe, "run", "-o", str(out), "-q"])
    return out


def check_once(art: Path) -> dict:
    from hybrid_build.core.integrity import check_artifact

    return check_artifact(art).to_json()


def demo_figures(art: Path, repeat: int) -> dict:
    from hybrid_build.core.artifact import ARTIFACT_DIGESTS
    from hybrid_build.core.integrity import RACY_NS

    time.sleep(RACY_NS / 1e9 + 0.5)  # let the build's files age: a file written just now is never cached
    cache = art / ARTIFACT_DIGESTS
    cache.unlink(missing_ok=True)
    first = check_once(art)
    warmed = check_once(art)
    if warmed["hashed"]:
        raise SystemExit(f"the cache did not take: {warmed}")
    runs = {"baseline": [], "warm": [], "cold": []}
    for _ in range(repeat):
        runs["baseline"].append(serve_dry_run(art, "off"))
        runs["warm"].append(serve_dry_run(art, "on"))
        saved = cache.read_bytes()
        cache.unlink()
        runs["cold"].append(serve_dry_run(art, "on"))
        cache.write_bytes(saved)
    best = {k: best_of(v)["seconds"] for k, v in runs.items()}
    inproc = {"cold": first, "warm": warmed}
    return {"files": first["files"], "bytes": first["bytes"], "serve_dry_run_s": best,
            "ratio_vs_baseline": {k: round(best[k] / best["baseline"], 3) for k in ("warm", "cold")},
            "added_s": {k: round(best[k] - best["baseline"], 3) for k in ("warm", "cold")},
            "check_in_process_s": {k: v["seconds"] for k, v in inproc.items()},
            "runs": runs}


def planned_122b(work: Path) -> dict:
    """The 122B artifact as `run --dry-run` plans it: its bytes, and its shards at the recipe's
    ``output.max_shard_bytes`` (a fresh dry run cannot list them: they need the stages' results)."""
    import math

    from hybrid_build.recipes.schema import load_recipe

    exe = shutil.which("hybrid-build")
    r = subprocess.run([exe, "run", "synthetic:qwen3.5-122b-a10b", "-o", str(work / "plan-122b"), "--dry-run",
                        "--json"], capture_output=True, text=True, check=True)
    total = json.loads(r.stdout)["output_bytes_estimate"]
    n = math.ceil(total / load_recipe("qwen3.5-122b-a10b").output.max_shard_bytes)
    return {"bytes": total, "shards": {f"model-{i:05d}-of-{n:05d}.safetensors": total // n for i in range(1, n + 1)}}


def _fake_artifact(folder: Path, files: dict[str, int], sha: dict[str, str]) -> None:
    (folder / "hybrid_build").mkdir(parents=True)
    (folder / "hybrid_build" / "provenance.json").write_text(json.dumps(
        {"files": {n: {"bytes": b, "sha256": sha[n]} for n, b in files.items()}}))


def read_rate(work: Path, gb: float) -> dict:
    """The check's read-and-hash rate (bytes/s) on two files, warm (page cache) and from the disk."""
    from hybrid_build.core.artifact import ARTIFACT_DIGESTS
    from hybrid_build.core.integrity import check_artifact

    folder = work / "rate"
    each = int(gb * 1e9 / 2)
    files = {f"part-{i}.bin": each for i in range(2)}
    (folder).mkdir()
    block = os.urandom(1 << 24)
    import hashlib

    sha = {}
    for name in files:
        h = hashlib.sha256()
        with open(folder / name, "wb") as f:
            left = each
            while left:
                chunk = block[:min(left, len(block))]
                f.write(chunk)
                h.update(chunk)
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        sha[name] = h.hexdigest()
    _fake_artifact(folder, files, sha)
    out = {}
    for label in ("page cache", "disk"):
        if label == "disk":
            for name in files:
                fd = os.open(folder / name, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # its clean pages leave the page cache
                os.close(fd)
        else:
            for name in files:  # into the page cache
                with open(folder / name, "rb") as f:
                    while f.read(1 << 24):
                        pass
        (folder / ARTIFACT_DIGESTS).unlink(missing_ok=True)
        found = check_artifact(folder)
        assert found.intact and found.hashed == 2, found.to_json()
        out[label] = {"seconds": round(found.seconds, 3), "bytes_per_s": round(found.hashed_bytes / found.seconds)}
    shutil.rmtree(folder)
    return out


def warm_122b(work: Path, shards: dict[str, int]) -> dict:
    """The warm check on the 122B's files (sparse, planned sizes) with every file in the cache."""
    from hybrid_build.core.artifact import ARTIFACT_DIGESTS
    from hybrid_build.core.integrity import check_artifact
    from hybrid_build.core.source_identity import DigestCache, stat_key

    folder = work / "warm-122b"
    files = dict(shards)
    files.update({"config.json": 9000, "model.safetensors.index.json": 3_000_000, "tokenizer.json": 12_000_000,
                  "tokenizer_config.json": 8000, "generation_config.json": 200, "chat_template.jinja": 7000,
                  "quantization_config.json": 60_000, "hybrid_build/recipe.yaml": 4000})
    folder.mkdir()
    sha = {n: "0" * 64 for n in files}
    _fake_artifact(folder, files, sha)
    cache = DigestCache(folder / ARTIFACT_DIGESTS)
    for name, size in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with open(folder / name, "wb") as f:
            f.truncate(size)  # sparse: its bytes are never read, its stat is what a warm check looks at
        cache.put(Path(name), stat_key(os.stat(folder / name)), sha[name])
    runs = []
    for _ in range(5):
        found = check_artifact(folder)
        assert found.intact and found.hashed == 0 and found.cached == len(files), found.to_json()
        runs.append(found.seconds)
    shutil.rmtree(folder)
    return {"files": len(files), "seconds": round(min(runs), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rate-gb", type=float, default=1.0, help="bytes hashed to measure the read rate (default 1)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hb-bench-integrity-", dir=args.workdir))
    try:
        demo = demo_figures(build_demo(work), args.repeat)
        plan = planned_122b(work)
        rate = read_rate(work, args.rate_gb)
        slowest = min(r["bytes_per_s"] for r in rate.values())
        big = {"bytes": plan["bytes"], "shards": len(plan["shards"]), "read_rate_bytes_per_s": rate,
               "cold_s": round(plan["bytes"] / slowest, 1), "warm": warm_122b(work, plan["shards"])}
        result = {"machine": f"{os.cpu_count()} CPUs", "demo": demo, "qwen3.5-122b": big}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d, s = demo, demo["serve_dry_run_s"]
    print(f"demo artifact: {d['files']} files, {d['bytes'] / 1e6:.2f} MB; serve --dry-run, best of {args.repeat}:")
    print(f"  without the check  {s['baseline']:.3f} s")
    for k in ("warm", "cold"):
        print(f"  check {k:<4}         {s[k]:.3f} s  ({d['ratio_vs_baseline'][k]:.3f}x, "
              f"+{d['added_s'][k] * 1000:.0f} ms;"
              f" the check alone in process: {d['check_in_process_s'][k] * 1000:.1f} ms)")
    print(f"122B artifact: {big['bytes'] / 1e9:.1f} GB in {big['shards']} shards")
    for label, r in rate.items():
        print(f"  check's read+sha256 rate ({label}): {r['bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"  cold: {big['bytes'] / 1e9:.1f} GB / {slowest / 1e9:.2f} GB/s = {big['cold_s']:.0f} s;"
          f" warm: {big['warm']['seconds'] * 1000:.1f} ms ({big['warm']['files']} files, all cache hits)")


if __name__ == "__main__":
    main()
