"""Task accuracy of the source and the hybrid with lm-evaluation-harness, and whether they differ.

Both models run the same lm-eval tasks with the same settings (``EvalSettings``), each example
logged (lm-eval's ``log_samples``). Per task the report gives both accuracies, the difference
with a 95% interval, the recovery (hybrid / source, in percent) and an exact McNemar test on the
paired per-example results, so a difference within noise is called that (``AccuracyReport``;
JSON and a Markdown table).

Backends:

- ``hf``: lm-eval's Hugging Face backend on small models (CPU by default), in a child process
  (``accuracy_hf``; auto-round's loader patches transformers, as for the end-to-end check). The
  hybrid is the source model with the artifact's converted modules (FP8 shared experts, int8
  lm-head) dequantized into it: transformers cannot load an ``inc-hybrid`` artifact (auto-round
  has no CPU kernel for per-layer FP8), and every other tensor of the artifact is the source's,
  byte for byte. Compute is float32, so the figures measure what the artifact stores, not a
  serving engine's kernels.
- ``completions`` / ``chat``: lm-eval's ``local-completions`` / ``local-chat-completions`` against
  running OpenAI-compatible servers (``hybrid-build serve``): what the engine really computes.
  The chat backend runs generative tasks only (a chat API returns no prompt log-likelihoods).
  An API key goes to lm-eval in its environment (``OPENAI_API_KEY``, which those models read when
  they build their request headers), never in its model arguments, which lm-eval records.

Tasks are any lm-eval task or group by name, plus the bundled offline set (``eval_taskset``:
groups ``hybrid_build`` and ``hybrid_build_gen``), which needs no network.
"""
from __future__ import annotations

import difflib
import functools
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybrid_build.core.api_key import CLIENT_ENV
from hybrid_build.core.artifact import REPORTS, artifact_identity, read_provenance, seal_report_at
from hybrid_build.core.errors import ArtifactError, CannotRun, ExternalToolError, UserError
from hybrid_build.core.progress import ProgressFactory, close_bar, null_progress

from .eval_names import DEFAULT_TASKS
from .eval_taskset import BUNDLED_TASKS, GROUPS, task_dir

log = logging.getLogger(__name__)

LM_EVAL_MODELS = {"hf": "hf", "completions": "local-completions", "chat": "local-chat-completions"}
API_PATHS = {"completions": "/completions", "chat": "/chat/completions"}
BUNDLED_DATASET = "hybrid-build/bundled-eval-tasks"  # how the card names the bundled set
SCHEMA_VERSION = 1
ALPHA = 0.05
Z95 = 1.959963984540054
PROGRESS_MARK = "\x1ehybrid-build-progress "  # a child's progress lines on its stdout
PHASE_MARK = "\x1ehybrid-build-phase "  # a child's line saying what it does now (loading a model...)
UNAVAILABLE_EXIT = 3  # a child that wrote {"error": sentence}: it knows why it cannot run
TIMEOUT_S = 12 * 3600


# ------------------------------------------------------------------------------------ settings


@dataclass
class EvalSettings:
    """What both models are run with; recorded in the report and on the model card."""

    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    backend: str = "hf"
    limit: float | None = None  # examples per task (a fraction below 1), lm-eval's --limit
    num_fewshot: int | None = None  # None: each task's own default
    batch_size: int = 8  # hf
    concurrency: int = 4  # servers: requests in flight
    device: str = "cpu"  # hf
    random_seed: int = 0  # lm-eval's defaults, stated
    numpy_seed: int = 1234
    torch_seed: int = 1234
    fewshot_seed: int = 1234

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ServerModel:
    """One model behind an OpenAI-compatible server: base URL (ending in /v1) and served name."""

    url: str
    model: str | None = None  # None: the one the server lists
    tokenizer: str | None = None  # local folder or Hub id; None: the server's own /tokenize
    root: str | None = None  # what the server says it loaded (vLLM's ``root``), once checked


# ------------------------------------------------------------------------------------ tasks


