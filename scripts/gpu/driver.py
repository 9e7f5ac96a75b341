"""The H200 runs in one process tree: correctness, speed and serve profiles under vLLM.

Runs THERE (the GPU machine), started by ``scripts/gpu/run.sh``; every vLLM use is a child process
of this script (``driver.py child KIND ...``) with its own time limit, so one failure leaves the
rest running, and ``results.json`` is rewritten after each step so a cut-off run still reports.

Steps, in the order the GPU takes them (the synthetic build runs beside them on the CPUs):
- correct: the tiny ``inc-hybrid`` and ``compressed-tensors`` artifacts under ``vllm.LLM``; full
  prompt logprobs vs the CPU reference (``reference.py``) and the source; the quant method and
  kernel classes vLLM chose for each kind of layer.
- speed: a synthetic checkpoint with the real 122B widths and N decoder layers, its hybrid built
  by ``hybrid-build run --no-validate``; single-stream decode tok/s of ``base`` (the source) vs
  ``dense`` (the hybrid), no speculation, eager and (time permitting) CUDA graphs.
- profiles: ``hybrid-build serve`` with the dense (+ a random tiny DFlash drafter), base and mtp
  profiles; one completion each, spec-decode counters from ``/metrics``.
- floor: the per-step time floor at full depth. vLLM with ``load_format="dummy"``
  on config-only checkpoints (``floor_configs.py`` makes them here: real 122B widths, 48 layers and
  other linear/full-attention compositions), full CUDA graphs, single stream; ``warm`` compiles every
  kernel once on a 4-layer hybrid, ``floor`` interleaves base / dense / dense-triton-head engines at
  48 layers (``--repeat`` rounds), ``mix`` times the other compositions (base), ``eagerprof`` profiles
  one eager decode step kernel by kernel; every graphs engine also profiles its decode steps.
- ab_start / ab_bench / ab_eval / ab_stop: ``hybrid-build serve`` of the tiny artifact
  with the dense, dflash, base and mtp profiles side by side (their own process sessions, so a later
  call finds them), ``hybrid-build bench`` A/B on profile pairs (dflash vs dense: the same drafter on
  source and hybrid; base vs mtp), ``hybrid-build eval`` of base (the source) against dense (the hybrid).
- nccl_lo / tp2 / tp1 / pp2 / tp2s / tp2mp (a machine with two GPUs): ``multinode_steps.py``.
- vcompare: ``validate.vllm_compare.compare_in_vllm`` on the tiny source vs its hybrid, and
  on a synthetic 4-layer model with the Qwen3.5-35B-A3B widths (written and built here, on the CPUs,
  while the GPU warms up).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
MM_OFF = {"image": 0, "video": 0}
RESULTS: dict = {"steps": {}}
LOCK = threading.Lock()


def now() -> float:
    return time.time()


def save(out: Path) -> None:
    with LOCK:
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def record(out: Path, key: str, value) -> None:
    with LOCK:
        RESULTS["steps"][key] = value
    save(out)


def run_child(out: Path, key: str, args: list[str], limit: float, env: dict | None = None) -> dict:
    """Run ``driver.py child ...``; its last stdout line is JSON. The log goes to OUT/logs.txt."""
    t0 = now()
    if limit < 30:
        res = {"skipped": f"no time left ({limit:.0f} s)"}
        record(out, key, res)
        return res
    cmd = [sys.executable, str(HERE), "child"] + args
    full_env = dict(os.environ, **(env or {}))
    with open(out / "logs.txt", "a") as log:
        log.write(f"\n===== {key}: {' '.join(args)} (limit {limit:.0f} s)\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, text=True,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            log.write(f"\n----- output of {key}\n" + stdout[-60000:])
            res = {"error": f"timed out after {limit:.0f} s"}
        else:
            log.write(f"\n----- output of {key}\n" + stdout[-60000:])
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            try:
                res = json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}, no result"}
            except json.JSONDecodeError as e:
                res = {"error": f"unparsable result: {e}"}
            if proc.returncode and "error" not in res:
                res["error"] = f"exit {proc.returncode}"
    res["wall_s"] = round(now() - t0, 1)
    record(out, key, res)
    return res


# ------------------------------------------------------------------------------ children (vLLM)


def layer_report(model) -> dict:
    """Group the model's layers by (layer class, quant method, vLLM helper objects, param dtypes)."""
    groups: dict = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        helpers = {k: type(v).__name__ for k, v in vars(qm).items()
                   if type(v).__module__.startswith("vllm") and not isinstance(v, (str, int, float))}
        for k, v in list(vars(qm).items()):
            if type(v).__module__.startswith("vllm") and hasattr(v, "__dict__"):
                for k2, v2 in vars(v).items():
                    if type(v2).__module__.startswith("vllm") and not isinstance(v2, (str, int, float)):
                        helpers[f"{k}.{k2}"] = type(v2).__name__
        scheme = getattr(m, "scheme", None)
        if scheme is not None:
            helpers["layer.scheme"] = type(scheme).__name__
            for k, v in vars(scheme).items():
                if type(v).__module__.startswith("vllm"):
                    helpers["scheme." + k] = type(v).__name__
        params = {p: str(t.dtype).replace("torch.", "") for p, t in m.named_parameters(recurse=False)}
        kind = ("lm_head" if name.endswith("lm_head") else
                "shared_expert" if ".shared_expert." in name else
                "routed_experts" if name.endswith(".experts") else
                "mtp" if name.startswith("mtp") or ".mtp." in name else
                "visual" if "visual" in name else "other")
        key = json.dumps([kind, type(m).__name__, type(qm).__name__, helpers, params], sort_keys=True)
        g = groups.setdefault(key, {"kind": kind, "layer": type(m).__name__, "quant_method": type(qm).__name__,
                                    "helpers": helpers, "params": params, "count": 0, "example": name})
        g["count"] += 1
    return {"groups": sorted(groups.values(), key=lambda g: (g["kind"], g["example"]))}


def make_llm(model: str, **kw):
    from vllm import LLM

    args = dict(model=model, max_model_len=512, gpu_memory_utilization=0.15, enforce_eager=True,
                limit_mm_per_prompt=MM_OFF, gdn_prefill_backend="triton", seed=0, kv_cache_memory_bytes=2 << 30)
    args.update(kw)
    return LLM(**args)


def inspect_layers(llm) -> dict:
    try:
        reports = llm.apply_model(layer_report)
        return reports[0] if isinstance(reports, list) else reports
    except Exception as e:  # the inspection must not hide the numbers
        return {"error": f"{type(e).__name__}: {e}"}


