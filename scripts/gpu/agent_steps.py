"""The H200 steps for agents at the real shape: the 122B target at full depth (``floor_configs.py``'s
config-only ``L48-dense`` / ``L48-base``, dummy weights) with a config-only DFlash drafter of the
real drafter's shape, each case served by ``hybrid-build serve`` itself (its drafter-vs-engine
check, the plugin and its runtime fixes, the profile's argv).

Here (CPU), into the carried folder:
    python scripts/gpu/agent_steps.py drafters .gpufloor          # drafter-mixed/, drafter-full6/
There (``run.sh`` -> ``driver.py --steps starts,ttft --floor $HOME/floor --agent-cases ...``):
- starts: per case ``PROFILE:SHAPE:CACHING`` (dense|dflash, mixed|full6, on|off) one ``serve``;
  recorded: ``started`` (READY, seconds), ``refused`` (serve's one line and exit code, nothing
  started) or ``failed`` (vLLM exited: the first exception line of its log); a started server with
  prefix caching on then runs ``ttft`` and ``tools`` when those steps are asked for, and is stopped.
- ttft: cold vs warm-prefix time to first token at ``--contexts`` tokens (default 8k / 32k / 64k): a
  new prefix plus a 32-token suffix, then the same prefix with another suffix; ``max_tokens`` 1,
  ``--ttft-runs`` pairs (median), the prefix-cache hit tokens of each request from ``/metrics``.
- tools: one chat request with ``tools`` whose answer is forced (a regex) to the text Qwen3.5 emits
  for a call; passed when the server's tool-call parser returns it as a ``tool_calls`` entry.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# z-lab/Qwen3.5-122B-A10B-DFlash as FACTS.md gives it; intermediate_size from its ~0.8B parameters
# (6 x (31.5M attention + 3 x 3072 x 9728 MLP) + the 8 x 3072 -> 3072 fc = 0.80B)
REAL_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 3072, "intermediate_size": 9728,
    "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 248320, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_theta": 10000000, "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "sliding_window": 4096, "block_size": 16, "target_hidden_size": 3072,
    "dflash_config": {"mask_token_id": 248077, "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]},
}
SHAPES = {"mixed": ["sliding_attention"] * 5 + ["full_attention"],  # which layer is the full one: not published
          "full6": ["full_attention"] * 6}
PROFILES = ("dense", "dflash")
CONTEXTS = (8192, 32768, 65536)
SUFFIX = 32
PORT = 8200
# what Qwen3.5 emits for a call (FACTS.md: the public recipe's qwen3_xml note), and a request whose
# answer is forced to it: thinking off so the reasoning parser hands it to the tool parser
TOOL_TEXT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
TOOL_REQUEST = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "tool_choice": "auto", "max_tokens": 64, "temperature": 0,
    "chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False,
    "structured_outputs": {"regex": re.escape(TOOL_TEXT)},
}


@dataclass(frozen=True)
class Case:
    profile: str
    shape: str
    caching: bool

    @property
    def key(self) -> str:
        return f"{self.profile}_{self.shape}_{'on' if self.caching else 'off'}"


def parse_cases(text: str) -> list[Case]:
    """``dense:mixed:on,dflash:full6:off``; ``all`` is every combination."""
    if text == "all":
        return [Case(p, s, c) for p in PROFILES for s in SHAPES for c in (True, False)]
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in PROFILES or parts[1] not in SHAPES or parts[2] not in ("on", "off"):
            raise argparse.ArgumentTypeError(f"{item!r}: write PROFILE:SHAPE:CACHING with PROFILE in {PROFILES}, "
                             f"SHAPE in {tuple(SHAPES)}, CACHING on|off")
        out.append(Case(parts[0], parts[1], parts[2] == "on"))
    return out


def parse_contexts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(c < 64 for c in out):
        raise argparse.ArgumentTypeError(f"{text!r}: token counts of at least 64, comma-separated")
    return out


def drafter_config(shape: str) -> dict:
    """The drafter's config.json. transformers' Qwen3Config drops ``sliding_window`` unless
    ``use_sliding_window`` is true, and vLLM's DFlash then has no window for the sliding layers
    (ValueError in 0.26.0's ``_resolve_layer_attention``): the mixed shape sets it."""
    return dict(REAL_DRAFTER, layer_types=list(SHAPES[shape]), use_sliding_window=shape == "mixed")


def write_drafters(out: Path) -> list[Path]:
    """``drafter-mixed`` and ``drafter-full6``: config.json only (the engine fills dummy weights)."""
    written = []
    for shape in SHAPES:
        d = out / f"drafter-{shape}"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "config.json.tmp"
        tmp.write_text(json.dumps(drafter_config(shape), indent=2) + "\n")
        tmp.replace(d / "config.json")
        written.append(d)
    return written


def gpu_recipe(out: Path, caching: bool, max_model_len: int, kv_bytes: int, eager: bool = True) -> Path:
    """The shipped 122B recipe with its profiles set for config-only checkpoints: dummy weights,
    eager (or, ``eager=False``, the profiles' own compile and CUDA-graph mode), no image inputs, a
    fixed KV-cache size, the context the TTFT step needs, prefix caching as the case says, and no
    smoke answer to expect."""
    import yaml

    from hybrid_build.recipes.schema import load_recipe

    rec = yaml.safe_load(load_recipe("qwen3.5-122b-a10b").to_yaml())
    for prof in rec["serve"]["profiles"].values():
        # kv_bytes 0: the profile's own gpu_memory_utilization sizes the pool (what `plan` predicts)
        prof.update(load_format="dummy", max_model_len=max_model_len, enable_prefix_caching=caching)
        prof["extra_args"] = list(prof.get("extra_args") or []) + (["--enforce-eager"] if eager else []) + [
            "--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0}),
            # the GPU image has no flashinfer, which vLLM 0.26.0 picks for the GDN prefill on sm90
            # (the engine failed its warm-up with ModuleNotFoundError there)
            "--gdn-prefill-backend", "triton"]
        if kv_bytes:
            prof["gpu_memory_utilization"] = 0.9
            prof["extra_args"] += ["--kv-cache-memory-bytes", str(kv_bytes)]
    rec["serve"]["smoke_expect"] = None
    path = out / f"agent-recipe-{'on' if caching else 'off'}{'' if eager else '-graphs'}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    return path


# the config-only target each profile serves (floor_configs.py): the hybrid for dense, the source for dflash
TARGETS = {"dense": "L48-dense", "dflash": "L48-base"}


def serve_command(case: Case, floor: Path, recipe: Path, port: int, ready_timeout: float, log: Path) -> list[str]:
    artifact = floor / TARGETS[case.profile]
    return ["hybrid-build", "serve", str(artifact), "--profile", case.profile, "--recipe", str(recipe),
            "--drafter", str(floor / f"drafter-{case.shape}"), "--port", str(port), "--no-smoke", "--no-verify",
            "--ready-timeout", str(int(ready_timeout)), "--log", str(log), "--json"]


EXCEPTION_LINE = re.compile(r"\b([A-Za-z_][A-Za-z0-9_.]*(?:Error|Exception))\b:?(.*)$")


def first_error(text: str) -> str | None:
    """The first exception line of a log (``NotImplementedError: ...``, ``AssertionError``)."""
    for line in text.splitlines():
        m = EXCEPTION_LINE.search(line)
        if m and not line.lstrip().startswith(("File ", "raise ", "except ")):
            return line.strip()[-400:]
    return None


def http(url: str, payload: dict | None = None, timeout: float = 600) -> dict | str:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read().decode()
    return json.loads(body) if payload is not None else body


def cache_counters(port: int) -> dict[str, float]:
    """``vllm:prefix_cache_queries`` / ``_hits`` (tokens), summed over engines."""
    out = {"queries": 0.0, "hits": 0.0}
    for line in str(http(f"http://127.0.0.1:{port}/metrics", timeout=30)).splitlines():
        for k in out:
            if line.startswith(f"vllm:prefix_cache_{k}_total") or line.startswith(f"vllm:prefix_cache_{k}{{"):
                out[k] += float(line.rsplit(" ", 1)[1])
    return out


# vLLM's per-request histograms (v1/metrics/loggers.py): their _sum moves by one request's seconds
# when requests run one at a time, which splits a TTFT into the server's phases
PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "ttft_server": "vllm:time_to_first_token_seconds", "e2e_server": "vllm:e2e_request_latency_seconds"}


