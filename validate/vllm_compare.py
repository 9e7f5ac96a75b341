"""``validate --engine vllm``: the end-to-end divergence figures from vLLM serving both models.

The source and then the hybrid run in vLLM one after the other, each in a child process of its
own (``python -m hybrid_build.validate.vllm_compare --child ...``) so that the GPU memory of the
first is returned before the second loads. Both run with the hybrid-build plugin registered (the
environment has ``VLLM_PLUGINS=hybrid_build`` and the child calls ``register()`` itself), as
``hybrid-build serve`` runs them: the hybrid's FP8 shared experts and int8 head are served
quantized, and the fixes of ``serve.upstream_fixes`` apply to both (they touch the routed experts,
which the two share).

What a child computes, exactly and with bounded memory: vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and eager; a forward hook on the language model's final norm
records its output while the engine prefills one text (teacher-forced, ``max_tokens=1``, prefix
caching off, one sequence at a time); then ``LLM.apply_model`` feeds those hidden states, a block
of positions at a time, to the model's own ``compute_logits`` (its lm-head through whatever quant
method vLLM chose, vocabulary padding removed) on the GPU. The logits are saved per text as a
tensor in the dtype vLLM produced them, ``[tokens, vocab]``; nothing goes through Python dicts of
log-probabilities, so a 248,320-token vocabulary costs ``tokens x vocab x 2`` bytes on disk per
text and model. The parent then reads both models' logits a block of positions at a time (memory
mapped) and folds them, a vocabulary chunk at a time, into ``divergence.DivergenceAccumulator``:
position t is scored on predicting token t + 1, the reference is the source.

``compare_in_vllm`` returns ``divergence.divergence_report(per_text)`` - ``{"overall", "texts"}``
as ``streamed.compare_streamed(...).report`` has them - plus a ``"vllm"`` entry saying what ran.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from hybrid_build.core.errors import CannotRun, ExternalToolError, UserError

from .divergence import BOOTSTRAP_RESAMPLES, DivergenceAccumulator, PositionStats, divergence_report

log = logging.getLogger(__name__)

PROGRESS_MARK = "@@hybrid-build-progress "  # a child's stdout line that advances the parent's bar
CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the child's own process: hooks reach the model
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model takes a function
    "VLLM_PLUGINS": "hybrid_build",  # the plugin, as `hybrid-build serve` loads it
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
HEAD_BLOCK = 256  # positions through the lm-head at a time in the child
POSITION_BLOCK = 512  # positions folded at a time in the parent
VOCAB_CHUNK = 8192  # vocabulary columns folded at a time
CHILD_TIMEOUT_S = 3600.0
LOG_TAIL_LINES = 40


# ------------------------------------------------------------------------------ parent


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise CannotRun("vLLM is not installed in this Python environment; install vllm (a version with "
                                "Qwen3.5-MoE, e.g. 0.25.1) to validate with --engine vllm")


def _require_gpu() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise CannotRun("validate --engine vllm needs torch with CUDA, and torch is not installed") from None
    if not torch.cuda.is_available():
        raise CannotRun("validate --engine vllm needs a CUDA GPU, and torch sees none on this machine")


def _vocab_size(folder: Path) -> int | None:
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    tc = cfg.get("text_config") or cfg
    return tc.get("vocab_size")


def _check_token_ids(token_ids: Mapping[str, Sequence[int]], vocab: int | None) -> dict[str, list[int]]:
    if not token_ids:
        raise UserError("no texts to run: give at least one text")
    out = {}
    for name, ids in token_ids.items():
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if len(ids) < 2:
            raise UserError(f"text {name!r} has {len(ids)} token(s): the comparison needs at least 2 per text "
                            f"(position t is scored on token t + 1)")
        if min(ids) < 0 or (vocab is not None and max(ids) >= vocab):
            raise UserError(f"text {name!r} has token ids outside the model's vocabulary of {vocab}")
        out[str(name)] = ids
    return out


def _run_child(label: str, model: Path, request: Path, out: Path, timeout_s: float, bar) -> dict:
    """One model in ``python -m hybrid_build.validate.vllm_compare --child``; its ``result.json``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hybrid_build.validate.vllm_compare", "--child", "--model", str(model),
           "--request", str(request), "--out", str(out), "--label", label]
    env = dict(os.environ, **CHILD_ENV)
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, errors="replace")
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.daemon = True
    timer.start()
    try:
        with open(out / "child.log", "w") as logf:
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith(PROGRESS_MARK):
                    bar.update(1)
                    log.debug("vllm %s: %s", label, line[len(PROGRESS_MARK):].strip())
                    continue
                logf.write(line)
                tail.append(line.rstrip())
        rc = proc.wait()
    except BaseException:
        kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
    result_file = out / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    if timed_out.is_set():
        raise ExternalToolError(f"vLLM did not finish the {label} ({model.name}) within {timeout_s:.0f} s")
    if not result.get("ok"):
        cause = result.get("error") or next((ln for ln in reversed(tail) if ln.strip()), f"exit code {rc}")
        raise ExternalToolError(f"vLLM could not run the {label} ({model.name}): {cause}")
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


