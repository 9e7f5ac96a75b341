"""End-to-end check: a teacher-forced forward of the whole model with transformers, source vs hybrid.

The source (INT4 AutoRound) is loaded once on CPU; its logits on the bundled texts are kept, then
the converted modules' weights (shared experts, lm-head) are replaced by the artifact's tensors,
dequantized, and the same texts run again. The BF16 parts are upcast to float32 first, so the
difference measures the conversion alone, not BF16 rounding in the forward.

It runs in a child process: auto-round's loader patches transformers in ways that can break a
later plain ``from_pretrained`` in the same process, it prints freely, and the model's memory is
returned to the system when the child exits. ``python -m hybrid_build.validate.transformers_forward`` is the child.

A child that cannot run ends as one sentence for the report, saying what is missing and what to
do: the child itself writes it when it knows the cause (texts that tokenize to nothing), the
parent reads it from the child's stderr otherwise (auto-round's known "no CPU kernel" failures),
never with terminal colour codes. The temp folder holds the child's own temp files too (its
``TMPDIR``), and is removed when the parent is stopped by SIGTERM as well as on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

MAX_TOKENS_PER_TEXT = 256
TIMEOUT_S = 6 * 3600
# exit code of a child that wrote {"error": sentence} to --out: it knows why it cannot run
UNAVAILABLE_EXIT = 3
# files that hold a tokenizer's vocabulary; tokenizer_config.json alone is not one (transformers
# then builds an empty tokenizer that turns every text into zero tokens)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def bundled_texts() -> dict[str, str]:
    """The texts under validate/data: prose, code and tool-call JSON."""
    folder = resources.files("hybrid_build.validate") / "data"
    return {p.name.removesuffix(".txt"): p.read_text(encoding="utf-8")
            for p in sorted(folder.iterdir(), key=lambda p: p.name) if p.name.endswith(".txt")}


def run_end_to_end(artifact: Path, source: Path, modules: list[str], max_tokens: int = MAX_TOKENS_PER_TEXT,
                   timeout: float = TIMEOUT_S) -> dict:
    """Run the child and return its figures, or ``{"error": "..."}`` (one sentence) when it could not run."""
    with _sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="hybrid-build-e2e-") as tmp:
        out = Path(tmp) / "result.json"
        spec = Path(tmp) / "modules.json"
        spec.write_text(json.dumps(modules))
        child_tmp = Path(tmp) / "tmp"
        child_tmp.mkdir()
        # the child's libraries write temp files too: inside our folder they go when it goes,
        # even when the child itself is killed
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TMPDIR=str(child_tmp))
        cmd = _child_command(source, artifact, spec, out, max_tokens)
        try:
            # subprocess.run kills the child on any exception, _Terminated included
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"the forward did not finish within {timeout:.0f} s: pass --no-e2e for a model this "
                             f"size on this machine"}
        log.debug("e2e child stderr:\n%s", proc.stderr)
        if out.exists():
            result = json.loads(out.read_text())
            if "error" in result:
                return {"error": strip_ansi(result["error"])}
            if proc.returncode == 0:
                return result
        return {"error": describe_failure(proc.returncode, proc.stderr)}


def _child_command(source: Path, artifact: Path, spec: Path, out: Path, max_tokens: int) -> list[str]:
    """The child's command line (a function of its own, so that a test can stand in another child)."""
    return [sys.executable, "-m", "hybrid_build.validate.transformers_forward", "--source", str(source), "--artifact",
            str(artifact), "--modules", str(spec), "--out", str(out), "--max-tokens", str(max_tokens)]


class _Terminated(BaseException):
    """SIGTERM arrived while the child ran (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it on the way out)."""


@contextmanager
def _sigterm_unwinds():
    """For the duration, SIGTERM raises ``_Terminated`` so that the ``with`` blocks inside unwind
    (child killed, temp folder removed); then the signal goes to the handler that was there
    before, which by default ends the process by SIGTERM as it would have without us.

    Signal handlers can only be set from the main thread; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        raise  # only when the previous handler let the process live on
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


# auto-round's two ways of saying that an INT4 layer has no kernel on this device: a ValueError
# naming the layer, or an error log asking for a package, then exit(-1)
_NO_BACKEND = re.compile(r"No compatible backend found for layer (\S+)")
_NEEDS_PACKAGE = re.compile(r"Inference requires the following libraries.*?`pip install ([^`]+)`", re.S)


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (auto-round colours its log lines): the CLI's one
    sanitizer (``core/terminal_text``)."""
    from hybrid_build.core.terminal_text import printable

    return printable(text)


def describe_failure(returncode: int, stderr: str | None) -> str:
    """One sentence for a child that failed: a known cause says what is missing and what to do;
    anything else is the last line of its stderr."""
    text = strip_ansi(stderr or "")
    # the last match: a traceback quotes the raising line, f-string placeholders and all, first
    m = ([None] + list(_NO_BACKEND.finditer(text)))[-1]
    if m:
        return (f"auto-round has no CPU kernel for the source's INT4 layer {m.group(1)} (its shape fits none of "
                f"auto-round's CPU backends) and the end-to-end forward runs on CPU: pass --no-e2e to skip it; "
                f"every other check still runs")
    m = _NEEDS_PACKAGE.search(text)
    if m:
        return (f"auto-round's CPU kernel for an INT4 layer of the source is not installed: run "
                f"`pip install {m.group(1).strip()}`, or pass --no-e2e to skip the end-to-end forward")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"the transformers forward failed (exit {returncode}): {lines[-1] if lines else 'no output'}"


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


class _Unavailable(Exception):
    """The child cannot measure anything; the message is the report's sentence."""


def _tokenize(source: str, texts: dict[str, str], max_tokens: int, auto_tokenizer, torch) -> list:
    """Token ids per text. Every text needs at least two tokens (position t predicts t+1); without
    vocabulary files transformers builds an empty tokenizer, and the forward would then fail on
    an empty float tensor with a message that names neither cause nor cure."""
    folder = Path(source)
    no_files = folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES)
    try:
        tok = auto_tokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        if not no_files:
            raise
        log.debug("no tokenizer: %s", e)
        tok = None
    ids_list = [torch.tensor(tok(text)["input_ids"][:max_tokens] if tok else [], dtype=torch.long)
                for text in texts.values()]
    counts = {name: ids.numel() for name, ids in zip(texts, ids_list)}
    short = {name: n for name, n in counts.items() if n < 2}
    if not short:
        return ids_list
    if no_files:
        raise _Unavailable(f"the source has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])} ...) in {source}: "
                           f"the bundled texts tokenize to {sum(counts.values())} tokens; copy the model's "
                           f"tokenizer files into the source folder or pass --no-e2e")
    name, n = next(iter(short.items()))
    raise _Unavailable(f"the source's tokenizer turns the bundled text {name!r} into {n} token(s), and the "
                       f"end-to-end figures need at least 2 per text: check the tokenizer files of {source} "
                       f"or pass --no-e2e")


def _child(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_build.validate.transformers_forward")
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

    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.core.weights import load_weight

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    texts = bundled_texts()
    try:
        ids_list = _tokenize(args.source, texts, args.max_tokens, AutoTokenizer, torch)
    except _Unavailable as e:
        Path(args.out).write_text(json.dumps({"error": str(e)}))
        return UNAVAILABLE_EXIT
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