def task_manager(tasks: list[str]):
    """lm-eval's TaskManager with the bundled tasks on its include path; lm-eval's own ~15k task
    configs are indexed only when a task outside the bundled set is asked for (5 s, once a process)."""
    return _task_manager(not all(t in BUNDLED_TASKS for t in tasks))


@functools.lru_cache(maxsize=2)
def _task_manager(defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()), include_defaults=defaults)


def check_tasks(tasks: list[str], manager, backend: str) -> dict[str, str]:
    """Every name is a task, group or tag lm-eval knows, and each task's dataset is here or can be
    fetched; returns leaf task -> output type. One clear error for the first that fails."""
    if not tasks:
        raise UserError("no task given (--tasks)")
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"unknown lm-eval task {name!r}{hint}; the bundled offline tasks are "
                            f"{', '.join(GROUPS)} ({', '.join(GROUPS['hybrid_build'])}, ...) and `lm-eval ls tasks` "
                            f"lists lm-eval's own")
    kinds: dict[str, str] = {}
    for name in tasks:
        try:
            loaded = manager.load([name])
        except (ConnectionError, OSError) as e:
            raise UserError(_no_network(name, e)) from None
        for leaf, task in loaded["tasks"].items():
            kinds[leaf] = task.get_config("output_type")
    if backend == "chat":
        scored = sorted(t for t, k in kinds.items() if k != "generate_until")
        if scored:
            raise UserError(f"the chat backend runs generative tasks only (a chat API returns no prompt "
                            f"log-likelihoods), and {scored[0]} is {kinds[scored[0]]}: use --backend completions, "
                            f"or generative tasks such as hybrid_build_gen")
    return kinds


def _no_network(task: str, e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or "Offline" in text
    why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
    return (f"task {task} needs its dataset from the Hugging Face Hub and {why} ({text}): run it once with the "
            f"network to cache it, or use the bundled offline tasks (--tasks hybrid_build)")


# ------------------------------------------------------------------------------------ progress


class ProgressEvents:
    """Turns (model, request kind, done, total) events into one bar per model and request kind."""

    def __init__(self, progress: ProgressFactory):
        self.progress = progress
        self.bars: dict[tuple[str, str], object] = {}

    def __call__(self, label: str, kind: str, n: int, total: int) -> None:
        key = (label, kind)
        if key not in self.bars:
            self.bars[key] = self.progress(total=total, desc=f"{label}: {kind}", unit="req")
        self.bars[key].update(n)

    def close(self) -> None:
        for bar in self.bars.values():
            close_bar(bar)
        self.bars.clear()


def counting_lm(inner, label: str, on_progress: Callable[[str, str, int, int], None], chunk: int = 64):
    """An lm-eval ``LM`` that passes every request to ``inner`` in chunks and reports each chunk,
    so the project's progress factory (not lm-eval's own bars) shows how far a run is."""
    from lm_eval.api.model import LM

    class CountingLM(LM):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):  # anything else lm-eval asks of the model (get_model_info, ...)
            if name == "inner":
                raise AttributeError(name)
            return getattr(self.inner, name)

        def _run(self, kind: str, requests):
            out = []
            total = len(requests)
            for lo in range(0, total, chunk):
                part = requests[lo:lo + chunk]
                out.extend(getattr(self.inner, kind)(part, disable_tqdm=True))
                on_progress(label, kind, len(part), total)
            return out

        def loglikelihood(self, requests, disable_tqdm=False):
            return self._run("loglikelihood", requests)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return self._run("loglikelihood_rolling", requests)

        def generate_until(self, requests, disable_tqdm=False):
            return self._run("generate_until", requests)

        rank = property(lambda self: self.inner.rank)
        world_size = property(lambda self: self.inner.world_size)
        device = property(lambda self: getattr(self.inner, "device", None))
        tokenizer_name = property(lambda self: self.inner.tokenizer_name)

        def chat_template(self, chat_template=False):
            return self.inner.chat_template(chat_template)

        def apply_chat_template(self, chat_history, add_generation_prompt=True):
            return self.inner.apply_chat_template(chat_history, add_generation_prompt)

        def all_gather(self, tensor):
            return self.inner.all_gather(tensor)

        def gather_object(self, obj, dst=0):
            return self.inner.gather_object(obj, dst)

        def barrier(self):
            return self.inner.barrier()

        def set_cache_hook(self, cache_hook):
            super().set_cache_hook(cache_hook)
            self.inner.set_cache_hook(cache_hook)

    return CountingLM()