def metric_sums(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """The named counters (``_total``) and histogram sums (``_sum``), summed over their labels."""
    out = dict.fromkeys(names, 0.0)
    for line in str(http(f"http://127.0.0.1:{port}/metrics", timeout=30)).splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for n in names:
            if name in (n, f"{n}_total", f"{n}_sum"):
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


def timed_prompt(port: int, ids: list[int], phases: dict | None = None) -> tuple[float, float]:
    """Seconds to the one generated token, and the prefix-cache hit tokens of that request; with
    ``phases`` (a dict), the server's queue / prefill / TTFT / end-to-end seconds of it are put there."""
    names = tuple(PHASES.values()) if phases is not None else ()
    before = cache_counters(port), metric_sums(port, names) if names else {}
    t = time.perf_counter()
    http(f"http://127.0.0.1:{port}/v1/completions",
         {"model": "qwen", "prompt": ids, "max_tokens": 1, "temperature": 0})
    dt = time.perf_counter() - t
    if names:
        after = metric_sums(port, names)
        phases.update({k: round(after[n] - before[1][n], 4) for k, n in PHASES.items()})
    return dt, cache_counters(port)["hits"] - before[0]["hits"]


def token_ids(n: int, seed: int) -> list[int]:
    """n ids in the tiny tokenizer's range, different for every seed (no accidental prefix hits)."""
    return [(seed * 7919 + 37 * i + (i * i) % 101) % 3800 + 150 for i in range(n)]


def ttft(port: int, contexts: list[int], runs: int, seed0: int = 1, phases: bool = False) -> dict:
    """Cold / warm TTFT per context (module docstring); ``phases``: each request's server-side phases
    too, and first a short cold prompt (``SUFFIX`` tokens), the time any request takes here."""
    out: dict = {}
    seed = seed0
    if phases:
        floor: dict = {}
        t, _ = timed_prompt(port, token_ids(SUFFIX, 99_000 + seed0), floor)
        out["floor"] = {"prompt_tokens": SUFFIX, "s": round(t, 4), "phases": floor}
    for ctx in contexts:
        rows = []
        for _ in range(runs):
            prefix = token_ids(ctx, seed)
            seed += 1
            cold_ph: dict | None = {} if phases else None
            warm_ph: dict | None = {} if phases else None
            cold, cold_hit = timed_prompt(port, prefix + token_ids(SUFFIX, 10_000 + seed), cold_ph)
            warm, warm_hit = timed_prompt(port, prefix + token_ids(SUFFIX, 20_000 + seed), warm_ph)
            rows.append({"cold_s": round(cold, 4), "warm_s": round(warm, 4), "cold_hit_tokens": cold_hit,
                         "warm_hit_tokens": warm_hit} | ({"cold_phases": cold_ph, "warm_phases": warm_ph}
                                                        if phases else {}))
        cold_m = statistics.median(r["cold_s"] for r in rows)
        warm_m = statistics.median(r["warm_s"] for r in rows)
        out[str(ctx)] = {"prompt_tokens": ctx + SUFFIX, "runs": rows, "cold_s": round(cold_m, 4),
                         "warm_s": round(warm_m, 4), "cold_over_warm": round(cold_m / warm_m, 2),
                         "warm_hit_tokens": statistics.median(r["warm_hit_tokens"] for r in rows)}
    return out


def tools_check(port: int) -> dict:
    r = http(f"http://127.0.0.1:{port}/v1/chat/completions", dict(TOOL_REQUEST, model="qwen"), timeout=120)
    msg = r["choices"][0]["message"]
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in msg.get("tool_calls") or []]
    ok = calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    return {"passed": ok, "tool_calls": calls, "content": msg.get("content"),
            "finish_reason": r["choices"][0].get("finish_reason")}


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to serve's process group (it stops vLLM), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_case(case: Case, floor: Path, work: Path, out: Path, steps: list[str], contexts: list[int], runs: int,
             limit: float, kv_bytes: int) -> dict:
    """One serve of ``case``; its start verdict and, when started with caching on, ttft / tools."""
    t0 = time.time()
    recipe = gpu_recipe(work, case.caching, max(contexts) + 4 * SUFFIX + 2048, kv_bytes)
    log = out / f"serve_{case.key}.log"
    cmd = serve_command(case, floor, recipe, PORT, max(60, limit - 60), log)
    res: dict = {"case": case.key, "command": " ".join(cmd)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        while proc.poll() is None and time.time() - t0 < limit:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            try:
                res["ready"] = json.loads("".join(lines))
                break
            except ValueError:
                continue
        if "ready" in res:
            res.update(verdict="started", ready_s=res["ready"].get("ready_s"))
            if case.caching and "ttft" in steps:
                res["ttft"] = ttft(PORT, contexts, runs)
            if "tools" in steps:
                res["tools"] = tools_check(PORT)
        else:
            try:
                proc.wait(max(5, min(60, limit - (time.time() - t0))))
            except subprocess.TimeoutExpired:
                pass
            err = proc.stderr.read() if proc.poll() is not None else ""
            text = log.read_text(errors="replace") if log.exists() else ""
            if proc.returncode in (2, 3) and "error:" in err and not text:
                res.update(verdict="refused", exit_code=proc.returncode, line=err.strip().splitlines()[-1])
            else:
                res.update(verdict="failed", exit_code=proc.returncode,
                           first_error=first_error(text) or first_error(err) or "not ready in time",
                           stderr_tail=err[-800:])
    except Exception as e:
        res.setdefault("verdict", "failed")
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop(proc)
        err_rest = proc.stderr.read() if proc.stderr and not proc.stderr.closed else ""
        res["notes"] = [ln.strip() for ln in (res.get("stderr_tail", "") + err_rest).splitlines()
                        if ln.startswith("note:")]
        res["wall_s"] = round(time.time() - t0, 1)
    return res


def run(steps: list[str], record, out: Path, floor: Path, work: Path, cases: list[Case], contexts: list[int],
        runs: int, left, kv_bytes: int = 32 << 30) -> None:
    """The driver's entry: each case in turn while time is left (a case needs 200 s at least)."""
    for case in cases:
        if left() < 200:
            record(out, f"agent_{case.key}", {"skipped": f"no time left ({left():.0f} s)"})
            continue
        record(out, f"agent_{case.key}", run_case(case, floor, work, out, steps, contexts, runs, left(), kv_bytes))


def cut_experts(src: Path, out: Path, experts: int) -> list[Path]:
    """The config-only targets and drafters of ``src`` (floor_configs.py + ``drafters``) with the
    routed experts cut to ``experts``, for an 80 GB card: the attention, GDN, KV and drafter shapes
    are unchanged and prefill does the same work per token; only the expert weights shrink."""
    import shutil

    made = []
    for name in ("L48-dense", "L48-base", "drafter-mixed", "drafter-full6"):
        if not (src / name).is_dir():
            continue
        # a floor made before config-only targets stopped holding a `hybrid_build/` folder: left out
        # (serve refuses a folder holding one without a provenance, as a build that did not finish)
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(src / name, out / name, ignore=shutil.ignore_patterns("hybrid_build"))
        if name.startswith("L48-"):
            cfg = json.loads((out / name / "config.json").read_text())
            cfg.get("text_config", cfg)["num_experts"] = experts
            (out / name / "config.json").write_text(json.dumps(cfg, indent=2))
        made.append(out / name)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="config-only DFlash drafters of the real 122B drafter's shape")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drafters", help="write drafter-mixed/ and drafter-full6/ into FOLDER")
    d.add_argument("folder", type=Path)
    c = sub.add_parser("cut-experts", help="copy the full-depth targets and drafters of SRC into OUT with "
                                           "--experts routed experts (an H100: 64)")
    c.add_argument("src", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--experts", type=int, default=64)
    a = ap.parse_args(argv)
    made = cut_experts(a.src, a.out, a.experts) if a.cmd == "cut-experts" else write_drafters(a.folder)
    for p in made:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