def child_correct(artifact: str, ref_path: str, label: str, rows_out: str, ref_label: str = "") -> dict:
    """vLLM's full-vocabulary prompt logprobs of one checkpoint vs the CPU references (``ref_label``,
    default ``label``); the rows are saved to ``rows_out`` so that the artifacts can also be compared
    with vLLM's own run of the source."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    ref = torch.load(ref_path)
    vocab = ref["source"][0].shape[-1]
    t0 = now()
    llm = make_llm(artifact, max_logprobs=vocab)
    res: dict = {"load_s": round(now() - t0, 1), "layers": inspect_layers(llm)}
    prompts = list(ref["prompts"].items())
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab))
    vllm_rows = []
    for (_, ids), o in zip(prompts, outs):
        rows = torch.full((len(ids) - 1, vocab), float("-inf"), dtype=torch.float64)
        for t, d in enumerate(o.prompt_logprobs[1:]):  # entry t+1 is log p(token t+1 | tokens <= t)
            for tok, lp in d.items():
                if tok < vocab:
                    rows[t, tok] = lp.logprob
        vllm_rows.append(rows)
    res["vs_artifact_reference"] = compare(ref[ref_label or label], vllm_rows, prompts)
    fix = int_wna16.marlin_moe_permute_scales
    res["marlin_moe_scale_fix"] = {"installed": getattr(fix, "hybrid_build_fix", False),
                                   "changed_a_layout": getattr(fix, "fired", False)}
    res["vs_source"] = compare(ref["source"], vllm_rows, prompts)
    torch.save({"prompts": ref["prompts"], "rows": vllm_rows}, rows_out)
    res["logprob_entries_per_row"] = min(len(d) for o in outs for d in o.prompt_logprobs[1:])
    gen = llm.generate([TokensPrompt(prompt_token_ids=prompts[-1][1])],
                       SamplingParams(max_tokens=16, temperature=0.0))
    res["greedy_text"] = gen[0].outputs[0].text
    return res


def compare(ref_rows: list, q_rows: list, prompts: list) -> dict:
    """KL(ref || vLLM), top-1 agreement, perplexity change and the largest gap on the actual tokens."""
    import math

    import torch

    per, kls, agree, nll_r, nll_q, n, gap = {}, [], [], 0.0, 0.0, 0, 0.0
    for (name, ids), p, q in zip(prompts, ref_rows, q_rows):
        p = p.double()
        q = torch.log_softmax(q.double(), -1)  # renormalise: vLLM's rows are log-softmax already
        kl = (p.exp() * (p - q)).sum(-1)
        a = (p.argmax(-1) == q.argmax(-1)).double()
        tgt = torch.tensor(ids[1:])[:, None]
        lr, lq = p.gather(-1, tgt)[:, 0], q.gather(-1, tgt)[:, 0]
        gap = max(gap, (lr - lq).abs().max().item())
        per[name] = {"tokens": len(ids) - 1, "kl": kl.mean().item(), "top1": a.mean().item()}
        kls.append(kl)
        agree.append(a)
        nll_r, nll_q, n = nll_r - lr.sum().item(), nll_q - lq.sum().item(), n + len(ids) - 1
    kl = torch.cat(kls)
    return {"tokens": n, "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": torch.cat(agree).mean().item(),
            "ppl_change": math.exp(nll_q / n) / math.exp(nll_r / n) - 1.0,
            "max_abs_logprob_gap_on_tokens": gap, "prompts": per}


def kernel_times(prof) -> dict[str, tuple[int, float]]:
    """GPU kernels of a torch.profiler run: name -> (launches, total microseconds)."""
    import torch

    out: dict[str, tuple[int, float]] = {}
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        n, t = out.get(e.key, (0, 0.0))
        out[e.key] = (n + e.count, t + us)
    return out


def engine_agreement(work: Path) -> dict:
    """Each artifact's vLLM logprobs against vLLM's own logprobs of the source (same engine, same kernels
    apart from the converted layers): the conversion's effect inside the engine."""
    import torch

    try:
        src = torch.load(work / "rows-source.pt")
        prompts = list(src["prompts"].items())
        base = [torch.log_softmax(r, -1) for r in src["rows"]]
        return {label: compare(base, torch.load(work / f"rows-{label}.pt")["rows"], prompts)
                for label in ("inc-hybrid", "compressed-tensors", "source-head-at-load")
                if (work / f"rows-{label}.pt").exists()}
    except (OSError, KeyError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def decode_timer(llm, prompt):
    """``timed(n)``: seconds to generate exactly ``n`` tokens of ``prompt``, greedy, single stream."""
    from vllm import SamplingParams

    def timed(max_tokens: int) -> float:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        o = llm.generate(prompt, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert len(o[0].outputs[0].token_ids) == max_tokens, len(o[0].outputs[0].token_ids)
        return dt
    return timed


def child_speed(model: str, label: str, mode: str, tokens: str) -> dict:
    """Single-stream decode tok/s; in eager mode also the GPU kernels of one decode step (profiled)."""
    from vllm.inputs import TokensPrompt

    n = int(tokens)
    kw = dict(gpu_memory_utilization=0.35, max_num_seqs=1)
    if mode == "graphs":  # full CUDA graphs of the decode step, no torch.compile (minutes saved)
        kw.update(enforce_eager=False, compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                                           "cudagraph_capture_sizes": [1, 2]})
    elif mode == "compiled":  # vLLM's default serving mode: torch.compile + its default CUDA graph mode
        kw.update(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2]})
    t0 = now()
    llm = make_llm(model, **kw)
    res: dict = {"label": label, "mode": mode, "load_s": round(now() - t0, 1),
                 "head_kernel": os.environ.get("HYBRID_BUILD_INT8_HEAD_KERNEL", "vllm")}
    if label.startswith("dense"):
        res["layers"] = inspect_layers(llm)
    prompt = [TokensPrompt(prompt_token_ids=[(37 * i) % 900 + 100 for i in range(32)])]

    timed = decode_timer(llm, prompt)

    timed(n + 1)  # warm-up: kernels, allocator
    decode = []
    for _ in range(3):
        t1, tn = timed(1), timed(n + 1)
        decode.append(n / (tn - t1))  # n decode steps beyond the first token
    res.update({"decode_tok_s_runs": [round(x, 2) for x in decode], "decode_tok_s": round(statistics.median(decode), 2),
                "decode_tokens": n})
    if mode == "eager":  # what one decode step spends on the GPU, kernel by kernel
        import torch
        from torch.profiler import ProfilerActivity, profile

        steps = 16
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts) as p1:
            timed(1)
        with profile(activities=acts) as pn:
            timed(steps + 1)
        torch.cuda.synchronize()
        k1, kn = kernel_times(p1), kernel_times(pn)
        per_step = {k: ((c - k1.get(k, (0, 0))[0]) / steps, (us - k1.get(k, (0, 0.0))[1]) / steps)
                    for k, (c, us) in kn.items()}
        top = sorted(per_step.items(), key=lambda kv: -kv[1][1])[:25]
        res["gpu_us_per_step"] = round(sum(v[1] for v in per_step.values()), 1)
        res["launches_per_step"] = round(sum(v[0] for v in per_step.values()), 1)
        res["wall_us_per_step"] = round(1e6 / res["decode_tok_s"], 1)
        res["top_kernels_per_step"] = [{"kernel": k[:140], "launches": round(c, 2), "us": round(us, 1)}
                                       for k, (c, us) in top]
    return res


def kernel_table(prof_1, prof_n, steps: int) -> dict:
    """Per decode step: every GPU kernel (launches, us), from a 1-token and a (steps+1)-token run."""
    k1, kn = kernel_times(prof_1), kernel_times(prof_n)
    per_step = {k: ((c - k1.get(k, (0, 0))[0]) / steps, (us - k1.get(k, (0, 0.0))[1]) / steps)
                for k, (c, us) in kn.items()}
    rows = sorted(((k, c, us) for k, (c, us) in per_step.items() if c > 0 or us > 0), key=lambda r: -r[2])
    return {"gpu_us_per_step": round(sum(r[2] for r in rows), 1),
            "launches_per_step": round(sum(r[1] for r in rows), 1),
            "kernels_per_step": [{"kernel": k[:160], "launches": round(c, 3), "us": round(us, 2)} for k, c, us in rows]}