def run_lm_eval(lm, settings: EvalSettings, manager) -> dict:
    """lm-eval on one model with the settings; its results, samples included.

    This is what ``lm_eval.simple_evaluate`` does for a model object (seeds, tasks loaded, few-shot
    set as it sets it, then ``lm_eval.evaluator.evaluate``) without the parts that describe the
    machine: it runs ``git describe`` in the current folder (which prints "fatal: not a git
    repository" elsewhere) and collects the whole environment (seconds, every run)."""
    import random
    from importlib.metadata import version

    import numpy as np
    from lm_eval.evaluator import evaluate
    from lm_eval.utils import set_torch_seed

    random.seed(settings.random_seed)
    np.random.seed(settings.numpy_seed)
    set_torch_seed(settings.torch_seed)
    loaded = manager.load(list(settings.tasks))
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        if settings.num_fewshot is not None and default != 0:  # a task that pins 0 keeps it, as in lm-eval
            task.set_config(key="num_fewshot", value=settings.num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=settings.fewshot_seed)
    chat = settings.backend == "chat"
    results = evaluate(lm=lm, task_dict=loaded, limit=settings.limit, bootstrap_iters=100000, log_samples=True,
                       apply_chat_template=chat, fewshot_as_multiturn=chat)
    if results is None:  # pragma: no cover - only a non-zero rank of a distributed run returns None
        raise ExternalToolError("lm-eval returned no results")
    info = getattr(lm, "get_model_info", None)
    results["config"] = {**(info() if callable(info) else {}), "limit": settings.limit,
                         "num_fewshot": settings.num_fewshot, "random_seed": settings.random_seed,
                         "numpy_seed": settings.numpy_seed, "torch_seed": settings.torch_seed,
                         "fewshot_seed": settings.fewshot_seed}
    results["lm_eval_version"] = version("lm_eval")
    results["transformers_version"] = version("transformers")
    return json.loads(json.dumps(results, default=str))


# ------------------------------------------------------------------------------------ servers


def list_models(url: str, timeout: float = 10.0, api_key: str | None = None) -> list[dict]:
    """The server's ``/models`` entries, through the one HTTP client (``core.http_client``): a
    server that does not answer, or not as an OpenAI server, is one line with its exit code (3), a
    refused key one ``KeyRefused``, a redirect is not followed."""
    from hybrid_build.core.http_client import ErrorStatus, shared_client

    try:
        data = shared_client(api_key, timeout).get_json(url.rstrip("/") + "/models")
    except ErrorStatus as e:
        raise CannotRun(f"{url}: GET /models: {e}: is this an OpenAI-compatible base URL (ending in /v1)?") from None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise CannotRun(f"{url}: GET /models lists no model")
    return [e for e in entries if isinstance(e, dict) and e.get("id")]


def check_server(server: ServerModel, role: str, api_key: str | None = None) -> ServerModel:
    """The server answers and serves the model named (or exactly one, taken when none is named)."""
    entries = list_models(server.url, api_key=api_key)
    ids = [str(e["id"]) for e in entries]
    flag = f"--{role}-model"
    if server.model is None:
        if len(ids) > 1:
            raise UserError(f"{server.url} serves {len(ids)} models ({', '.join(ids)}): name the {role} with {flag}")
        chosen = entries[0]
    else:
        chosen = next((e for e in entries if e["id"] == server.model), None)
        if chosen is None:
            raise UserError(f"{server.url} serves {', '.join(repr(i) for i in ids)}, not {server.model!r} "
                            f"({flag}): is it the {role} server?")
    root = chosen.get("root") if isinstance(chosen.get("root"), str) else None
    return ServerModel(server.url, str(chosen["id"]), server.tokenizer, root)


