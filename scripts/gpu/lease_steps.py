"""The agent proofs of one lease against one long-lived server (there): a full-depth start takes most of
a device call (~530 s with CUDA graphs on a cold machine), so the server runs in its own process
session and each later call picks it up (the machine keeps it while warm, ~30 s between calls).

Steps (``driver.py --steps``), in the order a lease runs them:
- ``up``: ``hybrid-build serve`` of one agent case (``--agent-cases``, the first) in the profiles' own
  mode (``--graphs``: CUDA graphs, no --enforce-eager), with ``--restart 1``; waits for READY while the
  call has time; state in WORK/lease_server.json. ``wait``: goes on waiting in a later call.
- ``warm_ttft``: cold / warm time to first token per context (agent_steps.ttft) with each request's server
  phases (queue, prefill, server TTFT, end to end) and a short prompt's time: what bounds a warm hit.
- ``accept``: draft acceptance of the same prompts cold, then warm (a whole-prompt hit), from the
  speculative counters on ``/metrics``, and whether the two continuations are the same tokens.
- ``agent_trace``: ``hybrid-build bench --trace agent-synthetic`` at 1 and 4 conversations at once.
- ``kill``: 4 streams, then SIGKILL of ``VLLM::EngineCore``: serve's fault / memory / restart / verify /
  READY lines with their times after the kill, the GPU's used memory until it is back, and what each
  stream got. ``rewait``: goes on following in a later call.
- ``down``: stops the server; the start's log lines (pool, memory, compile and capture times).
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import agent_steps

PORT = 8300
STATE = "lease_server.json"
READY_TIMEOUT = 1500  # serve's own limit: a start may span three calls
# what the synthetic trace replays at the real shape: the demo tokenizer makes ~2.8 tokens of a word,
# so the last turn (16,000 words) stays under the served 67,712 tokens
TRACE_SPEC = "agent-synthetic:conversations=8,turns=6,start=2000,end=16000"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
LOG_LINES = re.compile(r"GPU KV cache size|Available KV cache memory|Maximum concurrency|Model loading took|"
                       r"Memory profiling|torch.compile|Compil|Graph capturing|graph capture|init engine|"
                       r"hybrid-build|Error|error|KV cache|model runner|V2")


def _state(work: Path) -> dict | None:
    p = work / STATE
    return json.loads(p.read_text()) if p.exists() else None


def _write_state(work: Path, st: dict) -> None:
    tmp = work / (STATE + ".tmp")
    tmp.write_text(json.dumps(st))
    tmp.replace(work / STATE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def gpu_used_mib() -> int | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return int(p.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def serve_command(case, floor: Path, work: Path, contexts: list[int], kv_bytes: int,
                  graphs: bool) -> tuple[list[str], int, Path]:
    """The ``hybrid-build serve`` the lease keeps up (a CPU test dry-runs it), its max_model_len and its log."""
    max_len = max(contexts) + 4 * agent_steps.SUFFIX + 2048
    recipe = agent_steps.gpu_recipe(work, case.caching, max_len, kv_bytes, eager=not graphs)
    log = work / f"lease_{case.key}.log"
    cmd = agent_steps.serve_command(case, floor, recipe, PORT, READY_TIMEOUT, log)
    # restart events are printed (and READY said) without --json; verify runs where it can (a
    # config-only target has no reference: serve says so and goes on)
    cmd = [c for c in cmd if c not in ("--json", "--no-verify")] + [
        "--restart", "1", "--restart-backoff", "0", "--memory-wait", "120", "--watch-interval", "1",
        "--stall-timeout", "600"]
    return cmd, max_len, log


def up(case, floor: Path, work: Path, out: Path, record, graphs: bool, kv_bytes: int, contexts: list[int],
       limit: float) -> None:
    st = _state(work)
    if st and _alive(st["pid"]):
        record(out, "up", {"already": st})
        return wait(work, out, record, limit)
    cmd, max_len, log = serve_command(case, floor, work, contexts, kv_bytes, graphs)
    so = work / "lease_serve.out"
    with open(so, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    st = {"pid": proc.pid, "t0": time.time(), "case": case.key, "graphs": graphs, "log": str(log), "out": str(so),
          "command": " ".join(cmd), "max_model_len": max_len}
    _write_state(work, st)
    record(out, "up", st)
    wait(work, out, record, limit)


def _ready(text: str) -> re.Match | None:
    return re.search(r"READY in (\d+) s\s+base URL: (\S+)\s+model: (\S+)", text)


def wait(work: Path, out: Path, record, limit: float) -> bool:
    """Until serve says READY, exits, or the call's time is up; ``wait`` in results.json."""
    st = _state(work)
    if st is None:
        record(out, "wait", {"error": "no server started"})
        return False
    t_end = time.time() + limit
    so = Path(st["out"])
    while True:
        text = so.read_text(errors="replace") if so.exists() else ""
        m = _ready(text)
        if m:
            res = {"verdict": "started", "ready_s": round(st.get("ready_at", time.time()) - st["t0"], 1),
                   "serve_ready_s": int(m.group(1)), "base_url": m.group(2), "case": st["case"],
                   "graphs": st["graphs"], "serve_stdout": text[-2500:]}
            if "ready_at" not in st:
                st.update(ready_at=time.time(), base_url=m.group(2))
                _write_state(work, st)
            record(out, "wait", res)
            return True
        if not _alive(st["pid"]):
            log = Path(st["log"])
            ltext = log.read_text(errors="replace") if log.exists() else ""
            record(out, "wait", {"verdict": "failed", "first_error": agent_steps.first_error(ltext),
                                 "serve_stdout": text[-3000:], "log_tail": ltext[-3000:]})
            return False
        if time.time() > t_end:
            record(out, "wait", {"verdict": "pending", "waited_s": round(time.time() - st["t0"], 1),
                                 "serve_stdout": text[-1500:]})
            return False
        time.sleep(2)