def child_floor(model: str, label: str, mode: str, tokens: str, profile_steps: str = "0", timings: str = "5") -> dict:
    """Single-stream decode of a config-only checkpoint with dummy weights (graphs or
    eager); ``timings`` pairs t(1), t(n+1) after a warm-up; then, if ``profile_steps``, the GPU
    kernels of that many decode steps (in graphs mode: the kernels the graph replays)."""
    from vllm.inputs import TokensPrompt

    n, steps = int(tokens), int(profile_steps)
    kw = dict(load_format="dummy", gpu_memory_utilization=0.1, max_num_seqs=1)
    if mode == "graphs":
        kw.update(enforce_eager=False, compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                                           "cudagraph_capture_sizes": [1, 2]})
    t0 = now()
    llm = make_llm(model, **kw)
    res: dict = {"label": label, "mode": mode, "load_s": round(now() - t0, 1), "model": Path(model).name,
                 "head_kernel": os.environ.get("HYBRID_BUILD_INT8_HEAD_KERNEL", "vllm")}
    if "dense" in label:
        res["layers"] = inspect_layers(llm)
    prompt = [TokensPrompt(prompt_token_ids=[(37 * i) % 900 + 100 for i in range(32)])]

    timed = decode_timer(llm, prompt)

    timed(n + 1)  # warm-up
    pairs = [(timed(1), timed(n + 1)) for _ in range(int(timings))]
    decode = [n / (tn - t1) for t1, tn in pairs]
    res.update({"decode_tok_s_runs": [round(x, 2) for x in decode], "decode_tok_s": round(statistics.median(decode), 2),
                "step_ms_runs": [round(1e3 / x, 4) for x in decode],
                "step_ms": round(1e3 / statistics.median(decode), 4),
                "prefill_1_token_s": [round(t1, 4) for t1, _ in pairs], "decode_tokens": n})
    if steps:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts) as p1:
            timed(1)
        with profile(activities=acts) as pn:
            t = timed(steps + 1)
        torch.cuda.synchronize()
        res["profile"] = kernel_table(p1, pn, steps)
        res["profile"]["steps"] = steps
        res["profile"]["wall_us_per_step_profiled"] = round(1e6 * t / (steps + 1), 1)
        try:  # the kernel sequence (name, start, duration in us), for attributing time to layers on the CPU
            import gzip

            cuda = torch.autograd.DeviceType.CUDA
            seq = sorted((e.time_range.start, e.time_range.end - e.time_range.start, e.name)
                         for e in pn.events() if getattr(e, "device_type", None) == cuda)
            names = sorted({n for _, _, n in seq})
            index = {n: i for i, n in enumerate(names)}
            doc = {"label": label, "mode": mode, "steps": steps, "names": names,
                   "seq": [[round(t0, 2), round(d, 2), index[n]] for t0, d, n in seq]}
            path = Path(os.environ.get("HB_TRACE_DIR", "/tmp")) / f"kseq-{label}-{mode}-{Path(model).name}.json.gz"
            with gzip.open(path, "wt") as f:
                json.dump(doc, f)
            res["profile"]["kernel_sequence"] = str(path)
        except Exception as e:  # a convenience: the table above is the result
            res["profile"]["kernel_sequence_error"] = f"{type(e).__name__}: {e}"
    return res


def child_concurrency(model: str, label: str, tokens: str, streams: str = "1,2,4", timings: str = "3") -> dict:
    """Decode of ``streams`` concurrent sequences on a config-only checkpoint with dummy
    weights (full CUDA graphs of the decode step, as the floor step). For N streams, N distinct
    prompts are generated together, all ``tokens`` long (ignore_eos), so the N decode in lockstep:
    per-stream tok/s = n / (t(n + 1) - t(1)), total = N x that; median of ``timings`` pairs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n, ns = int(tokens), [int(x) for x in streams.split(",")]
    sizes = sorted({1, 2, 4, *ns})
    kw = dict(load_format="dummy", gpu_memory_utilization=0.1, max_num_seqs=max(ns), enforce_eager=False,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes})
    t0 = now()
    llm = make_llm(model, **kw)
    res: dict = {"label": label, "mode": "graphs", "load_s": round(now() - t0, 1), "model": Path(model).name,
                 "head_kernel": os.environ.get("HYBRID_BUILD_INT8_HEAD_KERNEL", "vllm"), "decode_tokens": n,
                 "streams": {}}

    def timed(prompts, max_tokens: int) -> float:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt

    for count in ns:
        prompts = [TokensPrompt(prompt_token_ids=[(37 * i + 101 * j) % 900 + 100 for i in range(32)])
                   for j in range(count)]
        timed(prompts, n + 1)  # warm-up
        pairs = [(timed(prompts, 1), timed(prompts, n + 1)) for _ in range(int(timings))]
        per_stream = [n / (tn - t1) for t1, tn in pairs]
        med = statistics.median(per_stream)
        res["streams"][str(count)] = {"tok_s_per_stream_runs": [round(x, 2) for x in per_stream],
                                      "tok_s_per_stream": round(med, 2), "tok_s_total": round(count * med, 2),
                                      "step_ms": round(1e3 / med, 4)}
    return res


def child_main(argv: list[str]) -> int:
    kind, args = argv[0], argv[1:]
    try:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            from hybrid_build.serve.runtime.plugin import register

            register()  # the entry point does this too; in-process it must be there before LLM()
        res = {"correct": child_correct, "speed": child_speed, "floor": child_floor,
               "conc": child_concurrency}[kind](*args)
    except Exception as e:
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        inner = [err.get("ctx", {}).get("error") for err in getattr(e, "errors", lambda: [])()]
        for err in inner:  # pydantic hides where an assert in a config's __post_init__ failed
            if isinstance(err, BaseException):
                res["cause"] = "".join(traceback.format_exception(err))[-3000:]
    print(json.dumps(res, default=str), flush=True)
    return 0


# ------------------------------------------------------------------------------ synthetic build


def build_synthetic(work: Path, out: Path, layers: int, tokenizer_from: Path) -> None:
    """Source (INT4 + BF16 shared experts + BF16 head, real widths) and its hybrid, on this disk."""
    t0 = now()
    res: dict = {"layers": layers}
    try:
        from hybrid_build.pipeline.generators import synthetic as syn

        cfg = syn.qwen35_122b_config()
        cfg["text_config"]["mtp_num_hidden_layers"] = 0  # MTP is not used for the no-speculation timing
        cfg["vision_config"]["depth"] = 1  # the vision tower is not on the decode path
        src = work / "synth-src"
        cfg = syn.select_layers(cfg, range(layers))
        tensors = [t for t in syn.synthetic_tensors(cfg) if not t.mtp]
        syn.write_synthetic_checkpoint(src, cfg, sparse=False, tensors=tensors)
        # the tiny model's tokenizer: vLLM loads this model the way it loads the tiny one
        for f in tokenizer_from.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
                shutil.copy(f, src / f.name)
        res["source_bytes"] = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        res["write_s"] = round(now() - t0, 1)
        t1 = now()
        proc = subprocess.run(["hybrid-build", "run", str(src), "-o", str(work / "synth-hybrid"), "--no-validate",
                               "--recipe", "qwen3.5-122b-a10b", "--force", "-q", "--json"],
                              capture_output=True, text=True, timeout=900)
        res["run_rc"] = proc.returncode
        res["run_s"] = round(now() - t1, 1)
        res["run_tail"] = (proc.stdout + proc.stderr)[-3000:]
        if proc.returncode == 0:
            res["hybrid_bytes"] = sum(p.stat().st_size for p in (work / "synth-hybrid").glob("*.safetensors"))
            for name, path in (("plan_source", src), ("plan_hybrid", work / "synth-hybrid")):
                p = subprocess.run(["hybrid-build", "plan", str(path), "--hardware", "h200", "--recipe",
                                    "qwen3.5-122b-a10b", "--json"], capture_output=True, text=True, timeout=300)
                res[name] = json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-1500:]}
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    res["wall_s"] = round(now() - t0, 1)
    record(out, "synthetic_build", res)


def qwen35_35b_config(layers: int = 4) -> dict:
    """A config with the Qwen3.5-35B-A3B widths (FACTS.md: hidden 2048, 40 layers 30+10, 256 experts
    of 512, shared expert 512; attention and DeltaNet heads assumed as in the Qwen3-Next family:
    16 q / 2 kv heads of 256, 16 key / 32 value heads of 128), keeping the first ``layers``
    (3 linear + 1 full for 4); MTP left out, vision depth 1."""
    from hybrid_build.pipeline.generators import synthetic as syn

    cfg = syn.qwen35_122b_config()
    tc = cfg["text_config"]
    tc.update(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
              shared_expert_intermediate_size=512, mtp_num_hidden_layers=0)
    tc["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)]
    cfg["vision_config"].update(depth=1, out_hidden_size=2048)
    return syn.select_layers(cfg, range(layers))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_35b(work: Path, tokenizer_from: Path, layers: int = 4) -> dict:
    """The 35B-width synthetic source (random weights, seed 0: the same bytes wherever it is
    written) and its hybrid, built by ``hybrid-build run --recipe qwen3.5-35b-a3b --force``."""
    from hybrid_build.pipeline.generators import synthetic as syn

    t0 = now()
    src, hyb = work / "w35-src", work / "w35-hybrid"
    res: dict = {"layers": layers, "source": str(src), "hybrid": str(hyb)}
    if not (src / "model.safetensors.index.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        cfg = qwen35_35b_config(layers)
        syn.write_synthetic_checkpoint(src, cfg, sparse=False,
                                       tensors=[t for t in syn.synthetic_tensors(cfg) if not t.mtp])
        for f in TOKENIZER_FILES:
            if (tokenizer_from / f).exists():
                shutil.copy(tokenizer_from / f, src / f)
    res["source_bytes"] = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    res["write_s"] = round(now() - t0, 1)
    t1 = now()
    if not (hyb / "model.safetensors.index.json").exists():
        proc = subprocess.run(["hybrid-build", "run", str(src), "-o", str(hyb), "--recipe", "qwen3.5-35b-a3b",
                               "--force", "--no-validate", "-q"], capture_output=True, text=True, timeout=900)
        res["run_rc"], res["run_tail"] = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    res["run_s"] = round(now() - t1, 1)
    res["hybrid_bytes"] = sum(p.stat().st_size for p in hyb.glob("*.safetensors"))
    return res


def vcompare(out: Path, key: str, source: Path, artifact: Path, texts: dict, work: Path, limit: float) -> None:
    """``compare_in_vllm`` on one source/hybrid pair; the report goes into results.json."""
    t0 = now()
    if limit < 60:
        record(out, key, {"skipped": f"no time left ({limit:.0f} s)"})
        return
    try:
        from hybrid_build.validate.vllm_compare import compare_in_vllm

        rep = compare_in_vllm(source, artifact, texts, gpu_memory_utilization=0.1, kv_cache_memory_bytes=2 << 30,
                              timeout_s=limit / 2, work_dir=work / f"vc-{key}")
        res = {"report": rep}
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
    for label in ("source", "hybrid"):  # the children's logs, for what went wrong
        logf = work / f"vc-{key}" / label / "child.log"
        if logf.exists():
            with LOCK, open(out / "logs.txt", "a") as f:
                f.write(f"\n===== {key} {label} child\n" + logf.read_text(errors="replace")[-60000:])
    shutil.rmtree(work / f"vc-{key}" / "source", ignore_errors=True)  # the logits: GBs at a 248k vocabulary
    shutil.rmtree(work / f"vc-{key}" / "hybrid", ignore_errors=True)
    res["wall_s"] = round(now() - t0, 1)
    record(out, key, res)


# ------------------------------------------------------------------------------ serve profiles


def http(url: str, payload: dict | None = None, timeout: float = 30) -> str:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def gpu_recipe(artifact: Path, work: Path) -> Path:
    """The artifact's own recipe with eager mode, the Triton GDN prefill and no image inputs added:
    FlashInfer is not on this machine and CUDA-graph capture would cost minutes per profile."""
    import yaml

    rec = yaml.safe_load((artifact / "hybrid_build" / "recipe.yaml").read_text())
    for prof in rec["serve"]["profiles"].values():
        prof["extra_args"] = list(prof.get("extra_args") or []) + [
            "--enforce-eager", "--gdn-prefill-backend", "triton", "--limit-mm-per-prompt", json.dumps(MM_OFF),
            "--kv-cache-memory-bytes", str(2 << 30)]
        prof["gpu_memory_utilization"] = 0.2
        prof["max_model_len"] = 1024
    # random weights say no capital: any answer passes (artifacts built before recipes carried
    # serve.smoke_expect default to "Paris", which stopped the issue-20 run's single-GPU server)
    rec["serve"]["smoke_expect"] = None
    path = work / "gpu-tiny-recipe.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    return path


def serve_command(hb: Path, src: Path, recipe: Path, profile: str, port: int, ready_timeout: float, log: Path,
                  drafter: Path | None = None) -> list[str]:
    """``hybrid-build serve`` of the tiny artifact with one profile (no smoke test: random weights).
    ``--force``: the artifact was built here and carried, so there it is a download nobody validated,
    which serve refuses otherwise; verify still runs before READY."""
    cmd = ["hybrid-build", "serve", str(hb / "inc"), "--profile", profile, "--recipe", str(recipe),
           "--port", str(port), "--source", str(src), "--no-smoke", "--ready-timeout", str(int(ready_timeout)),
           "--log", str(log), "--json", "--force"]
    return cmd + (["--drafter", str(drafter)] if drafter else [])


def spec_lines(port: int) -> list[str] | str:
    """The speculative-decoding counter lines of the server's /metrics."""
    try:
        text = http(f"http://127.0.0.1:{port}/metrics", timeout=10)
    except Exception as e:
        return f"unavailable: {e}"
    return [ln for ln in text.splitlines() if ln.startswith("vllm:spec_decode") and not ln.startswith("#")][:16]