def _server_lm(server: ServerModel, settings: EvalSettings):
    import lm_eval.api.registry

    args = {"model": server.model, "base_url": server.url.rstrip("/") + API_PATHS[settings.backend],
            "num_concurrent": settings.concurrency, "max_retries": 3, "max_length": 4096}
    if server.tokenizer:
        args.update(tokenizer_backend="huggingface", tokenizer=server.tokenizer)
    elif settings.backend == "completions":
        args["tokenizer_backend"] = "auto"  # the server's /tokenize when it has one
    else:
        args["tokenizer_backend"] = "none"
    cls = lm_eval.api.registry.get_model(LM_EVAL_MODELS[settings.backend])
    try:
        return cls.create_from_arg_obj(args, {"batch_size": 1})
    except OSError as e:  # a tokenizer that cannot be loaded
        raise UserError(f"the tokenizer {server.tokenizer or server.model!r} cannot be loaded ({e}): pass "
                        f"--tokenizer with a local folder holding the model's tokenizer") from None


@contextmanager
def client_key_env(api_key: str | None):
    """``OPENAI_API_KEY`` set to ``api_key`` while lm-eval runs in this process, then restored;
    without a key, the environment as it is. lm-eval's API models read it once per model object
    (a cached header), so the model objects must be made and used inside this context."""
    if not api_key:
        yield
        return
    before = os.environ.get(CLIENT_ENV)
    os.environ[CLIENT_ENV] = api_key
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CLIENT_ENV, None)
        else:
            os.environ[CLIENT_ENV] = before


def evaluate_servers(source: ServerModel, hybrid: ServerModel, settings: EvalSettings, manager,
                     progress: ProgressFactory = null_progress, api_key: str | None = None,
                     announce: Callable[[str], None] | None = None) -> dict[str, dict]:
    """lm-eval on both servers, one after the other; {"source": results, "hybrid": results}.
    ``api_key`` reaches lm-eval as ``OPENAI_API_KEY`` in the environment."""
    events = ProgressEvents(progress)
    out = {}
    try:
        for role, server in (("source", source), ("hybrid", hybrid)):
            if announce:
                announce(f"evaluating the {role} at {server.url} ({server.model})")
            try:
                with client_key_env(api_key):  # the model reads the key when it is made and used
                    lm = counting_lm(_server_lm(server, settings), role, events,
                                     chunk=max(64, 4 * settings.concurrency))
                    out[role] = run_lm_eval(lm, settings, manager)
            except Exception as e:  # noqa: BLE001 - lm-eval re-raises the server's failure after its retries
                if isinstance(e, (UserError, ExternalToolError)):
                    raise
                text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ExternalToolError(f"the {role} server at {server.url} failed during the evaluation "
                                        f"({type(e).__name__}: {text})") from e
    finally:
        events.close()
    return out


# ------------------------------------------------------------------------------------ hf backend