def _load_logits(path: Path):
    import torch

    try:
        return torch.load(path, mmap=True, weights_only=True)
    except (RuntimeError, ValueError):  # not a zip-format file (mmap needs one): a plain load
        return torch.load(path, weights_only=True)


def fold_saved_logits(source_dir: Path, hybrid_dir: Path, token_ids: Mapping[str, Sequence[int]],
                      files: Mapping[str, str], *, position_block: int = POSITION_BLOCK,
                      vocab_chunk: int = VOCAB_CHUNK) -> dict[str, PositionStats]:
    """Per-text statistics from the logits both children saved (``files``: text name -> file name
    in each folder, ``[tokens, vocab]``). Position t is scored on token t + 1; the source is the
    reference. Reads ``position_block`` rows of each at a time."""
    import torch

    per_text = {}
    for name, ids in token_ids.items():
        ref_all, test_all = _load_logits(source_dir / files[name]), _load_logits(hybrid_dir / files[name])
        n = len(ids)
        if ref_all.shape != test_all.shape or ref_all.dim() != 2 or ref_all.shape[0] != n:
            raise ExternalToolError(f"vLLM returned logits of shape {tuple(ref_all.shape)} (source) and "
                                    f"{tuple(test_all.shape)} (hybrid) for text {name!r} of {n} tokens")
        targets = torch.as_tensor(list(ids)[1:], dtype=torch.long)
        parts = []
        for lo in range(0, n - 1, position_block):
            hi = min(n - 1, lo + position_block)
            acc = DivergenceAccumulator(targets[lo:hi])
            ref, test = ref_all[lo:hi], test_all[lo:hi]
            for v0 in range(0, ref.shape[1], vocab_chunk):
                acc.update(v0, ref[:, v0:v0 + vocab_chunk], test[:, v0:v0 + vocab_chunk])
            parts.append(acc.result())
        per_text[name] = PositionStats.cat(parts)
        del ref_all, test_all
    return per_text