def serve_profile(out: Path, hb: Path, src: Path, recipe: Path, profile: str, port: int, limit: float,
                  drafter: Path | None = None) -> None:
    key = f"profile_{profile}"
    t0 = now()
    res: dict = {"profile": profile}
    if limit < 60:
        record(out, key, {"skipped": f"no time left ({limit:.0f} s)"})
        return
    cmd = serve_command(hb, src, recipe, profile, port, limit - 30, out / f"serve_{profile}.log", drafter)
    res["command"] = " ".join(cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        ready = False
        while now() - t0 < limit - 25 and proc.poll() is None:
            try:
                http(base + "/models", timeout=3)
                ready = True
                break
            except Exception:
                time.sleep(2)
        res["ready"] = ready
        res["ready_s"] = round(now() - t0, 1)
        if ready:
            for prompt in ("The capital of France is", "def add(a, b):"):
                r = json.loads(http(base + "/completions", {"model": "qwen", "prompt": prompt, "max_tokens": 32,
                                                            "temperature": 0}, timeout=60))
                res.setdefault("completions", []).append({"prompt": prompt, "text": r["choices"][0]["text"],
                                                          "usage": r.get("usage")})
            res["spec_metrics"] = spec_lines(port)
        else:
            exited = f" (hybrid-build serve exited {proc.returncode})" if proc.poll() is not None else ""
            res["error"] = "not ready" + exited
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop_group(proc)  # the serve command stops its vLLM server on Ctrl-C
        res["serve_stdout"] = (proc.stdout.read() if proc.stdout else "")[-2000:]
        logf = out / f"serve_{profile}.log"
        if logf.exists():
            text = logf.read_text(errors="replace")
            res["log_lines"] = [ln[-300:] for ln in text.splitlines()
                                if re.search(r"hybrid-build|speculative|Speculative|dflash|DFlash|MTP|mtp|"
                                             r"Error|error|quantiz|Marlin|Fp8|FP8|acceptance|Accept", ln)][-40:]
        res["wall_s"] = round(now() - t0, 1)
        record(out, key, res)


# ------------------------------------------------------------------------------ integrity


def integrity_step(out: Path, hb: Path, src: Path, recipe: Path, work: Path, left) -> None:
    """``serve`` against the artifact's files: a copy of the tiny artifact with one shard byte
    changed in place (size and mtime put back) is refused before vLLM starts (no vLLM process, no
    engine log); and what the check costs: ``serve --dry-run`` cold (hash cache removed) and warm,
    alternated, 5 each, beside the check alone in one process (``core.integrity``), cold and warm."""
    res: dict = {}
    copy = work / "integrity-inc"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(hb / "inc", copy)
    time.sleep(2.5)  # files younger than the check's racy window are not cached (core/integrity.py)
    cache = copy / ".hybrid-build" / "artifact-sha256.json"

    def dry() -> tuple[float, int, str]:
        cmd = ["hybrid-build", "serve", str(copy), "--profile", "base", "--recipe", str(recipe), "--source", str(src),
               "--dry-run", "-q"]
        t0 = now()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return now() - t0, p.returncode, (p.stdout + p.stderr)[-400:]

    times: dict[str, list[float]] = {"warm": [], "cold": []}
    for _ in range(5):
        if left() < 60:
            break
        cache.unlink(missing_ok=True)
        for state in ("cold", "warm"):
            t, rc, tail = dry()
            times[state].append(t)
            res.setdefault(f"{state}_rc", rc)
            res.setdefault(f"{state}_tail", tail)
    res["dry_run_s"] = {k: {"best": round(min(v), 3), "median": round(statistics.median(v), 3), "runs": len(v)}
                        for k, v in times.items() if v}
    alone = ("import json, sys; from pathlib import Path; from hybrid_build.core.integrity import check_artifact; "
             "a = Path(sys.argv[1]); (a / '.hybrid-build' / 'artifact-sha256.json').unlink(missing_ok=True); "
             "print(json.dumps([check_artifact(a).to_json(), check_artifact(a).to_json()]))")
    p = subprocess.run([sys.executable, "-c", alone, str(copy)], capture_output=True, text=True, timeout=120)
    try:
        res["check_alone"] = dict(zip(("cold", "warm"), json.loads(p.stdout)))
    except ValueError:
        res["check_alone_error"] = (p.stdout + p.stderr)[-600:]
    shard = sorted(copy.glob("model-*.safetensors"))[-1]
    st = shard.stat()
    with open(shard, "r+b") as f:  # one byte changed in place, size and mtime put back
        f.seek(st.st_size - 1)
        b = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    log = out / "integrity_serve.log"
    cmd = ["hybrid-build", "serve", str(copy), "--profile", "base", "--recipe", str(recipe), "--source", str(src),
           "--port", "8290", "--no-smoke", "--log", str(log), "--json"]
    before = subprocess.run(["pgrep", "-fc", "vllm.entrypoints"], capture_output=True, text=True).stdout.strip()
    t0 = now()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    res["changed_shard"] = {"file": shard.name, "serve_rc": p.returncode, "seconds": round(now() - t0, 2),
                            "stderr": p.stderr[-600:], "stdout": p.stdout[-600:], "engine_log_written": log.exists(),
                            "vllm_processes_before": before,
                            "vllm_processes_after": subprocess.run(["pgrep", "-fc", "vllm.entrypoints"],
                                                                   capture_output=True, text=True).stdout.strip()}
    record(out, "integrity", res)


# ------------------------------------------------------------------------------ verify


def stop_group(proc: subprocess.Popen) -> None:
    """Ctrl-C to a child's process group (serve tears vLLM down on it), SIGKILL after 25 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(25)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_verified(out: Path, key: str, cmd: list[str], env: dict, limit: float) -> dict:
    """``hybrid-build serve --json`` with its verify-before-ready: the JSON it prints at READY (with
    the verify figures) or its exit code and last lines when verify (or anything) stops it; then
    Ctrl-C. Also ``hybrid-build verify --json`` against the running server, for the figures."""
    t0 = now()
    res: dict = {"command": " ".join(cmd), "env": env}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, **env))
    lines: list[str] = []
    try:
        while now() - t0 < limit and proc.poll() is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            try:
                res["ready_json"] = json.loads("".join(lines))
                break
            except ValueError:
                continue
        res["ready_s"] = round(now() - t0, 1)
        if "ready_json" in res and "base_url" not in res["ready_json"]:  # verify failed: serve stops by itself
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        elif "ready_json" in res:
            base = res["ready_json"]["base_url"]
            v = subprocess.run(["hybrid-build", "verify", base, "--artifact", cmd[2], "--json"]
                               + (["--against", "source"] if "--profile" in cmd and cmd[cmd.index("--profile") + 1]
                                  in ("base", "mtp", "dflash") else []),
                               capture_output=True, text=True, timeout=max(30, limit - (now() - t0)))
            res["verify_rc"] = v.returncode
            try:
                res["verify"] = json.loads(v.stdout)
            except ValueError:
                res["verify_out"] = (v.stdout + v.stderr)[-1500:]
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop_group(proc)
        res["serve_rc"] = proc.returncode
        res["serve_stderr"] = (proc.stderr.read() if proc.stderr else "")[-1500:]
        res["wall_s"] = round(now() - t0, 1)
        record(out, key, res)
    return res


def kv_fp8_recipe(recipe: Path) -> Path:
    """The GPU recipe with every profile's KV cache in fp8 (vLLM's --kv-cache-dtype fp8,
    checked with verify before any shipped profile turns it on)."""
    import yaml

    rec = yaml.safe_load(recipe.read_text())
    for prof in rec["serve"]["profiles"].values():
        prof["kv_cache_dtype"] = "fp8"
    path = recipe.with_name("gpu-tiny-recipe-kv-fp8.yaml")
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    return path


def verify_kv_fp8_step(out: Path, hb: Path, src: Path, recipe: Path, left) -> None:
    """The dense (hybrid + DFlash drafter) and base (source) profiles with an fp8 KV cache,
    each verified before READY against the same reference as with the default KV cache."""
    fp8 = kv_fp8_recipe(recipe)
    for i, (key, profile) in enumerate((("verify_dense_kv_fp8", "dense"), ("verify_base_kv_fp8", "base"))):
        if left() < 120:
            record(out, key, {"skipped": f"no time left ({left():.0f} s)"})
            continue
        cmd = serve_command(hb, src, fp8, profile, 8300 + i, min(420, left() - 40), out / f"{key}.log",
                            hb / "drafter-dflash" if profile == "dense" else None)
        serve_verified(out, key, cmd, {}, min(480, left()))


def bench_conc_step(out: Path, hb: Path, src: Path, recipe: Path, left, streams=(1, 2, 4)) -> None:
    """``hybrid-build bench --concurrency N`` against a real vLLM server (the tiny dense
    profile, DFlash drafter): per-stream rows, the overlap, and whether the per-stream acceptance
    read from the streamed chunks matches the server's /metrics counters."""
    if left() < 180:
        record(out, "bench_conc", {"skipped": f"no time left ({left():.0f} s)"})
        return
    port = 8400
    cmd = serve_command(hb, src, recipe, "dense", port, min(420, left() - 60), out / "bench_conc_server.log",
                        hb / "drafter-dflash") + ["--no-verify"]
    t0 = now()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    ready = None
    until = now() + min(480, left() - 30)  # fixed once: left() shrinks as the wait goes on
    try:
        while ready is None and proc.poll() is None and now() < until:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            try:
                ready = json.loads("".join(lines))
            except ValueError:
                continue
        rec = {"ready_s": round(now() - t0, 1), "ready": ready is not None, "rc": proc.poll(),
               "stdout": "".join(lines)[-1500:]}
        if ready is None or "base_url" not in ready:
            if proc.poll() is not None:
                rec["stderr"] = proc.stderr.read()[-3000:]
            record(out, "bench_conc_server", rec)
            return
        record(out, "bench_conc_server", rec)
        for n in streams:
            ab_command(out, f"bench_conc_{n}", ["hybrid-build", "bench", ready["base_url"], "--concurrency", str(n),
                                                "--runs", "2", "--max-tokens", "96",
                                                # the tiny profiles have no tool-call parser: no agent
                                                "--workloads", "prose,code,counting",
                                                "--out", str(out / f"bench_conc_{n}.json")], min(150, left(10)))
    finally:
        stop_group(proc)


