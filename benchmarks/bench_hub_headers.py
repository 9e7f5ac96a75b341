"""Bytes and time of `inspect` and `plan` on a Hub id, against the same commands on the same checkpoint
as a local folder, measured in the same run.

The Hub is the tests' stand-in (``tests/pipeline/hub_http.py``: real HTTP on loopback, the real
huggingface_hub client in the command's process, ``HF_ENDPOINT`` pointed at it) serving the real
122B's layout (``synthetic.qwen35_122b_config``: Intel's tensor names, shapes, shards and full
``extra_config``), its data left as holes: the headers, index and config are the sizes the real
ones have, the shards the real sizes (~72 GB in all). Each command runs as its own process with a
fresh Hub cache; the stand-in counts the body bytes it sends. ``--repeat`` rounds, alternating
Hub and folder; medians.

    python benchmarks/bench_hub_headers.py [--repeat 3] [--layers N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "pipeline"))  # the stand-in Hub the tests use
from hub_http import HubServer  # noqa: E402

REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"


def cli() -> list[str]:
    script = Path(sys.executable).parent / "hybrid-build"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hybrid_build.pipeline.cli"]


def run(argv: list[str], env: dict) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cli() + argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=1800)  # a command stuck on the stand-in Hub ends the benchmark
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, help="keep this many decoder layers (default: all 48)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from hybrid_build.pipeline.generators.synthetic import qwen35_122b_config, write_synthetic_checkpoint

    with tempfile.TemporaryDirectory(prefix="hb-bench-hub-") as tmp:
        folder = write_synthetic_checkpoint(Path(tmp) / "ckpt", qwen35_122b_config(),
                                            layers=range(args.layers) if args.layers else None, sparse=True)
        files = sorted(p for p in folder.iterdir() if p.is_file())
        shards = [p for p in files if p.suffix == ".safetensors"]
        headers = {}
        for p in shards:
            with p.open("rb") as f:
                headers[p.name] = 8 + struct.unpack("<Q", f.read(8))[0]
        served = {"files": len(files), "shards": len(shards), "bytes": sum(p.stat().st_size for p in files),
                  "header_bytes": sum(headers.values()), "largest_header": max(headers.values()),
                  "json_bytes": {p.name: p.stat().st_size for p in files if p.suffix == ".json"}}
        rows: dict[str, dict[str, list]] = {}
        with HubServer() as hub:
            hub.add_repo(REPO, folder)
            for i in range(args.repeat):
                for command in (["inspect"], ["plan", "--hardware", "gb10"]):
                    name = command[0]
                    for where, source in (("hub", REPO), ("folder", str(folder))):
                        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(Path(tmp) / f"hf-{name}-{where}-{i}"),
                                   HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")
                        hub.reset()
                        seconds = run([name, source, *command[1:], "--json"], env)
                        row = rows.setdefault(f"{name} {where}", {"seconds": [], "bytes": [], "requests": []})
                        row["seconds"].append(seconds)
                        row["bytes"].append(hub.bytes_sent)
                        row["requests"].append(len(hub.served))
        result = {"served": served, "repeat": args.repeat, "commands": {}}
        for key, row in rows.items():
            result["commands"][key] = {"seconds": round(statistics.median(row["seconds"]), 2),
                                       "bytes": int(statistics.median(row["bytes"])),
                                       "requests": int(statistics.median(row["requests"]))}
        for name in ("inspect", "plan"):
            hub_row, local = result["commands"][f"{name} hub"], result["commands"][f"{name} folder"]
            hub_row["time_vs_folder"] = round(hub_row["seconds"] / local["seconds"], 2)
            hub_row["bytes_vs_checkpoint"] = hub_row["bytes"] / served["bytes"]
            hub_row["bytes_over_headers_and_json"] = hub_row["bytes"] - served["header_bytes"] - sum(
                served["json_bytes"].get(n, 0) for n in ("config.json", "model.safetensors.index.json"))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    s = result["served"]
    print(f"served: {s['files']} files, {s['bytes'] / 1e9:.2f} GB; {s['shards']} shards whose headers are "
          f"{s['header_bytes'] / 1e6:.2f} MB (largest {s['largest_header'] / 1e6:.2f} MB); JSON "
          + ", ".join(f"{n} {b / 1e6:.2f} MB" for n, b in s["json_bytes"].items()))
    for key, row in result["commands"].items():
        extra = (f"  {row['time_vs_folder']}x the folder's time, {row['bytes_vs_checkpoint']:.2e} of the checkpoint"
                 if "time_vs_folder" in row else "")
        print(f"{key:<14} {row['seconds']:6.2f} s  {row['bytes'] / 1e6:8.2f} MB  {row['requests']:3d} requests{extra}")


if __name__ == "__main__":
    main()
