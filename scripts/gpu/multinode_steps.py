"""The multi-node serving path on a machine with two GPUs (``nvidia-h200-x2``), for real.

Steps of ``driver.py`` (``--steps nccl_lo,tp2,tp1,pp2,tp2s``), each writing into results.json:

- ``nccl_lo``: a two-rank NCCL all-reduce of 6 KB (one bf16 hidden-state row of the 122B) over
  sockets on the loopback, P2P / shared memory / InfiniBand off, as ``serve --nodes`` on one host
  runs it: the per-all-reduce latency ``plan --nodes`` assumes (25 us);
- ``tp2`` / ``pp2``: ``hybrid-build serve`` of the tiny hybrid (its dense profile without
  speculation: the hybrid checkpoint with its int8 head) on two Ray nodes, 127.0.0.2 and 127.0.0.3,
  one GPU each, tensor / pipeline parallel: READY, the smoke test, the prompt log-probabilities of
  every vocabulary token (the tiny vocabulary has 1,024) for fixed texts, then SIGINT to the
  command's process group (what Ctrl-C in a terminal does) and what is left running;
- ``tp1``: the same artifact and recipe on one GPU: the reference;
- ``tp2s``: ``tp2`` with the dense profile as it is (the random tiny DFlash drafter speculating);
- ``tp2mp``: TP=2 on one node with both GPUs, vLLM's own multiprocessing executor (no Ray; ``serve
  --nodes`` wants two hosts or more): the other layout a two-GPU machine allows.

Per text position, KL(tp1 || tp2) over the whole vocabulary (exact: every token's log-probability
comes back), its mean / max, and the share of positions whose top token agrees.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

TEXTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Count with me: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve",
    '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}',
]
VOCAB_LOGPROBS = 1024  # the tiny model's vocabulary: every token's log-probability per position
NODES = "127.0.0.2,127.0.0.3"
LEFTOVER = "raylet|gcs_server|vllm serve|ray::|default_worker"


def nccl_lo(record, out: Path, limit: float) -> None:
    code = r'''
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank):
    os.environ.update(MASTER_ADDR="127.0.0.2", MASTER_PORT="29533", NCCL_SOCKET_IFNAME="lo",
                      NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    x = torch.ones(3072, dtype=torch.bfloat16, device="cuda")
    for _ in range(50):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    res = {}
    for n in (3072, 3072 * 16, 3072 * 1024):
        y = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(y)
        torch.cuda.synchronize(); t = time.perf_counter()
        reps = 1000 if n <= 3072 * 16 else 100
        for _ in range(reps):
            dist.all_reduce(y)
        torch.cuda.synchronize()
        res[f"{n * 2} B"] = round((time.perf_counter() - t) / reps * 1e6, 2)
    if rank == 0:
        print("RESULT " + __import__("json").dumps({"us_per_all_reduce": res}), flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
'''
    t0 = time.time()
    script = out / "nccl_lo.py"  # a file, not -c: the spawned ranks import the function by module
    script.write_text(code)
    try:
        p = subprocess.run(["python3", str(script)], capture_output=True, text=True, timeout=limit)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if lines else {"error": (p.stdout + p.stderr)[-1500:]}
        res["rc"] = p.returncode
    except subprocess.TimeoutExpired:
        res = {"error": f"timed out after {limit:.0f} s"}
    res["wall_s"] = round(time.time() - t0, 1)
    record(out, "nccl_lo", res)


def recipe_without_speculation(recipe: Path, work: Path, extra: tuple[str, ...] = (), name: str = "nospec") -> Path:
    """The GPU recipe with every profile's speculation off, all logprobs allowed and ``extra`` vLLM
    arguments."""
    import yaml

    rec = yaml.safe_load(recipe.read_text())
    for prof in rec["serve"]["profiles"].values():
        prof["speculative"] = None
        prof["extra_args"] = list(prof.get("extra_args") or []) + ["--max-logprobs", str(VOCAB_LOGPROBS), *extra]
    path = work / f"gpu-tiny-recipe-{name}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    return path


def leftovers() -> list[str]:
    p = subprocess.run(["pgrep", "-af", LEFTOVER], capture_output=True, text=True)
    return [ln for ln in p.stdout.splitlines() if "pgrep" not in ln]


def prompt_logprobs(http, port: int, model: str) -> list[list[dict[str, float]]]:
    """Per text, per position after the first: {token id: logprob} over the whole vocabulary."""
    per_text = []
    for text in TEXTS:
        r = json.loads(http(f"http://127.0.0.1:{port}/v1/completions",
                            {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0, "echo": True,
                             "logprobs": VOCAB_LOGPROBS, "return_tokens_as_token_ids": True}, timeout=120))
        tops = r["choices"][0]["logprobs"]["top_logprobs"]
        per_text.append([t for t in tops if t])
    return per_text


def compare(ref: list, other: list) -> dict:
    """KL(ref || other) per position over the whole vocabulary, top-1 agreement."""
    kls, same, missing = [], 0, 0
    for a_text, b_text in zip(ref, other):
        for a, b in zip(a_text, b_text):
            floor = min(b.values())
            kl = 0.0
            for tok, lp in a.items():
                lq = b.get(tok)
                if lq is None:
                    missing += 1
                    lq = floor
                kl += math.exp(lp) * (lp - lq)
            kls.append(max(kl, 0.0))
            same += max(a, key=a.get) == max(b, key=b.get)
    kls.sort()
    n = len(kls)
    return {"positions": n, "kl_mean": sum(kls) / n if n else None, "kl_median": kls[n // 2] if n else None,
            "kl_max": kls[-1] if n else None, "same_top1": same / n if n else None, "tokens_missing": missing,
            "kl_mean_ok": bool(n) and sum(kls) / n <= 1e-3}


def ready_info(text: str) -> dict | None:
    """The JSON object ``serve --json`` prints once READY (indented over several lines), or None."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] == "}":
            for j in range(i, -1, -1):
                if lines[j] == "{":
                    try:
                        obj = json.loads("\n".join(lines[j:i + 1]))
                    except ValueError:
                        break
                    return obj if "base_url" in obj else None
    return None