def trace_recipe(recipe: Path, caching: bool, tool_parser: str | None) -> Path:
    """The GPU recipe for the trace step: the dense profile with prefix caching on or off, room for
    the synthetic trace's contexts, 4 sequences at once, and a tool-call parser (vLLM
    refuses requests that carry tools without one; the tiny profiles have none). 4096 tokens: the
    demo model's max_position_embeddings."""
    import yaml

    rec = yaml.safe_load(recipe.read_text())
    prof = rec["serve"]["profiles"]["dense"]
    prof.update(enable_prefix_caching=caching, max_model_len=4096, max_num_seqs=4, tool_call_parser=tool_parser)
    path = recipe.with_name(f"gpu-tiny-recipe-trace-{'cache' if caching else 'nocache'}.yaml")
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    return path


# the demo tokenizer (454 tokens) spends ~4 tokens a word: 900 words made 3836 tokens at the last turn
TRACE_SPEC = "agent-synthetic:conversations=8,turns=8,start=300,end=800"


def trace_step(out: Path, hb: Path, src: Path, recipe: Path, left, tool_parser: str | None = None,
               streams=(1, 4)) -> None:
    """``hybrid-build bench --trace agent-synthetic`` at 1 and 4 conversations at once against the
    tiny dense profile (hybrid + DFlash drafter), with prefix caching on and off: TTFT per turn
    position, hit rate, acceptance, tool-call validity (random weights: expect few valid calls)."""
    for i, caching in enumerate((True, False)):
        key = f"trace_{'cache' if caching else 'nocache'}"
        if left() < 150:
            record(out, key + "_server", {"skipped": f"no time left ({left():.0f} s)"})
            continue
        cmd = serve_command(hb, src, trace_recipe(recipe, caching, tool_parser), "dense", 8500 + i,
                            min(360, left() - 60), out / f"{key}_server.log", hb / "drafter-dflash") + ["--no-verify"]
        t0 = now()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        lines: list[str] = []
        ready = None
        until = now() + min(420, left() - 30)
        try:
            while ready is None and proc.poll() is None and now() < until:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                try:
                    ready = json.loads("".join(lines))
                except ValueError:
                    continue
            rec = {"command": " ".join(cmd), "ready_s": round(now() - t0, 1), "ready": ready is not None,
                   "rc": proc.poll(), "stdout": "".join(lines)[-1500:]}
            if ready is None or "base_url" not in ready:
                if proc.poll() is not None:
                    rec["stderr"] = proc.stderr.read()[-3000:]
                record(out, key + "_server", rec)
                continue
            record(out, key + "_server", rec)
            for n in streams:
                ab_command(out, f"{key}_c{n}", ["hybrid-build", "bench", ready["base_url"], "--trace", TRACE_SPEC,
                                                "--concurrency", str(n), "--max-tokens", "64", "--seed", "0",
                                                "--slo", "ttft=1,tpot=50ms", "--timeout", "120",
                                                "--out", str(out / f"{key}_c{n}.json")]
                            + ([] if tool_parser else ["--no-tools"]), min(180, left(10)))
        finally:
            stop_group(proc)