def evaluate_hf(source_root: Path, artifact_root: Path, modules: list[str], settings: EvalSettings,
                progress: ProgressFactory = null_progress, timeout: float = TIMEOUT_S,
                announce: Callable[[str], None] | None = None) -> dict:
    """Run the ``accuracy_hf`` child: source, then the hybrid's converted modules dequantized into it.
    Returns {"source": results, "hybrid": results, "modules_replaced": n, ...}. ``announce`` gets the
    child's phase lines (loading, evaluating) as they come."""
    events = ProgressEvents(progress)
    with tempfile.TemporaryDirectory(prefix="hybrid-build-eval-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "result.json"
        err = Path(tmp) / "stderr.txt"
        spec.write_text(json.dumps({"source": str(source_root), "artifact": str(artifact_root), "modules": modules,
                                    "settings": settings.to_json()}))
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "hybrid_build.validate.eval.task_eval_hf", "--spec", str(spec), "--out", str(out)]
        t0 = time.monotonic()
        with open(err, "w") as err_f:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_f, text=True, env=env)
            try:
                for line in proc.stdout:
                    if line.startswith(PHASE_MARK) and announce:
                        announce(line[len(PHASE_MARK):].strip())
                    if line.startswith(PROGRESS_MARK):
                        label, kind, n, total = line[len(PROGRESS_MARK):].split()
                        events(label, kind, int(n), int(total))
                    if time.monotonic() - t0 > timeout:
                        raise subprocess.TimeoutExpired(cmd, timeout)
                proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise ExternalToolError(f"the Hugging Face evaluation did not finish within {timeout:.0f} s") from None
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                events.close()
        stderr = err.read_text(errors="replace")
        log.debug("eval child stderr:\n%s", stderr)
        if out.exists():
            result = json.loads(out.read_text())
            if "error" in result:
                raise UserError(result["error"]) if result.get("kind") == "user" else ArtifactError(result["error"])
            if proc.returncode == 0:
                return result
        from .transformers_forward import strip_ansi

        lines = [ln.strip() for ln in strip_ansi(stderr).splitlines() if ln.strip()]
        raise ExternalToolError(f"the Hugging Face evaluation failed (exit {proc.returncode}): "
                                f"{lines[-1] if lines else 'no output'}")


