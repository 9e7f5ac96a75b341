"""End-to-end check: a teacher-forced forward of the whole model with transformers, source vs hybrid.

The source (INT4 AutoRound) is loaded once on CPU; its logits on the bundled texts are kept, then
the converted modules' weights (shared experts, lm-head) are replaced by the artifact's tensors,
dequantized, and the same texts run again. The BF16 parts are upcast to float32 first, so the
difference measures the conversion alone, not BF16 rounding in the forward.

It runs in a child process: auto-round's loader patches transformers in ways that can break a
later plain ``from_pretrained`` in the same process, it prints freely, and the model's memory is
returned to the system when the child exits. ``python -m hybrid_build.validate.e2e`` is the child.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

MAX_TOKENS_PER_TEXT = 256
TIMEOUT_S = 6 * 3600


def bundled_texts() -> dict[str, str]:
    """The texts under validate/data: prose, code and tool-call JSON."""
    folder = resources.files("hybrid_build.validate") / "data"
    return {p.name.removesuffix(".txt"): p.read_text(encoding="utf-8")
            for p in sorted(folder.iterdir(), key=lambda p: p.name) if p.name.endswith(".txt")}


def run_end_to_end(artifact: Path, source: Path, modules: list[str], max_tokens: int = MAX_TOKENS_PER_TEXT,
                   timeout: float = TIMEOUT_S) -> dict:
    """Run the child and return its figures, or ``{"error": "..."}`` when it could not run."""
    with tempfile.TemporaryDirectory(prefix="hybrid-build-e2e-") as tmp:
        out = Path(tmp) / "result.json"
        spec = Path(tmp) / "modules.json"
        spec.write_text(json.dumps(modules))
        cmd = [sys.executable, "-m", "hybrid_build.validate.e2e", "--source", str(source), "--artifact",
               str(artifact), "--modules", str(spec), "--out", str(out), "--max-tokens", str(max_tokens)]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"the forward did not finish within {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
            log.debug("e2e child stderr:\n%s", proc.stderr)
            return {"error": f"the transformers forward failed (exit {proc.returncode}): "
                             f"{lines[-1] if lines else 'no output'}"}
        return json.loads(out.read_text())


# ------------------------------------------------------------------------------------- child


def _find_module(model, name: str):
    """Checkpoint names are the VL form (``model.language_model.``); the causal-LM class that
    auto-round loads uses ``model.``."""
    candidates = [name]
    if name.startswith("model.language_model."):
        candidates.append("model." + name[len("model.language_model."):])
    for cand in candidates:
        try:
            return model.get_submodule(cand)
        except AttributeError:
            continue
    raise KeyError(f"{name}: no such module in the transformers model")


def _upcast(model, torch) -> None:
    """float32 for every floating parameter outside the quantized (packed) layers."""
    for mod in model.modules():
        if hasattr(mod, "qweight"):
            continue
        for p in mod.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.float()


def _forward(model, ids_list, torch) -> list:
    outs = []
    for ids in ids_list:
        logits = model(ids.unsqueeze(0)).logits[0].float()
        outs.append(torch.log_softmax(logits[:-1], dim=-1))  # position t predicts token t+1
    return outs


def compare(ref_logprobs: list, hyb_logprobs: list, ids_list: list, names: list[str], torch) -> dict:
    """KL(source || hybrid) per token, top-1 agreement and perplexity on the next tokens."""
    per_text = {}
    kl_all, agree_all, nll_s, nll_h, count = [], [], 0.0, 0.0, 0
    for name, lp, lq, ids in zip(names, ref_logprobs, hyb_logprobs, ids_list):
        lp, lq = lp.double(), lq.double()
        kl = (lp.exp() * (lp - lq)).sum(-1)
        agree = (lp.argmax(-1) == lq.argmax(-1)).double()
        target = ids[1:].long()
        ns = -lp.gather(-1, target[:, None]).sum().item()
        nh = -lq.gather(-1, target[:, None]).sum().item()
        t = target.numel()
        per_text[name] = {"tokens": t, "kl": kl.mean().item(), "top1_agreement": agree.mean().item(),
                          "ppl_source": math.exp(ns / t), "ppl_hybrid": math.exp(nh / t)}
        kl_all.append(kl)
        agree_all.append(agree)
        nll_s, nll_h, count = nll_s + ns, nll_h + nh, count + t
    kl = torch.cat(kl_all)
    ppl_s, ppl_h = math.exp(nll_s / count), math.exp(nll_h / count)
    return {"tokens": count, "kl": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": torch.cat(agree_all).mean().item(), "ppl_source": ppl_s, "ppl_hybrid": ppl_h,
            "ppl_change": ppl_h / ppl_s - 1.0, "texts": per_text}


def _child(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_build.validate.e2e")
    ap.add_argument("--source", required=True)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--modules", required=True, help="JSON list of converted module names")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS_PER_TEXT)
    args = ap.parse_args(argv)

    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid_build.pipeline.checkpoint import Checkpoint
    from hybrid_build.pipeline.weights import load_weight

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.source)
    texts = bundled_texts()
    ids_list = [torch.tensor(tok(text)["input_ids"][: args.max_tokens]) for text in texts.values()]
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16, device_map="cpu")
    model.eval()
    _upcast(model, torch)
    ref = _forward(model, ids_list, torch)

    artifact = Checkpoint.read_folder(Path(args.artifact))
    replaced = 0
    for name in json.loads(Path(args.modules).read_text()):
        mod = _find_module(model, name)
        w = load_weight(artifact, name)
        if tuple(mod.weight.shape) != tuple(w.shape):
            raise ValueError(f"{name}: artifact weight {list(w.shape)} vs model {list(mod.weight.shape)}")
        mod.weight.data = w.to(mod.weight.dtype)
        replaced += 1
    hyb = _forward(model, ids_list, torch)
    result = compare(ref, hyb, ids_list, list(texts), torch)
    result.update({"modules_replaced": replaced, "compute_dtype": "float32",
                   "seconds": round(time.perf_counter() - t0, 2),
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