def verify_step(out: Path, hb: Path, src: Path, recipe: Path, left, only: str | None = None) -> None:
    """A correct server passes (dense: the hybrid against its own reference; base: the source
    against the reference's source side), and the hybrid with the Marlin MoE scale fix switched
    off (the tiny model is one the bug hits) fails and is stopped before READY."""
    cases = (("verify_dense", "dense", {}, []),
             ("verify_base", "base", {}, []),
             ("verify_dense_without_marlin_fix", "dense", {}, ["--disable-fix", "marlin_moe_scale"]))
    for i, (key, profile, env, extra) in enumerate(cases):
        if only and key != only:
            continue
        if left() < 120:
            record(out, key, {"skipped": f"no time left ({left():.0f} s)"})
            continue
        cmd = serve_command(hb, src, recipe, profile, 8200 + i, min(420, left() - 40), out / f"{key}.log",
                            hb / "drafter-dflash" if profile == "dense" else None) + extra
        serve_verified(out, key, cmd, env, min(480, left()))


# ------------------------------------------------------------------------------ A/B servers

# the tiny artifact's four profiles side by side on one GPU (eager, 2 GiB of KV cache each)
AB_PORTS = {"dense": 8000, "dflash": 8001, "base": 8002, "mtp": 8003}


def ab_url(profile: str) -> str:
    return f"http://127.0.0.1:{AB_PORTS[profile]}/v1"


def ab_start(out: Path, hb: Path, src: Path, recipe: Path, work: Path, limit: float) -> None:
    """Start ``hybrid-build serve`` for every profile in AB_PORTS, each in its own process session:
    they outlive this call (the machine keeps them while it stays warm), so the next call benches
    and evaluates against them; ``ab_stop`` ends them. Waits until every one answers /v1/models."""
    t0 = now()
    pids: dict = {}
    for profile, port in AB_PORTS.items():
        cmd = serve_command(hb, src, recipe, profile, port, limit, work / f"serve_{profile}.log",
                            hb / "drafter-dflash" if profile in ("dense", "dflash") else None)
        with open(work / f"serve_{profile}.out", "w") as so:
            proc = subprocess.Popen(cmd, stdout=so, stderr=subprocess.STDOUT, start_new_session=True)
        pids[profile] = {"pid": proc.pid, "command": " ".join(cmd)}
    (work / "ab_servers.json").write_text(json.dumps(pids))
    res: dict = {"servers": pids}
    waiting = set(AB_PORTS)
    while waiting and now() - t0 < limit:
        for profile in sorted(waiting):
            try:
                http(ab_url(profile) + "/models", timeout=3)
                res.setdefault("ready_s", {})[profile] = round(now() - t0, 1)
                waiting.discard(profile)
            except Exception:
                try:
                    os.kill(pids[profile]["pid"], 0)
                except OSError:  # the serve command exited: its log says why
                    res.setdefault("failed", {})[profile] = (work / f"serve_{profile}.out").read_text(
                        errors="replace")[-1500:]
                    waiting.discard(profile)
        time.sleep(2)
    res["not_ready"] = sorted(waiting)
    res["wall_s"] = round(now() - t0, 1)
    record(out, "ab_start", res)


def ab_command(out: Path, key: str, cmd: list[str], limit: float) -> dict:
    """One hybrid-build command against the servers, its output kept in results.json."""
    t0 = now()
    res: dict = {"command": " ".join(cmd)}
    if limit < 30:
        res["skipped"] = f"no time left ({limit:.0f} s)"
        record(out, key, res)
        return res
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        res.update(rc=p.returncode, stdout=p.stdout[-6000:], stderr=p.stderr[-4000:])
    except subprocess.TimeoutExpired as e:  # its captured output is bytes, text=True or not
        res.update(error=f"timed out after {limit:.0f} s", stdout=(e.stdout or b"").decode(errors="replace")[-3000:])
    res["wall_s"] = round(now() - t0, 1)
    record(out, key, res)
    return res


def ab_bench(out: Path, pair: tuple[str, str], runs: int, max_tokens: int, workloads: str, limit: float) -> None:
    a, b = pair
    before = {p: spec_lines(AB_PORTS[p]) for p in pair}
    res = ab_command(out, f"bench_{a}_vs_{b}", ["hybrid-build", "bench", ab_url(a), ab_url(b), "--runs", str(runs),
                                                 "--max-tokens", str(max_tokens), "--workloads", workloads, "--out",
                                                 str(out / f"bench_{a}_vs_{b}.json")], limit)
    res["spec_metrics_before"] = before
    res["spec_metrics_after"] = {p: spec_lines(AB_PORTS[p]) for p in pair}
    record(out, f"bench_{a}_vs_{b}", res)


def ab_stop(out: Path, work: Path) -> None:
    res: dict = {}
    state = work / "ab_servers.json"
    pids = json.loads(state.read_text()) if state.exists() else {}
    for profile, info in pids.items():
        try:
            os.killpg(info["pid"], signal.SIGINT)  # serve stops its vLLM server on Ctrl-C
        except OSError as e:
            res[profile] = f"not running: {e}"
    deadline = now() + 30
    for profile, info in pids.items():
        while now() < deadline:
            try:
                os.kill(info["pid"], 0)
                time.sleep(1)
            except OSError:
                break
        else:
            try:
                os.killpg(info["pid"], signal.SIGKILL)
            except OSError:
                pass
        log = work / f"serve_{profile}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        res[f"{profile}_log"] = [ln[-300:] for ln in text.splitlines()
                                 if re.search(r"hybrid-build|peculative|DFlash|dflash|MTP|Error|error|"
                                              r"quantiz|Fp8|FP8|Accept|accept|Marlin", ln)][-30:]
        so = work / f"serve_{profile}.out"
        res[f"{profile}_serve_stdout"] = so.read_text(errors="replace")[-1500:] if so.exists() else ""
    state.unlink(missing_ok=True)
    record(out, "ab_stop", res)


# ------------------------------------------------------------------------------ main


LEASE_STEPS = ("up", "wait", "warm_ttft", "accept", "agent_trace", "kill", "rewait", "down", "cachefault")