def serve_run(record, http, out: Path, key: str, cmd: list[str], env: dict, port: int, limit: float,
              logprobs: bool = True) -> dict:
    """Start ``cmd`` (a ``hybrid-build serve``) in its own process group, wait for READY (its JSON
    line), take the prompt logprobs, SIGINT the group and record what is left running."""
    t0 = time.time()
    res: dict = {"command": " ".join(cmd)}
    if limit < 90:
        res["skipped"] = f"no time left ({limit:.0f} s)"
        record(out, key, res)
        return res
    stdout = out / f"{key}.out"
    with open(stdout, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, **env),
                                start_new_session=True)
    info = None
    try:
        while time.time() - t0 < limit - 45 and proc.poll() is None:
            info = ready_info(stdout.read_text(errors="replace"))
            if info:
                break
            time.sleep(2)
        res["ready"] = info is not None
        res["ready_s"] = round(time.time() - t0, 1)
        res["info"] = info
        if info and logprobs:
            try:
                res["logprobs"] = prompt_logprobs(http, port, info.get("model", "qwen"))
            except Exception as e:  # the server answered READY: a failed request is a result too
                res["logprobs_error"] = f"{type(e).__name__}: {e}"[:800]
            try:
                r = json.loads(http(f"http://127.0.0.1:{port}/v1/completions",
                                    {"model": info.get("model", "qwen"), "prompt": TEXTS[0], "max_tokens": 16,
                                     "temperature": 0}, timeout=60))
                res["completion"] = r["choices"][0]["text"]
            except Exception as e:
                res["completion_error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
            try:
                res["exit_code"] = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                res["exit_code"] = "still running 90 s after SIGINT"
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            res["exit_code"] = proc.returncode
        res["teardown_s"] = round(time.time() - t0 - res.get("ready_s", 0), 1)
        time.sleep(3)
        res["left_running"] = leftovers()
        if res["left_running"]:  # clear the way for the next step
            subprocess.run(["pkill", "-9", "-f", LEFTOVER])
        res["output_tail"] = stdout.read_text(errors="replace")[-3000:]
        res["wall_s"] = round(time.time() - t0, 1)
        record(out, key, {k: v for k, v in res.items() if k != "logprobs"})
    return res


def run(steps: list[str], record, http, out: Path, hb: Path, src: Path, recipe: Path, work: Path, left) -> None:
    """The issue-20 steps asked for, in order, each within what is left of the call."""
    if "nccl_lo" in steps:
        nccl_lo(record, out, min(120, left(30)))
    nospec = recipe_without_speculation(recipe, work)
    base = ["hybrid-build", "serve", str(hb / "inc"), "--profile", "dense", "--source", str(src), "--json",
            "--ready-timeout", "400", "--force"]  # carried there: not validated there (verify still runs)
    two = ["--nodes", NODES, "--ifname", "lo", "--node-env", "1:CUDA_VISIBLE_DEVICES=0",
           "--node-env", "2:CUDA_VISIBLE_DEVICES=1", "--node-env", "NCCL_P2P_DISABLE=1",
           "--node-env", "NCCL_SHM_DISABLE=1", "--node-env", "NCCL_IB_DISABLE=1",
           "--node-env", "VLLM_USE_FLASHINFER_SAMPLER=0", "--ray-temp-dir", "/tmp/hbray", "--join-timeout", "120"]
    got: dict[str, dict] = {}
    for step, extra, env, port, rec, limit in (
            ("tp2", two + ["--parallel", "tp"], {}, 8000, nospec, 330),
            ("tp1", [], {"CUDA_VISIBLE_DEVICES": "0"}, 8001, nospec, 240),
            ("pp2", two + ["--parallel", "pp"], {}, 8002, nospec, 240),
            ("tp2s", two + ["--parallel", "tp", "--drafter", str(hb / "drafter-dflash")], {}, 8003, recipe, 240),
            ("tp2mp", [], {}, 8004, None, 240)):
        if step not in steps:
            continue
        if rec is None:  # tp2mp: TP=2 through vLLM's own executor, asked for in the recipe
            rec = recipe_without_speculation(recipe, work, ("--tensor-parallel-size", "2"), "tp2mp")
        cmd = base + ["--recipe", str(rec), "--port", str(port), "--log", str(out / f"serve_{step}.log")] + extra
        got[step] = serve_run(record, http, out, step, cmd, env, port, min(limit, left(20)),
                              logprobs=step != "tp2s")
    for step in ("tp2", "pp2", "tp2mp"):
        if got.get(step, {}).get("logprobs") and got.get("tp1", {}).get("logprobs"):
            record(out, f"kl_{step}_vs_tp1", compare(got["tp1"]["logprobs"], got[step]["logprobs"]))


if __name__ == "__main__":  # an early call, before vLLM is assembled: python3 multinode_steps.py nccl OUT
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "nccl":
        sys.exit("usage: multinode_steps.py nccl OUT")
    dest = Path(sys.argv[2])
    dest.mkdir(parents=True, exist_ok=True)

    def _record(out: Path, key: str, value) -> None:
        (out / f"{key}.json").write_text(json.dumps(value, indent=1))
        print(key, json.dumps(value))

    nccl_lo(_record, dest, 150)
