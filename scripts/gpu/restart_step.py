"""The ``restart`` driver step (there): ``hybrid-build serve --restart 1`` of the tiny artifact under
load, its engine core killed with SIGKILL, then what serve does: the fault line, memory back, the
engine started again, verify passed again, READY again, each with its time after the kill, and
what the requests in flight got (an error, and after how long; never a hang).

Run by ``driver.py --steps restart``; writes ``restart`` into results.json."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

LOAD_STREAMS = 4
LOAD_TOKENS = 4000  # long enough that every stream is still generating when the core dies


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _engine_core(serve_pid: int) -> int | None:
    """vLLM's engine core among serve's descendants (its process title is VLLM::EngineCore)."""
    for p in _descendants(serve_pid):
        try:
            title = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{p}/comm").read_text()
        except OSError:
            continue
        if "EngineCore" in title or "EngineCor" in comm:
            return p
    return None


def _stream(base: str, model: str, results: queue.Queue, started: threading.Event, t_kill: list) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Count to ten thousand."}], "stream": True,
            "max_tokens": LOAD_TOKENS, "ignore_eos": True}
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", base + "/chat/completions", json=body, timeout=httpx.Timeout(180)) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started.set()
        outcome = "completed"
    except httpx.HTTPError as e:
        outcome = type(e).__name__
    end = time.monotonic()
    results.put({"outcome": outcome, "s": round(end - t0, 2),
                 "after_kill_s": round(end - t_kill[0], 2) if t_kill else None})


def restart_step(out: Path, hb: Path, src: Path, recipe: Path, limit: float, record, profile: str = "dense",
                 drafter: Path | None = None, port: int = 8190) -> dict:
    log = out / f"restart-{profile}.log"
    cmd = ["hybrid-build", "serve", str(hb / "inc"), "--profile", profile, "--recipe", str(recipe), "--port", str(port),
           "--source", str(src), "--no-smoke", "--ready-timeout", "300", "--log", str(log), "--restart", "1",
           "--restart-backoff", "0", "--memory-wait", "120", "--watch-interval", "1", "--stall-timeout", "120",
           "--force"]  # built here, carried there: a download nobody validated there (verify still runs)
    cmd += ["--drafter", str(drafter)] if drafter else []
    res: dict = {"command": " ".join(cmd), "events": []}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln.rstrip("\n")) for ln in proc.stdout] + [lines.put(None)],
                     daemon=True).start()

    def until(pred, deadline: float) -> str | None:
        while time.monotonic() < deadline:
            try:
                ln = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if ln is None:
                return None
            res.setdefault("output", []).append(ln)
            if pred(ln):
                return ln
        return None

    end = t0 + limit - 30
    t_kill: list[float] = []
    try:
        ready = until(lambda ln: ln.startswith("READY"), end)
        if ready is None:
            res["error"] = "no READY"
            return res
        res["ready_s"] = round(time.monotonic() - t0, 1)
        base, model = ready.split("base URL: ")[1].split()[0], ready.split("model: ")[1].strip()
        results: queue.Queue = queue.Queue()
        started = [threading.Event() for _ in range(LOAD_STREAMS)]
        for ev in started:
            threading.Thread(target=_stream, args=(base, model, results, ev, t_kill), daemon=True).start()
        res["load_streaming"] = sum(ev.wait(60) for ev in started)
        core = _engine_core(proc.pid)
        res["engine_core_pid"] = core
        if core is None:
            res["error"] = "no EngineCore process among serve's descendants"
            return res
        t_kill.append(time.monotonic())
        os.kill(core, signal.SIGKILL)
        while True:
            ln = until(lambda ln: ln[:2] == "20", end)
            if ln is None:
                res["error"] = "no READY again before the limit"
                break
            res["events"].append({"after_kill_s": round(time.monotonic() - t_kill[0], 2), "line": ln})
            if " ready: " in ln or " gave-up: " in ln:
                break
        res["requests"] = [results.get(timeout=60) for _ in range(res["load_streaming"])]
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        res["serve_rc"] = proc.returncode
        res["wall_s"] = round(time.monotonic() - t0, 1)
        record(out, "restart", res)
        print(json.dumps({k: res.get(k) for k in ("ready_s", "events", "requests", "serve_rc", "error")}, indent=1),
              flush=True)
    return res