# ------------------------------------------------------------------------------------ statistics


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs: ``b`` examples only the source
    got right, ``c`` only the hybrid (a binomial test of b against b + c trials at 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


@dataclass
class TaskComparison:
    """One task (or all pooled): accuracies, the paired difference and its test."""

    task: str
    metric: str  # lm-eval's key, e.g. "acc,none"
    n: int
    source: float
    hybrid: float
    difference: float  # hybrid - source
    ci95: tuple[float, float]
    recovery_pct: float | None  # hybrid / source * 100
    only_source: int  # McNemar b: examples the source got right and the hybrid wrong
    only_hybrid: int  # McNemar c
    p_value: float
    test: str  # "McNemar exact" (0/1 scores) or "sign test" (other per-example scores)
    verdict: str  # identical | within noise | hybrid worse | hybrid better
    source_stderr: float | None = None
    hybrid_stderr: float | None = None
    dataset: str | None = None  # the task's dataset (a Hub id, or the bundled set)
    num_fewshot: int | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def compare_pairs(task: str, metric: str, pairs: list[tuple[float, float]], alpha: float = ALPHA) -> TaskComparison:
    """The comparison of per-example scores (source, hybrid) of the same examples."""
    n = len(pairs)
    if n == 0:
        raise ArtifactError(f"{task}: no example was scored by both models")
    src = sum(s for s, _ in pairs) / n
    hyb = sum(h for _, h in pairs) / n
    diffs = [h - s for s, h in pairs]
    mean = hyb - src
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    b = sum(1 for s, h in pairs if s > h)
    c = sum(1 for s, h in pairs if h > s)
    p = mcnemar_exact(b, c)
    binary = all(v in (0.0, 1.0) for pair in pairs for v in pair)
    if b + c == 0:
        verdict = "identical"
    elif p >= alpha:
        verdict = "within noise"
    else:
        verdict = "hybrid worse" if mean < 0 else "hybrid better"
    return TaskComparison(task, metric, n, src, hyb, mean, (mean - half, mean + half),
                          hyb / src * 100 if src > 0 else None, b, c, p,
                          "McNemar exact" if binary else "sign test", verdict)


def _primary(samples: list[dict], config: dict) -> tuple[str, str]:
    """(metric, filter) that a task is compared on: its first metric, its first filter."""
    metrics = [m.get("metric") for m in (config.get("metric_list") or []) if isinstance(m.get("metric"), str)]
    logged = [m for m in samples[0].get("metrics") or [] if isinstance(m, str)]
    # a per-example score is a number; corpus metrics (bleu, f1 over pairs) log what they aggregate
    scored = [m for m in metrics + logged if isinstance(samples[0].get(m), (int, float))]
    if not scored:
        raise ArtifactError(f"{config.get('task', '?')}: no metric of this task has a per-example score "
                            f"({', '.join(metrics or logged) or 'none logged'}), and the paired test needs one")
    metric = scored[0]
    return metric, str(samples[0].get("filter", "none"))


def per_example(results: dict, task: str, metric: str, filt: str) -> dict[int, tuple[str, float]]:
    """doc_id -> (doc_hash, score) of one task's logged samples, for one metric and filter."""
    out = {}
    for s in results["samples"][task]:
        if str(s.get("filter", "none")) != filt or metric not in s:
            continue
        out[int(s["doc_id"])] = (str(s.get("doc_hash", "")), float(s[metric]))
    return out


def paired_examples(source: dict, hybrid: dict) -> dict[str, dict]:
    """Per task: the metric, filter and the paired per-example scores [(doc_id, source, hybrid)]."""
    out = {}
    for task in sorted(source.get("samples") or {}):
        if task not in (hybrid.get("samples") or {}):
            raise ArtifactError(f"{task}: evaluated on the source but not on the hybrid")
        samples = source["samples"][task]
        if not samples:
            continue
        metric, filt = _primary(samples, (source.get("configs") or {}).get(task, {}))
        s, h = per_example(source, task, metric, filt), per_example(hybrid, task, metric, filt)
        if set(s) != set(h):
            raise ArtifactError(f"{task}: the source and the hybrid were scored on different examples")
        for doc, (sh, _) in s.items():
            if sh and h[doc][0] and sh != h[doc][0]:
                raise ArtifactError(f"{task}: example {doc} differs between the two runs (doc_hash)")
        out[task] = {"metric": metric, "filter": filt,
                     "pairs": [[doc, s[doc][1], h[doc][1]] for doc in sorted(s)]}
    return out


# ------------------------------------------------------------------------------------ the report


@dataclass
class AccuracyReport:
    settings: dict
    models: dict  # role -> what was evaluated (name, backend, url or path, served root)
    tasks: list[TaskComparison]
    overall: TaskComparison | None
    examples: dict[str, dict]  # task -> metric, filter, pairs [doc_id, source, hybrid]
    versions: dict  # hybrid-build, lm-eval, transformers, torch
    artifact: dict = field(default_factory=dict)  # name, provenance_sha256 (the build evaluated)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    created: str = ""

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "created": self.created, "artifact": self.artifact,
                "versions": self.versions, "settings": self.settings, "models": self.models, "alpha": ALPHA,
                "tasks": [t.to_json() for t in self.tasks],
                "overall": self.overall.to_json() if self.overall else None,
                "notes": self.notes, "seconds": round(self.seconds, 2), "examples": self.examples}

    def to_markdown(self) -> str:
        return markdown_table(self.to_json())


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def markdown_rows(report: dict) -> list[str]:
    """The table of a report (its JSON form): one row per task, then the pooled row."""
    lines = ["| task | n | source | hybrid | difference (95% CI) | recovery | only source / only hybrid | p "
             "| verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = list(report.get("tasks") or [])
    if report.get("overall") and len(rows) > 1:
        rows.append(report["overall"])
    for r in rows:
        lo, hi = r["ci95"]
        rec = "-" if r.get("recovery_pct") is None else f"{r['recovery_pct']:.1f}%"
        name = r["task"] if r is not report.get("overall") else f"**{r['task']}**"
        lines.append(f"| {name} | {r['n']} | {_pct(r['source'])} | {_pct(r['hybrid'])} | "
                     f"{100 * r['difference']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {rec} | "
                     f"{r['only_source']} / {r['only_hybrid']} | {r['p_value']:.3g} | {r['verdict']} |")
    return lines


def settings_line(report: dict) -> str:
    s = report.get("settings") or {}
    v = report.get("versions") or {}
    limit = s.get("limit")
    return (f"lm-eval {v.get('lm_eval', '?')}, backend `{s.get('backend')}`, tasks {', '.join(s.get('tasks') or [])}, "
            f"{'all examples' if limit is None else f'limit {limit:g} per task'}, "
            f"{'task default' if s.get('num_fewshot') is None else s['num_fewshot']} few-shot, seeds "
            f"{s.get('random_seed')}/{s.get('numpy_seed')}/{s.get('torch_seed')}/{s.get('fewshot_seed')}; "
            f"hybrid-build {v.get('hybrid_build', '?')}")


def markdown_table(report: dict) -> str:
    models = report.get("models") or {}
    lines = ["# Task accuracy: source vs hybrid", "",
             f"Source: {models.get('source', {}).get('name', '?')}; "
             f"hybrid: {models.get('hybrid', {}).get('name', '?')}.",
             f"Settings: {settings_line(report)}.", "",
             *markdown_rows(report), "",
             "Accuracy in percent. Difference = hybrid - source with a normal 95% interval over the paired "
             "per-example differences; recovery = hybrid / source; p: exact McNemar test on the examples only one "
             f"of the two got right; a difference with p >= {ALPHA} is within noise.", ""]
    lines += [f"- {n}" for n in report.get("notes") or []]
    return "\n".join(lines).rstrip() + "\n"


def build_report(results: dict[str, dict], settings: EvalSettings, models: dict, artifact: dict | None = None,
                 notes: list[str] | None = None, seconds: float = 0.0) -> AccuracyReport:
    """The comparison of two lm-eval runs (``results["source"]``, ``results["hybrid"]``) from their
    logged samples."""
    from hybrid_build.core import __version__

    src, hyb = results["source"], results["hybrid"]
    examples = paired_examples(src, hyb)
    rows, pooled = [], []
    for task, ex in examples.items():
        pairs = [(s, h) for _, s, h in ex["pairs"]]
        row = compare_pairs(task, f"{ex['metric']},{ex['filter']}", pairs)
        key = f"{ex['metric']}_stderr,{ex['filter']}"
        row.source_stderr = _num((src.get("results") or {}).get(task, {}).get(key))
        row.hybrid_stderr = _num((hyb.get("results") or {}).get(task, {}).get(key))
        row.dataset = (BUNDLED_DATASET if task in BUNDLED_TASKS
                       else _dataset_of((src.get("configs") or {}).get(task, {})))
        shots = (src.get("n-shot") or {}).get(task)
        row.num_fewshot = shots if isinstance(shots, int) else None
        rows.append(row)
        pooled += pairs
    overall = compare_pairs("all (pooled)", "per-task metric", pooled) if pooled else None
    versions = {"hybrid_build": __version__, "lm_eval": src.get("lm_eval_version"),
                "transformers": src.get("transformers_version")}
    return AccuracyReport(settings.to_json(), models, rows, overall, examples, versions, artifact or {},
                          notes or [], seconds, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _dataset_of(config: dict) -> str | None:
    path, name = config.get("dataset_path"), config.get("dataset_name")
    if not isinstance(path, str) or path in ("json", "csv", "parquet", "text"):
        return None
    return f"{path}:{name}" if isinstance(name, str) and name else path


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def write_report(report: AccuracyReport, path: Path) -> list[Path]:
    """``path`` (JSON) and the Markdown table beside it (same name, ``.md``)."""
    from hybrid_build.core.safetensors_io import write_text_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    md = path.with_suffix(".md")
    write_text_atomic(path, json.dumps(report.to_json(), indent=2) + "\n")
    write_text_atomic(md, report.to_markdown())
    seal_report_at(path)  # in an artifact: recorded in its provenance (core.artifact)
    return [path, md]


def default_report_path(artifact: Path) -> Path:
    """Where the report goes in an artifact (the Markdown one beside it): ``core.artifact.REPORTS``."""
    return REPORTS["eval"].path(artifact)


# ------------------------------------------------------------------------------------ entry point


HF_NOTE = ("hf backend: the hybrid is the source model with the artifact's converted modules (FP8 shared "
           "experts, int8 lm-head) dequantized into it, float32 compute; every other tensor of the artifact is "
           "the source's byte for byte. It measures what the artifact stores, not a serving engine's kernels.")
SERVER_NOTE = ("server backend: each model as its server computes it (for vLLM: its FP8 and int8 kernels, "
               "activation quantization included).")


def evaluate_artifact(artifact: Path, source: str | None, settings: EvalSettings,
                      progress: ProgressFactory = null_progress,
                      announce: Callable[[str], None] | None = None) -> tuple[AccuracyReport, dict]:
    """The hf backend on a built artifact and its source (given, or the one its provenance records,
    checked by content). Returns the report and the two raw lm-eval results. ``announce`` gets a line
    as each phase starts (the task index, each model's loading and evaluation)."""
    say = announce or (lambda _line: None)
    from hybrid_build.core.source_identity import open_recorded_source

    artifact = Path(artifact)
    prov = read_provenance(artifact)
    src = open_recorded_source(artifact, prov, source, progress)
    modules = [c["module"] for c in prov.converted if c.get("module")]
    if not modules:
        raise ArtifactError(f"{artifact}: the provenance lists no converted module: nothing differs from the source")
    say("loading lm-eval's task index")
    manager = task_manager(settings.tasks)
    check_tasks(settings.tasks, manager, settings.backend)
    t0 = time.perf_counter()
    raw = evaluate_hf(src.root, artifact.resolve(), modules, settings, progress, announce=announce)
    models = {"source": {"name": src.source_id or src.root.name, "backend": "hf", "device": settings.device},
              "hybrid": {"name": artifact.resolve().name, "backend": "hf", "device": settings.device,
                         "format": prov.format, "modules_replaced": raw.get("modules_replaced")}}
    report = build_report(raw, settings, models, artifact_identity(artifact), [HF_NOTE], time.perf_counter() - t0)
    return report, raw


def evaluate_endpoints(source: ServerModel, hybrid: ServerModel, settings: EvalSettings,
                       artifact: Path | None = None, progress: ProgressFactory = null_progress,
                       api_key: str | None = None,
                       announce: Callable[[str], None] | None = None) -> tuple[AccuracyReport, dict]:
    """A server backend: both servers checked (reachable, serving the model named, not the same
    model twice, taking ``api_key``: sent as a Bearer token), then evaluated one after the other;
    ``announce`` gets a line as each phase starts."""
    say = announce or (lambda _line: None)
    source = check_server(source, "source", api_key)
    hybrid = check_server(hybrid, "hybrid", api_key)
    if source.url.rstrip("/") == hybrid.url.rstrip("/") and source.model == hybrid.model:
        raise UserError(f"the source and the hybrid are the same model ({source.model!r} at {source.url}): give "
                        "each its own server (--source-url, --hybrid-url) or its own served name")
    if source.root and source.root == hybrid.root:
        raise UserError(f"both servers say they loaded {source.root}: the hybrid would be compared with itself")
    say("loading lm-eval's task index")
    manager = task_manager(settings.tasks)
    check_tasks(settings.tasks, manager, settings.backend)
    t0 = time.perf_counter()
    raw = evaluate_servers(source, hybrid, settings, manager, progress, api_key, announce=announce)
    models = {role: {"name": m.model, "backend": LM_EVAL_MODELS[settings.backend], "url": m.url, "root": m.root,
                     "tokenizer": m.tokenizer}
              for role, m in (("source", source), ("hybrid", hybrid))}
    report = build_report(raw, settings, models, artifact_identity(artifact) if artifact else {}, [SERVER_NOTE],
                          time.perf_counter() - t0)
    return report, raw


def write_samples(raw: dict, path: Path) -> Path:
    """Both runs' logged samples, one JSON object per line with ``model`` and ``task`` added."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for role in ("source", "hybrid"):
            for task, samples in sorted((raw[role].get("samples") or {}).items()):
                for s in samples:
                    f.write(json.dumps({"model": role, "task": task, **s}, default=str) + "\n")
    return path