def _completion(port: int, ids: list[int], n: int) -> dict:
    return agent_steps.http(f"http://127.0.0.1:{port}/v1/completions",
                            {"model": "qwen", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                             "logprobs": 0, "return_tokens_as_token_ids": True})


def accept(port: int, prompts: int = 4, tokens: int = 9000, gen: int = 64) -> dict:
    """Each prompt cold (a new prefix), then again warm (the whole prompt cached but its last partial
    block): the drafts, draft tokens and accepted tokens each run adds, and its generated ids."""
    rows = []
    for i in range(prompts):
        ids = agent_steps.token_ids(tokens + 97 * i, 50_000 + i)
        row: dict = {"prompt_tokens": len(ids)}
        for side in ("cold", "warm"):
            before = agent_steps.metric_sums(port, SPEC_COUNTERS), agent_steps.cache_counters(port)
            r = _completion(port, ids, gen)
            after = agent_steps.metric_sums(port, SPEC_COUNTERS), agent_steps.cache_counters(port)
            d = {n.split("num_")[-1]: after[0][n] - before[0][n] for n in SPEC_COUNTERS}
            toks = (r["choices"][0].get("logprobs") or {}).get("tokens") or []
            row[side] = dict(d, hit_tokens=after[1]["hits"] - before[1]["hits"], generated=len(toks),
                             acceptance=round(d["accepted_tokens"] / d["draft_tokens"], 4) if d["draft_tokens"]
                             else None)
            row[f"{side}_ids"] = toks
        row["same_tokens"] = row.pop("cold_ids") == row.pop("warm_ids")
        rows.append(row)
    tot = {s: {k: sum(r[s][k] for r in rows) for k in ("drafts", "draft_tokens", "accepted_tokens")}
           for s in ("cold", "warm")}
    for s in tot:
        tot[s]["acceptance"] = round(tot[s]["accepted_tokens"] / tot[s]["draft_tokens"], 4) \
            if tot[s]["draft_tokens"] else None
    return {"rows": rows, "total": tot, "all_same_tokens": all(r["same_tokens"] for r in rows)}