def compare_in_vllm(source: Path, artifact: Path, token_ids: dict[str, list[int]], *,
                    gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, progress=None,
                    kv_cache_memory_bytes: int | None = None, timeout_s: float = CHILD_TIMEOUT_S,
                    work_dir: Path | None = None, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict:
    """Teacher-forced source vs hybrid under vLLM: ``{"overall": {...}, "texts": {...}}`` from
    ``divergence.divergence_report`` (reference = source), plus ``"vllm"``: what ran.

    ``token_ids``: text name -> token ids (at least 2 each). ``max_model_len`` defaults to the
    longest text plus a little. ``kv_cache_memory_bytes`` fixes the KV size (vLLM then skips its
    memory profiling, which other processes on the same GPU can upset). ``progress`` is a
    ``pipeline.progress`` factory (``progress(total=, desc=, unit=)`` -> a bar). ``work_dir``
    keeps the children's logs and logits there instead of in a temporary folder."""
    from hybrid_build.core.progress import close_bar, null_progress

    source, artifact = Path(source), Path(artifact)
    for label, folder in (("source", source), ("artifact", artifact)):
        if not (folder / "config.json").is_file():
            raise UserError(f"{folder}: the {label} is not a checkpoint folder (no config.json)")
    ids = _check_token_ids(token_ids, _vocab_size(source))
    longest = max(len(v) for v in ids.values())
    if max_model_len is None:
        max_model_len = -(-(longest + 16) // 16) * 16
    elif max_model_len < longest + 1:
        raise UserError(f"max_model_len {max_model_len} is shorter than the longest text ({longest} tokens) + 1")
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    _require_vllm()
    _require_gpu()
    names = list(ids)
    files = {n: f"logits-{i}.pt" for i, n in enumerate(names)}
    bar = (progress or null_progress)(total=2 * (2 + len(names)) + len(names), desc="vLLM end-to-end", unit="step")
    tmp = None
    try:
        if work_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="hybrid-build-vllm-")
            work = Path(tmp.name)
        else:
            work = Path(work_dir)
            work.mkdir(parents=True, exist_ok=True)
        request = work / "request.json"
        request.write_text(json.dumps({"texts": [{"name": n, "ids": ids[n], "file": files[n]} for n in names],
                                       "gpu_memory_utilization": gpu_memory_utilization,
                                       "max_model_len": max_model_len,
                                       "kv_cache_memory_bytes": kv_cache_memory_bytes}))
        runs = {}
        for label, folder in (("source", source), ("hybrid", artifact)):
            runs[label] = _run_child(label, folder, request, work / label, timeout_s, bar)
        vocabs = {label: r.get("vocab") for label, r in runs.items()}
        if vocabs["source"] != vocabs["hybrid"]:
            raise ExternalToolError(f"the source's vLLM logits have {vocabs['source']} columns and the hybrid's "
                                    f"{vocabs['hybrid']}: they are not the same model")
        per_text = fold_saved_logits(work / "source", work / "hybrid", ids, files)
        bar.update(len(names))
    finally:
        close_bar(bar)
        if tmp is not None:
            tmp.cleanup()
    report = divergence_report(per_text, resamples, seed)
    report["vllm"] = {label: {k: r.get(k) for k in ("vllm_version", "dtype", "load_seconds", "seconds", "lm_head",
                                                      "fp8_linear_layers", "marlin_moe_scale_fix")}
                      for label, r in runs.items()}
    log.info("vLLM comparison: mean KL %.3g, same top-1 %.4f over %d positions", report["overall"]["mean_kl"],
             report["overall"]["same_top1"], report["overall"]["tokens"])
    return report


# ------------------------------------------------------------------------------ child


def _final_norm(model):
    """The language model's final norm (its output is what the lm-head reads)."""
    found = [(name, m) for name, m in model.named_modules()
             if (name == "norm" or name.endswith("model.norm")) and "visual" not in name and "mtp" not in name]
    if len(found) != 1:
        raise RuntimeError(f"expected one final norm in {type(model).__name__}, found "
                           f"{[n for n, _ in found] or 'none'}")
    return found[0]


def _install(model) -> str:
    """A forward hook on the final norm that keeps its outputs (on the model: apply_model may
    run the function in another frame)."""
    name, norm = _final_norm(model)
    store: list = []

    def hook(_module, _args, out):
        h = out[0] if isinstance(out, (tuple, list)) else out
        store.append(h.detach().clone())

    model._hybrid_build_hidden = store
    model._hybrid_build_hook = norm.register_forward_hook(hook)
    return name


def _clear(model) -> int:
    model._hybrid_build_hidden.clear()
    return 0


def _save_logits(path: str, rows: int):
    """The model's own logits for the hidden states the hook kept, saved to ``path``."""
    def run(model):
        import torch

        hs = model._hybrid_build_hidden
        h = torch.cat(hs) if hs else None
        if h is None or h.shape[0] != rows:
            raise RuntimeError(f"the final norm saw {0 if h is None else h.shape[0]} positions for a text of "
                               f"{rows} tokens ({len(hs)} forward calls)")
        with torch.inference_mode():
            blocks = [model.compute_logits(h[lo:lo + HEAD_BLOCK]).cpu() for lo in range(0, rows, HEAD_BLOCK)]
        logits = torch.cat(blocks).contiguous()
        torch.save(logits, path)
        hs.clear()
        return {"shape": list(logits.shape), "dtype": str(logits.dtype).replace("torch.", "")}
    return run


def _describe(model) -> dict:
    """The lm-head's quant method and the layers vLLM serves as block FP8."""
    head = [m for n, m in model.named_modules() if n.endswith("lm_head") and "mtp" not in n]
    methods = {}
    fp8 = 0
    for _n, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        classes = (type(qm).__name__, type(getattr(qm, "scheme", None)).__name__,
                   type(getattr(m, "scheme", None)).__name__)
        fp8 += any("Fp8" in c for c in classes)
    if head:
        qm = getattr(head[0], "quant_method", None)
        methods = {"layer": type(head[0]).__name__, "quant_method": type(qm).__name__ if qm is not None else None}
    return {"lm_head": methods, "fp8_linear_layers": fp8}


def _first(x):
    return x[0] if isinstance(x, list) else x


def _progress(what: str) -> None:
    print(PROGRESS_MARK + what, flush=True)


def _engine_kwargs(model: str, req: dict) -> dict:
    kw = dict(model=model, enforce_eager=True, max_model_len=req["max_model_len"],
              gpu_memory_utilization=req["gpu_memory_utilization"], max_num_seqs=1, enable_prefix_caching=False,
              seed=0, limit_mm_per_prompt={"image": 0, "video": 0})
    if req.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = int(req["kv_cache_memory_bytes"])
    try:  # the Triton GDN prefill: FlashInfer's is an optional extra that may be missing
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        if "gdn_prefill_backend" in {f.name for f in dataclasses.fields(EngineArgs)}:
            kw["gdn_prefill_backend"] = os.environ.get("HYBRID_BUILD_GDN_PREFILL_BACKEND", "triton")
    except (ImportError, TypeError):
        pass
    return kw


def _register_plugin() -> None:
    """Call the hybrid-build vLLM plugin through its installed entry point, the way vLLM loads
    plugins (validate sits below serve and does not import it)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="vllm.general_plugins"):
        if ep.name == "hybrid_build":
            ep.load()()


def child_main(model: str, request: str, out: str, label: str) -> int:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"ok": False, "label": label, "model": model}
    try:
        for k, v in CHILD_ENV.items():
            os.environ.setdefault(k, v)
        req = json.loads(Path(request).read_text())
        _register_plugin()  # vLLM does this too; in-process it must be there before LLM()
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        result["vllm_version"] = getattr(vllm, "__version__", "?")
        t0 = time.monotonic()
        llm = LLM(**_engine_kwargs(model, req))
        result["load_seconds"] = round(time.monotonic() - t0, 1)
        _progress(f"{label}: engine ready")
        result.update(_first(llm.apply_model(_describe)))
        result["final_norm"] = _first(llm.apply_model(_install))
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        texts = []
        for t in req["texts"]:
            _first(llm.apply_model(_clear))
            llm.generate([TokensPrompt(prompt_token_ids=t["ids"])], params, use_tqdm=False)
            saved = _first(llm.apply_model(_save_logits(str(out_dir / t["file"]), len(t["ids"]))))
            texts.append({"name": t["name"], **saved})
            _progress(f"{label}: {t['name']}")
        result["texts"] = texts
        result["vocab"] = texts[0]["shape"][1]
        result["dtype"] = texts[0]["dtype"]
        try:
            from vllm.model_executor.layers.fused_moe.oracle import int_wna16

            fix = int_wna16.marlin_moe_permute_scales
            result["marlin_moe_scale_fix"] = {"installed": getattr(fix, "hybrid_build_fix", False),
                                              "changed_a_layout": getattr(fix, "fired", False)}
        except (ImportError, AttributeError):
            result["marlin_moe_scale_fix"] = None
        result["ok"] = True
        _progress(f"{label}: done")
    except BaseException as e:  # noqa: BLE001 - every failure becomes one sentence for the parent
        traceback.print_exc()
        msg = " ".join(str(e).split())[:600] or "no message"
        result["error"] = f"{type(e).__name__}: {msg}"
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    # vLLM's in-process engine leaves threads behind; the parent only needs result.json
    os._exit(0 if result["ok"] else 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_build.validate.vllm_compare",
                                 description="the child of compare_in_vllm: one model under vLLM, logits per text")
    ap.add_argument("--child", action="store_true", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--request", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="model")
    a = ap.parse_args(argv)
    return child_main(a.model, a.request, a.out, a.label)


if __name__ == "__main__":
    sys.exit(main())