def lease(a, steps: list[str], left, recipe: Path) -> None:
    """The lease's steps in the order given (lease_steps.py); those that need the server skip
    (recorded) while it is not READY."""
    import agent_steps
    import lease_steps as ls

    def ready() -> bool:
        st = ls._state(a.work)
        return bool(st and st.get("base_url") and "killed_at" not in st)

    for s in steps:
        needs = s in ("warm_ttft", "accept", "agent_trace", "kill")
        if needs and not ready():
            record(a.out, s, {"skipped": "no READY server"})
            continue
        try:
            if s == "up":
                ls.up(a.agent_cases[0], a.floor, a.work, a.out, record, a.graphs, a.agent_kv_bytes, a.contexts,
                      left(30))
            elif s == "wait":
                ls.wait(a.work, a.out, record, left(30))
            elif s == "warm_ttft":
                record(a.out, "ttft", agent_steps.ttft(ls.PORT, a.contexts, a.ttft_runs, phases=True))
            elif s == "accept":
                record(a.out, "accept", ls.accept(ls.PORT))
            elif s == "agent_trace":
                ls.trace(ls._state(a.work)["base_url"], a.out, record, left)
            elif s == "kill":
                ls.kill(a.work, a.out, record, left(20))
            elif s == "rewait":
                ls.rewait(a.work, a.out, record, left(20))
            elif s == "down":
                ls.down(a.work, a.out, record)
            elif s == "cachefault":
                ls.cache_fault(a.out, a.hb, a.src, recipe, record, left, serve_command, serve_verified)
        except Exception as e:  # one step's failure leaves the rest of the call running
            record(a.out, f"{s}_error", f"{type(e).__name__}: {e}")


def build_parser():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--hb", type=Path, required=True, help="folder with inc/, ct/, ref.pt, drafter-dflash/")
    ap.add_argument("--src", type=Path, required=True, help="the tiny source checkpoint")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="unix time by which everything must end")
    ap.add_argument("--steps", default="build,correct,profiles,graphs,eager",
                    help="build: the synthetic checkpoint; graphs/eager/compiled: its decode speed in that mode")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="engines per speed variant, interleaved")
    ap.add_argument("--floor", type=Path, help="the config-only checkpoints of floor_configs.py (.gpufloor)")
    ap.add_argument("--round0", type=int, default=0, help="first floor round's number (a later call goes on)")
    ap.add_argument("--conc-streams", default="1,2,4", help="conc step: the concurrent stream counts")
    ap.add_argument("--mix", default="L24,L24h,L24e,L12", help="compositions the mix step times (base)")
    ap.add_argument("--bench-pairs", default="dflash:dense,base:mtp", help="A:B profile pairs the bench step runs")
    ap.add_argument("--bench-runs", type=int, default=5)
    ap.add_argument("--bench-workloads", default="prose,code,counting",
                    help="agent needs a server with a tool-call parser, which the tiny recipe's profiles lack")
    ap.add_argument("--bench-max-tokens", type=int, default=128)
    ap.add_argument("--eval-tasks", default="hybrid_build,hybrid_build_gen")
    ap.add_argument("--trace-tool-parser", default="",
                    help="trace: the dense profile's tool-call parser (default none, and the replay sends no tools "
                         "(--no-tools): the demo tokenizer has no <tool_call> token; qwen3_xml to try one)")
    import agent_steps  # the real drafter's shape (starts / ttft / tools)

    ap.add_argument("--agent-cases", type=agent_steps.parse_cases, default="dense:full6:on,dense:mixed:on",
                    help="starts: PROFILE:SHAPE:CACHING,... (dense|dflash : mixed|full6 : on|off), or all")
    ap.add_argument("--contexts", type=agent_steps.parse_contexts, default="8192,32768,65536",
                    help="ttft: prefix lengths in tokens")
    ap.add_argument("--ttft-runs", type=int, default=3, help="ttft: cold/warm pairs per context (median)")
    ap.add_argument("--graphs", action="store_true",
                    help="up: the profiles' own mode (torch.compile and CUDA graphs), not --enforce-eager")
    ap.add_argument("--agent-kv-bytes", type=int, default=32 << 30,
                    help="starts: the KV cache's bytes (--kv-cache-memory-bytes); 0: the profile's "
                         "gpu_memory_utilization sizes it, the pool `plan` predicts")
    return ap