def trace(base_url: str, out: Path, record, left, streams=(1, 4), spec: str = TRACE_SPEC) -> None:
    for n in streams:
        key = f"trace_c{n}"
        limit = min(240, left(10))
        if limit < 40:
            record(out, key, {"skipped": f"no time left ({limit:.0f} s)"})
            continue
        cmd = ["hybrid-build", "bench", base_url, "--trace", spec, "--concurrency", str(n), "--max-tokens", "64",
               "--seed", "0", "--no-tools", "--slo", "ttft=2,tpot=50ms", "--timeout", "120", "--json"] + \
            (["--conversations", "4"] if n == 1 else [])
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            try:
                res = {"report": json.loads(p.stdout)}
            except ValueError:
                res = {"stdout": p.stdout[-4000:]}
            res.update(rc=p.returncode, stderr=p.stderr[-2000:])
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {limit:.0f} s"}
        res.update(command=" ".join(cmd), wall_s=round(time.time() - t0, 1))
        record(out, key, res)


def _stream(base: str, model: str, results: queue.Queue, started: threading.Event, t_kill: list) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Count to ten thousand."}], "stream": True,
            "max_tokens": 4000, "ignore_eos": True}
    t0, chunks = time.monotonic(), 0
    try:
        with httpx.stream("POST", base + "/chat/completions", json=body, timeout=httpx.Timeout(180)) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks += 1
                    started.set()
        outcome = f"ended (http {status})"
    except httpx.HTTPError as e:
        outcome = f"{type(e).__name__}: {str(e)[:120]}"
    end = time.monotonic()
    results.put({"outcome": outcome, "chunks": chunks, "s": round(end - t0, 2),
                 "after_kill_s": round(end - t_kill[0], 2) if t_kill else None})


def _follow(work: Path, st: dict, res: dict, t_end: float) -> bool:
    """serve's event lines after the kill (stdout) with their time after it, and the GPU memory;
    True once READY again (or serve gave up)."""
    so = Path(st["out"])
    seen = len(res["events"])
    while time.time() < t_end:
        lines = [ln for ln in so.read_text(errors="replace").splitlines()[st["kill_line"]:] if ln[:2] == "20"]
        for ln in lines[seen:]:
            res["events"].append({"line": ln[:400], "seen_after_kill_s": round(time.time() - st["killed_at"], 1)})
        seen = len(lines)
        used = gpu_used_mib()
        if used is not None and (not res["gpu_used_mib"] or res["gpu_used_mib"][-1][1] != used):
            res["gpu_used_mib"].append([round(time.time() - st["killed_at"], 1), used])
        if any(" ready: " in e["line"] or " gave-up: " in e["line"] for e in res["events"]):
            return True
        if not _alive(st["pid"]):
            res["serve_exited"] = True
            return True
        time.sleep(1)
    return False


