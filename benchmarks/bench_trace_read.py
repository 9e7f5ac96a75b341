"""``bench --trace FILE``'s read of a large trace: the streamed reader (``read_trace`` with a sample:
each conversation checked and offered to the seeded reservoir, only the sample held) against the
whole-file parse it replaced (the file read whole, every conversation parsed and held, then
``random.sample``), both measured in this run, on the same file.

``python benchmarks/bench_trace_read.py [--lines 1000000] [--sample 64] [--runs 1] [--out FILE.json]``

Each reader runs in a child process of its own (this script again, ``--phase``), so that its peak
resident memory is its own (``wait4``'s rusage of that child); the child times its read and sample
alone, after its imports. The file is a synthetic OpenAI chat JSONL, one short coding-agent
conversation a line (a tool call and its result, then an answer), written once per run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_trace(path: Path, n: int) -> int:
    with open(path, "w") as f:
        for i in range(n):
            conv = {"id": f"conv-{i:07d}", "messages": [
                {"role": "user", "content": f"fix the failing test {i} in stats.py"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                    "name": "terminal", "arguments": json.dumps({"command": "pytest -x tests"})}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": "1 failed: test_median"},
                {"role": "assistant", "content": "The median took the wrong middle element; fixed."}]}
            f.write(json.dumps(conv) + "\n")
    return path.stat().st_size


def whole_file(path: Path, sample: int, seed: int) -> list:
    """The reader this replaced: the bytes whole, every conversation parsed and held, then sampled."""
    from hybrid_build.serve.bench.trace_formats import _cid, _Where, conversation

    data = path.read_bytes()
    convs = []
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        obj = json.loads(raw)
        cid = _cid(obj.get("id"))
        convs.append(conversation(_Where(path.name, cid, f"line {n}"), cid, obj.get("messages"), obj.get("tools")))
    keep = sorted(random.Random(seed).sample(range(len(convs)), sample))
    return [convs[i] for i in keep]


def streamed(path: Path, sample: int, seed: int) -> list:
    from hybrid_build.serve.bench.trace_formats import read_trace

    return list(read_trace(path, sample, seed).conversations)


def phase(name: str, path: Path, sample: int, seed: int) -> None:
    import hybrid_build.serve.bench.trace_formats  # noqa: F401 - imports outside the timed read

    t = time.perf_counter()
    got = [] if name == "imports" else (whole_file if name == "whole" else streamed)(path, sample, seed)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "conversations": len(got), "ids": [c.id for c in got]}))


def run_child(name: str, path: Path, sample: int, seed: int) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--phase", name, "--file", str(path), "--sample", str(sample),
                             "--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t = time.perf_counter()
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{err.decode()[-2000:]}")
    got = json.loads(out)
    return {"read_and_sample_s": round(got["seconds"], 3), "process_s": round(wall, 3),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "held": got["conversations"], "ids": got["ids"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--sample", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--phase", choices=("imports", "whole", "streamed"))
    ap.add_argument("--file", type=Path)
    a = ap.parse_args()
    if a.phase:
        return phase(a.phase, a.file, a.sample, a.seed)
    with tempfile.TemporaryDirectory(prefix="bench-trace-read-") as tmp:
        path = Path(tmp) / "trace.jsonl"
        size = write_trace(path, a.lines)
        floor = run_child("imports", path, a.sample, a.seed)  # the interpreter and the imports alone
        rows = {"whole": [], "streamed": []}
        for _ in range(a.runs):  # interleaved: a slower stretch of the machine hits both
            for name in rows:
                rows[name].append(run_child(name, path, a.sample, a.seed))
    best = {k: min(v, key=lambda r: r["read_and_sample_s"]) for k, v in rows.items()}
    w, s = best["whole"], best["streamed"]
    result = {
        "lines": a.lines, "file_mb": round(size / 1e6, 1), "sample": a.sample, "seed": a.seed, "runs": a.runs,
        "whole_file": {k: v for k, v in w.items() if k != "ids"},
        "streamed": {k: v for k, v in s.items() if k != "ids"},
        "imports_only_peak_rss_mb": floor["peak_rss_mb"],
        "time_ratio_streamed_over_whole": round(s["read_and_sample_s"] / w["read_and_sample_s"], 3),
        "peak_rss_ratio_streamed_over_whole": round(s["peak_rss_mb"] / w["peak_rss_mb"], 3),
        "same_sample": w["ids"] == s["ids"],
        "note": "the two samples are both uniform and seeded; the reservoir draws another set than random.sample",
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