def main(argv: list[str] | None = None) -> int:
    import agent_steps

    a = build_parser().parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    steps = a.steps.split(",")
    left = lambda margin=15: a.deadline - now() - margin  # noqa: E731
    RESULTS["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        import torch
        import vllm

        RESULTS["env"] = {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    except Exception as e:
        RESULTS["env"] = {"error": str(e)}
    RESULTS["env_vars"] = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HYBRID_BUILD_"))}
    save(a.out)
    builder = None
    if "build" in steps and not (a.work / "synth-hybrid" / "model.safetensors.index.json").exists():
        builder = threading.Thread(target=build_synthetic, args=(a.work, a.out, a.layers, a.src), daemon=True)
        builder.start()
    inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    recipe = gpu_recipe(a.hb / "inc", a.work)
    profiles = [p for p in ("dense", "base", "mtp") if "profiles" in steps]

    def lane_tiny() -> None:  # the tiny checkpoints: correctness, then the serve profiles
        if "correct" in steps:
            # the source too: vLLM(artifact) vs vLLM(source) separates the conversion from any
            # difference between vLLM's model code and the transformers reference
            # and the source with its BF16 head quantized to int8 rows at load (the `serve` option
            # for a checkpoint without a stored int8 head), against the source's reference
            at_load = {"HYBRID_BUILD_LM_HEAD": "quantize-at-load"}
            for label, folder, ref_label, env in (("inc-hybrid", a.hb / "inc", "inc-hybrid", {}),
                                                  ("compressed-tensors", a.hb / "ct", "compressed-tensors", {}),
                                                  ("source", a.src, "source", {}),
                                                  ("source-head-at-load", a.src, "source", at_load)):
                # the first engine JIT-compiles the Triton kernels (and DeepGEMM's): the longer limit
                run_child(a.out, f"correct_{label}", ["correct", str(folder), str(a.hb / "ref.pt"), label,
                                                      str(a.work / f"rows-{label}.pt"), ref_label],
                          min(420 if label == "inc-hybrid" else 200, left()), dict(inproc, **env))
            record(a.out, "correct_vs_vllm_source", engine_agreement(a.work))
        for i, p in enumerate(profiles):
            serve_profile(a.out, a.hb, a.src, recipe, p, 8100 + i, min(150, left()),
                          a.hb / "drafter-dflash" if p == "dense" else None)

    def speed(mode: str) -> None:
        triton_head = {"HYBRID_BUILD_INT8_HEAD_KERNEL": "triton"}
        variants = (("base", "synth-src", {}), ("dense", "synth-hybrid", {}),
                    ("dense-triton-head", "synth-hybrid", triton_head))
        if mode == "compiled":  # each engine compiles for minutes: base against the default dense only
            variants = variants[:2]
        runs: dict[str, list[float]] = {}
        for r in range(a.repeat):  # engines interleaved (base, dense, ..., base, dense, ...): drift hits all
            for label, folder, env in variants:
                key = f"speed_{mode}_{label}" + (f"_r{r + 1}" if a.repeat > 1 else "")
                res = run_child(a.out, key, ["speed", str(a.work / folder), label, mode, str(a.tokens)],
                                min(330 if mode == "compiled" else 240, left()), dict(inproc, **env))
                if res.get("decode_tok_s"):
                    runs.setdefault(label, []).append(res["decode_tok_s"])
        b = statistics.median(runs["base"]) if runs.get("base") else None
        for label, _, _ in variants[1:]:
            if b and runs.get(label):
                d = statistics.median(runs[label])
                record(a.out, f"speed_{mode}_ratio_{label}", {f"{label}_over_base": round(d / b, 4),
                                                              "engines": len(runs[label])})

    def lane_speed() -> None:  # the real-width synthetic model, beside the tiny lane (fixed KV sizes)
        built = False
        if builder is not None:
            builder.join(max(0, left(60)))
            built = RESULTS["steps"].get("synthetic_build", {}).get("run_rc") == 0
        elif (a.work / "synth-hybrid" / "model.safetensors.index.json").exists():
            built = True  # a later call on the same warm machine
        for mode in ("graphs", "eager", "compiled"):
            if built and mode in steps:
                speed(mode)

    def floor_child(key: str, folder: str, label: str, mode: str = "graphs", tokens: int = 128, profile: int = 8,
                    env: dict | None = None, limit: float = 240, needs: float = 100) -> dict:
        if left() < needs:  # an engine cut off half way tells nothing
            res = {"skipped": f"no time left ({left():.0f} s)"}
            record(a.out, key, res)
            return res
        return run_child(a.out, key, ["floor", str(a.floor / folder), label, mode, str(tokens), str(profile)],
                         min(limit, left()), dict(inproc, HB_TRACE_DIR=str(a.work), **(env or {})))

    triton_head = {"HYBRID_BUILD_INT8_HEAD_KERNEL": "triton"}

    def lane_warm() -> None:  # every kernel of the real widths compiled once (Triton, DeepGEMM's JIT)
        if "warm" in steps:
            floor_child("warm_L4_dense-triton-head", "L4-dense", "dense-triton-head", profile=0, env=triton_head,
                        limit=480)

    def lane_vcompare() -> None:  # beside the warm-up (compiles on the CPUs overlap)
        if "vcompare" not in steps:
            return
        texts = json.loads((a.floor / "texts.json").read_text())
        built: dict = {}
        b35 = threading.Thread(target=lambda: built.update(build_35b(a.work, a.src)), daemon=True)
        b35.start()
        vcompare(a.out, "vcompare_tiny", a.src, a.hb / "inc", texts, a.work, min(600, left()))
        b35.join(max(0, left(120)))
        record(a.out, "build_35b", built or {"error": "not finished"})
        if built.get("hybrid_bytes"):
            vcompare(a.out, "vcompare_35b", Path(built["source"]), Path(built["hybrid"]), texts, a.work,
                     min(600, left()))

    mixed: list = []

    def mix() -> None:
        if "mix" in steps and not mixed:
            mixed.append(1)
            for name in a.mix.split(","):
                floor_child(f"mix_{name}_base", f"{name}-base", "base")

    def lane_floor() -> None:  # alone on the GPU: the timings
        variants = (("base", "L48-base", {}), ("dense", "L48-dense", {}),
                    ("dense-triton-head", "L48-dense", triton_head))
        rounds = list(range(a.round0, a.round0 + a.repeat)) if "floor" in steps else []
        for i, r in enumerate(rounds):  # the mix after the first round: the fit needs it more than round 2
            if i == 1 or (a.round0 > 0 and i == 0):
                mix()
            for label, folder, env in variants:
                floor_child(f"floor_L48_{label}_r{r + 1}", folder, label, env=env)
        mix()
        if "eagerprof" in steps:
            for label, folder in (("base", "L48-base"), ("dense", "L48-dense")):
                floor_child(f"eagerprof_L48_{label}", folder, label, mode="eager", tokens=8, profile=4, limit=300)
        if "conc" in steps:  # 1, 2 and 4 concurrent streams at full depth, one engine each
            for label, folder, env in (("base", "L48-base", {}), ("dense", "L48-dense", {}),
                                       ("dense-triton-head", "L48-dense", triton_head)):
                if left() < 100:
                    record(a.out, f"conc_L48_{label}", {"skipped": f"no time left ({left():.0f} s)"})
                    continue
                run_child(a.out, f"conc_L48_{label}", ["conc", str(a.floor / folder), label, "128", a.conc_streams],
                          min(300, left()), dict(inproc, **env))
        # two kernel sequences come back (the files from $OUT are few): 48-layer base and dense, graphs
        for label in ("base", "dense"):
            for seq in sorted(a.work.glob(f"kseq-{label}-graphs-L48-*.json.gz"))[:1]:
                if not (a.out / seq.name).exists():
                    shutil.copy(seq, a.out / seq.name)

    if any(s in LEASE_STEPS for s in steps):  # one server kept up across calls (lease_steps.py)
        other = [s for s in steps if s not in LEASE_STEPS]
        if other:  # never a step skipped without a word
            print(f"driver: {', '.join(other)}: not a lease step (those are {', '.join(LEASE_STEPS)}); run them in a "
                  "call of their own", file=sys.stderr)
            return 2
        lease(a, steps, left, recipe)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    agent = [s for s in steps if s in ("starts", "ttft", "tools")]
    if agent:  # each case served by hybrid-build serve at full depth (agent_steps.py)
        agent_steps.run(agent, record, a.out, a.floor, a.work, a.agent_cases, a.contexts, a.ttft_runs, left,
                        a.agent_kv_bytes)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    multinode = [s for s in steps if s in ("nccl_lo", "tp2", "tp1", "pp2", "tp2s", "tp2mp")]
    if multinode:  # on a machine with two GPUs (multinode_steps.py)
        import multinode_steps

        multinode_steps.run(multinode, record, http, a.out, a.hb, a.src, recipe, a.work, left)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    if "bench_conc" in steps:  # bench --concurrency against real vLLM
        bench_conc_step(a.out, a.hb, a.src, recipe, left)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    if "trace" in steps:  # bench --trace agent-synthetic at 1 and 4 at once, prefix caching on and off
        trace_step(a.out, a.hb, a.src, recipe, left, a.trace_tool_parser or None)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    if "verify_kv_fp8" in steps:  # the fp8 KV cache, verified against the artifact's reference
        verify_kv_fp8_step(a.out, a.hb, a.src, recipe, left)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    if "integrity" in steps:  # serve refuses a changed artifact before vLLM starts; the check's time
        integrity_step(a.out, a.hb, a.src, recipe, a.work, left)
        save(a.out)
        if steps == ["integrity"]:
            return 0
    if "restart" in steps:  # the engine core killed under load: serve --restart's fault, memory, verify, READY
        from restart_step import restart_step

        restart_step(a.out, a.hb, a.src, recipe, min(420, left()), record, "dense", a.hb / "drafter-dflash")
    if "verify" in steps or "verify_broken" in steps:  # verify before READY against real vLLM
        verify_step(a.out, a.hb, a.src, recipe, left, None if "verify" in steps else "verify_dense_without_marlin_fix")
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    if any(s.startswith("ab_") for s in steps):  # the tiny artifact behind four servers
        if "ab_start" in steps:
            ab_start(a.out, a.hb, a.src, recipe, a.work, min(240, left(30)))
        if "ab_eval" in steps:  # source (base profile) against the hybrid (dense profile)
            ab_command(a.out, "eval", ["hybrid-build", "eval", str(a.hb / "inc"), "--source-url", ab_url("base"),
                                       "--hybrid-url", ab_url("dense"), "--tasks", a.eval_tasks,
                                       "--out", str(a.out / "eval.json"),
                                       "--samples", str(a.out / "eval_samples.jsonl")],
                       min(300, left(140)))
        if "ab_bench" in steps:
            for pair in a.bench_pairs.split(","):
                ab_bench(a.out, tuple(pair.split(":")), a.bench_runs, a.bench_max_tokens, a.bench_workloads,
                         min(150, left(10)))
        if "ab_stop" in steps:
            ab_stop(a.out, a.work)
        RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(a.out)
        return 0
    if a.floor is not None:
        if a.floor.exists():
            RESULTS["floor_plan"] = json.loads((a.floor / "floor_plan.json").read_text())
        lanes = [threading.Thread(target=f) for f in (lane_warm, lane_vcompare)]
        for t in lanes:
            t.start()
        for t in lanes:
            t.join()
        lane_floor()
        lanes = []
    else:
        lanes = [threading.Thread(target=f) for f in (lane_tiny, lane_speed)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save(a.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "texts":  # here: the bundled texts as token ids (tiny tokenizer)
        from transformers import AutoTokenizer

        from hybrid_build.validate.transformers_forward import MAX_TOKENS_PER_TEXT, bundled_texts

        tok = AutoTokenizer.from_pretrained(sys.argv[2])
        ids = {n: tok(t)["input_ids"][:MAX_TOKENS_PER_TEXT] for n, t in bundled_texts().items()}
        Path(sys.argv[3]).write_text(json.dumps(ids) + "\n")
        print({n: len(v) for n, v in ids.items()})
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "build35":  # here: the same 35B-width pair, for the CPU figures
        print(json.dumps(build_35b(Path(sys.argv[2]), Path(sys.argv[3])), indent=1))
        sys.exit(0)
    sys.exit(main())