def kill(work: Path, out: Path, record, limit: float) -> None:
    st = _state(work)
    res: dict = {"events": [], "gpu_used_mib": []}
    if not st or not st.get("base_url"):
        record(out, "kill", {"error": "no READY server"})
        return
    from restart_step import _engine_core

    results: queue.Queue = queue.Queue()
    started = [threading.Event() for _ in range(4)]
    t_kill: list[float] = []
    for ev in started:
        threading.Thread(target=_stream, args=(st["base_url"], "qwen", results, ev, t_kill), daemon=True).start()
    deadline = time.monotonic() + min(120.0, max(limit, 0.0))  # one wait for the four, inside the call's time
    res["streaming"] = sum(ev.wait(max(deadline - time.monotonic(), 0.0)) for ev in started)
    res["gpu_used_mib_before"] = gpu_used_mib()
    core = _engine_core(st["pid"])
    res["engine_core_pid"] = core
    if core is None:
        record(out, "kill", dict(res, error="no VLLM::EngineCore among serve's descendants"))
        return
    st["kill_line"] = len(Path(st["out"]).read_text(errors="replace").splitlines())
    t_kill.append(time.monotonic())
    st["killed_at"] = time.time()
    os.kill(core, signal.SIGKILL)
    _write_state(work, st)
    t_end = time.time() + limit
    res["requests"] = []
    while len(res["requests"]) < res["streaming"] and time.time() < t_end:
        try:
            res["requests"].append(results.get(timeout=5))
        except queue.Empty:
            pass
        used = gpu_used_mib()
        if used is not None:
            res["gpu_used_mib"].append([round(time.time() - st["killed_at"], 1), used])
    res["ready_again"] = _follow(work, st, res, t_end)
    st["kill_res"] = res
    _write_state(work, st)
    record(out, "kill", res)


def rewait(work: Path, out: Path, record, limit: float) -> None:
    st = _state(work)
    if not st or "killed_at" not in st:
        record(out, "rewait", {"error": "no kill recorded"})
        return
    res = st.get("kill_res") or {"events": [], "gpu_used_mib": []}
    res["ready_again"] = _follow(work, st, res, time.time() + limit)
    st["kill_res"] = res
    _write_state(work, st)
    record(out, "rewait", res)


def down(work: Path, out: Path, record) -> None:
    st = _state(work)
    if not st:
        record(out, "down", {"error": "no server"})
        return
    res: dict = {"case": st["case"]}
    if _alive(st["pid"]):
        try:
            os.killpg(st["pid"], signal.SIGINT)  # serve's own session: it stops vLLM on Ctrl-C
            for _ in range(40):
                if not _alive(st["pid"]):
                    break
                time.sleep(1)
            else:
                os.killpg(st["pid"], signal.SIGKILL)
                res["killed"] = True
        except OSError as e:
            res["stop_error"] = str(e)
    log = Path(st["log"])
    text = log.read_text(errors="replace") if log.exists() else ""
    res["log_lines"] = [ln[-300:] for ln in text.splitlines() if LOG_LINES.search(ln)][-80:]
    if text:  # the whole engine log comes back too (one of the few files a call returns)
        import gzip

        (out / f"lease_{st['case']}.log.gz").write_bytes(gzip.compress(text.encode()))
    so = Path(st["out"])
    res["serve_stdout"] = so.read_text(errors="replace")[-4000:] if so.exists() else ""
    (work / STATE).unlink(missing_ok=True)
    record(out, "down", res)


def cache_fault(out: Path, hb: Path, src: Path, recipe: Path, record, left, serve_command, serve_verified) -> None:
    """The tiny artifact's base profile (prefix caching on; verify's cache path hits there), served
    twice with verify before READY: with every cached block a hit resumes from overwritten by noise
    (``cache_fault.py``: must fail, before READY), then as it is (must pass). The faulty one first:
    it is the proof, and a lease may have time for one start only."""
    import cache_fault as cf

    where = cf.install()
    try:
        for i, (key, fault) in enumerate((("cachefault_broken", True), ("cachefault_control", False))):
            if left() < 90:
                record(out, key, {"skipped": f"no time left ({left():.0f} s)"})
                continue
            flog = Path.home() / f"{key}.jsonl"
            flog.unlink(missing_ok=True)
            env = {cf.ENV: "1", cf.ENV_LOG: str(flog)} if fault else {}
            cmd = serve_command(hb, src, recipe, "base", 8400 + i, min(300, left() - 40),
                                Path.home() / f"{key}.log", None)
            res = serve_verified(out, key, cmd, env, min(360, left()))
            lines = flog.read_text().splitlines() if flog.exists() else []
            res["fault_log"] = [json.loads(ln) for ln in lines[:20]]
            res["site"] = str(where)
            record(out, key, res)
    finally:
        cf.uninstall()
