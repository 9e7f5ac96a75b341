"""The end-to-end check: the whole model, source against hybrid, teacher-forced on texts.

Three engines compute the same figures (the statistics of ``divergence``: mean, median, p99 and
p99.9 KL, same-top-1, RMS of the probability difference, perplexity of both, bootstrap intervals;
per text and overall):

- ``streamed`` (default): ``streamed.compare_streamed``, one decoder layer in memory at a time,
  on the GPU if torch sees one, else the CPU; it runs at the real model's size on an ordinary
  machine, and its final-norm hidden states feed the lm-head check.
- ``vllm``: ``vllm_compare.compare_in_vllm``, the source and the hybrid served by vLLM one after
  the other (a GPU and vLLM needed).
- ``transformers``: the reference implementation in a child process (``e2e``); the whole model
  must fit in RAM.

Texts are the bundled ones (prose, code, tool calls) or the user's (``--texts FILE``: a ``.txt``
file is one text, a ``.jsonl`` file one ``{"name", "text"}`` object a line).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from hybrid_build.core.bounded_read import parse_json
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import CannotRun, HybridBuildError, UserError
from hybrid_build.core.user_paths import read_text_file

from .transformers_forward import MAX_TOKENS_PER_TEXT, bundled_texts

log = logging.getLogger(__name__)

ENGINES = ("streamed", "vllm", "transformers")


def load_texts(files: list[Path] | None) -> dict[str, str]:
    """The bundled texts, or the user's: name -> text."""
    if not files:
        return bundled_texts()
    texts: dict[str, str] = {}
    for path in files:
        path = Path(path)
        text = read_text_file(path, "texts file")  # binary data, a FIFO or a folder: one line
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    item = parse_json(line, f"{path}:{n}", error=UserError)
                    texts[str(item["name"])] = str(item["text"])
                except (KeyError, TypeError):
                    raise UserError(f"{path}:{n}: expected a JSON object with \"name\" and \"text\"") from None
        else:
            texts[path.stem] = text
    return texts


def tokenize(source: Checkpoint, texts: dict[str, str], max_tokens: int = MAX_TOKENS_PER_TEXT) -> dict[str, list[int]]:
    """Token ids per text with the source's own tokenizer; a text under 2 tokens is one clear
    error (the same sentence the transformers child writes)."""
    import torch
    from transformers import AutoTokenizer

    from .transformers_forward import _tokenize, _Unavailable

    try:
        ids = _tokenize(str(source.root), texts, max_tokens, AutoTokenizer, torch)
    except _Unavailable as e:
        raise UserError(str(e)) from None
    return {name: t.tolist() for name, t in zip(texts, ids)}


def figures(report: dict) -> dict:
    """The report's end-to-end figures from ``divergence_report``: its statistics under the names
    the thresholds and the report use (``kl`` is the mean KL, ``ppl_change`` the ratio - 1)."""
    def one(s: dict) -> dict:
        return {"tokens": s["tokens"], "kl": s["mean_kl"], "kl_median": s["median_kl"], "kl_p99": s["p99_kl"],
                "kl_p999": s["p999_kl"], "kl_max": s["max_kl"], "kl_ci95": s["mean_kl_ci95"],
                "top1_agreement": s["same_top1"], "top1_ci95": s["same_top1_ci95"], "rms_delta_p": s["rms_delta_p"],
                "rms_delta_p_top": s["rms_delta_p_top"], "ppl_source": s["ppl_ref"], "ppl_hybrid": s["ppl_test"],
                "ppl_change": s["ppl_ratio"] - 1.0}

    return {**one(report["overall"]), "texts": {n: one(s) for n, s in report["texts"].items()}}


def estimate_seconds(source: Checkpoint) -> tuple[float, str]:
    """How long the streamed forward will take here, and what the estimate rests on: it is
    dominated by dequantizing the INT4 matrices (each once, shared by both passes), so one of them
    is timed on this machine and multiplied by their count."""
    import torch

    from hybrid_build.calibration.gptq import dequantize_gptq
    from hybrid_build.core.weights import read_tensor

    from .streamed import default_device

    modules = sorted({t.name.rsplit(".", 1)[0] for t in source.tensors.values()
                      if t.storage == "int4" and t.name.endswith(".qweight") and not t.name.startswith("mtp.")
                      and ".visual." not in t.name})
    if not modules:
        return 0.0, "no INT4 matrices"
    probe = max(modules, key=lambda m: source.tensors[m + ".qweight"].nbytes)  # the widest: conservative
    device = default_device()
    parts = {p: read_tensor(source, f"{probe}.{p}").to(device) for p in ("qweight", "scales")}
    t0 = time.perf_counter()
    dequantize_gptq(parts["qweight"], parts["scales"], 4, source.quant.group_size or 128)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    one = time.perf_counter() - t0
    seconds = one * len(modules) * 1.3  # the rest (FP8, attention, experts' matmuls, head): ~30% measured
    return seconds, (f"{len(modules)} INT4 matrices at {one * 1e3:.3g} ms each on {device.type} (timed here on "
                     f"the widest), plus 30%")


def run(engine: str, source: Checkpoint, artifact: Checkpoint, token_ids: dict[str, list[int]],
        progress=None, recorder=None) -> tuple[dict, dict | None]:
    """Run ``engine``; return its figures (``figures``) and, for the streamed engine, the source's
    final-norm hidden states per text. Only the streamed engine feeds ``recorder``
    (``reference.ReferenceRecorder``): the others never see whole-vocabulary fp32 logits."""
    if engine == "streamed":
        from .streamed import compare_streamed

        bar = {}

        def step(done: int, total: int, what: str) -> None:
            if progress is None:
                return
            if "bar" not in bar:
                bar["bar"] = progress(total=total, desc="end-to-end forward", unit="step")
            bar["bar"].update(1)

        try:
            cmp = compare_streamed(source, artifact, token_ids, progress=step, recorder=recorder)
        finally:
            if "bar" in bar:
                close = getattr(bar["bar"], "close", None)
                if close:
                    close()
        result = figures(cmp.report)
        result.update(engine="streamed", device=cmp.device, layer_seconds=[round(s, 3) for s in cmp.layer_seconds],
                      head_seconds=round(cmp.head_seconds, 3))
        return result, cmp.hidden_source
    if engine == "vllm":
        try:
            from .vllm_compare import compare_in_vllm
        except ImportError as e:
            raise CannotRun(f"the vllm engine is not available in this installation ({e})") from None
        result = figures(compare_in_vllm(source.root, artifact.root, token_ids, progress=progress))
        result["engine"] = "vllm"
        return result, None
    if engine == "transformers":
        raise HybridBuildError("the transformers engine runs through e2e.run_end_to_end")
    raise UserError(f"unknown end-to-end engine {engine!r} (engines: {', '.join(ENGINES)})")
