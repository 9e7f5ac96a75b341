"""The model card of a published hybrid artifact: Hub metadata plus a body built from the artifact.

Everything on the card comes from files in the artifact: ``hybrid_build/provenance.json`` (source,
recipe, converted modules, file hashes), ``hybrid_build/validation.json`` (the figures and checks),
``hybrid_build/eval.json`` (task accuracy from ``hybrid-build eval``, shown only when it was made
for this build), ``hybrid_build/bench.json`` (``hybrid-build bench --out``), ``hybrid_build/recipe.yaml``'s
serve profiles (via the provenance's recipe) and the safetensors headers (bytes per converted
module). The figures of the three reports also go into the metadata as ``model-index`` eval
results (``EvalResult``), each with the tool versions and settings that produced it. The card is
rendered with ``huggingface_hub.ModelCard`` and
``ModelCardData``; nothing here talks to the network.

The card depends on the artifact alone, never on where it is published: `run` writes it into the
folder and `publish` uploads the same bytes. So its name comes from the source, its commands run in a
copy of the repository (``.``), and its links are files of the repository, referenced relatively.
"""
from __future__ import annotations

import json
import logging
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from hybrid_build.core import formats
from hybrid_build.core.artifact import CARD, PROVENANCE, RECIPE, REPORTS, is_report
from hybrid_build.core.bounded_read import InputRefused, parse_yaml
from hybrid_build.core.byte_units import human_bytes
from hybrid_build.core.checkpoint import HUB_ID
from hybrid_build.core.formats.base import OutputFormat
from hybrid_build.core.provenance import Provenance

log = logging.getLogger(__name__)
VALIDATION, EVAL = REPORTS["validation"], REPORTS["eval"]

UNKNOWN_LICENSE = "other"


@dataclass
class ValidationStatus:
    """What the artifact's validation says: ``passed``, ``failed``, ``could not run``, ``missing`` or
    ``stale`` (``core.artifact.validation_outcome``), with the report it comes from."""

    state: str
    report: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.state == "passed"


@dataclass
class LicenseInfo:
    license: str
    origin: str  # where it was found, said on the card
    known: bool = True


@dataclass
class EvalStatus:
    """``hybrid_build/eval.json``: ``current`` (made for this build: its provenance hash matches) or
    ``stale`` (another build, or a report that names none); only a current one is shown."""

    state: str
    report: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def current(self) -> bool:
        return self.state == "current"


@dataclass
class CardInputs:
    provenance: Provenance
    validation: ValidationStatus
    license: LicenseInfo
    converted_bytes: dict[str, dict[str, int]]  # kind -> {"modules", "params", "bf16", "stored"}
    files: dict[str, int]  # every published file -> bytes (the card excluded)
    pipeline_tag: str | None = None
    forced: bool = False
    evaluation: EvalStatus | None = None  # hybrid_build/eval.json, when present
    bench: dict | None = None  # hybrid_build/bench.json, when present and readable
    reference: bool = False  # hybrid_build/reference.*, made for this build (``reference_current``)
    memory: dict | None = None  # the dense profile's KV pool per hardware (``memory_figures``)


# ------------------------------------------------------------------------------------ gathering


def frontmatter(text: str | None) -> dict:
    """The YAML metadata block of a model card's text, or {} when it has none or it does not parse."""
    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text or "", re.S)
    if not m:
        return {}
    try:
        data = parse_yaml(m.group(1), "the source's model card")
    except (yaml.YAMLError, InputRefused):
        return {}
    return data if isinstance(data, dict) else {}


def find_license(card_meta: dict, config: dict) -> LicenseInfo:
    """The source's license: from the source card that ``run`` copied into the artifact (its metadata,
    ``card_meta``), else from ``config.json``; ``other`` when neither says, which the card then states
    plainly."""
    if isinstance(card_meta.get("license"), str) and card_meta["license"].strip():
        return LicenseInfo(card_meta["license"].strip(), "the source model card")
    for key in ("license", "license_name"):
        if isinstance(config.get(key), str) and config[key].strip():
            return LicenseInfo(config[key].strip(), "the source config.json")
    return LicenseInfo(UNKNOWN_LICENSE, "not found in the source", known=False)


def converted_sizes(bound) -> dict[str, dict[str, int]]:
    """Per kind (fp8 / int8): modules, parameters, their BF16 bytes and the bytes stored now.

    Stored bytes come from the artifact's safetensors headers (``bound.checkpoint()``: headers only)."""
    tensors = bound.checkpoint().tensors
    out: dict[str, dict[str, int]] = {}
    for c in bound.provenance.converted:
        kind = c.get("kind", "?")
        n, k = (c.get("shape") or [0, 0])[:2]
        entry = out.setdefault(kind, {"modules": 0, "params": 0, "bf16": 0, "stored": 0})
        entry["modules"] += 1
        entry["params"] += n * k
        entry["bf16"] += 2 * n * k
        for name in c.get("tensors", []):
            t = tensors.get(name)
            entry["stored"] += t.nbytes if t else 0
    return out


CARD_HARDWARE = ("gb10", "h200")  # the hardware the card states the dense profile's memory for
CARD_ENGINE = "0.26.0"  # the vLLM version whose KV-cache planning the card's figures follow


def memory_figures(bound) -> dict | None:
    """The recipe's ``dense`` profile as vLLM plans its KV cache on each of ``CARD_HARDWARE``
    (``serve.speed.memory_plan``, what ``plan`` and ``serve`` print): the pool in tokens, the largest
    context one stream holds, and the streams that fit at ``max_model_len`` and at 100k and 32k
    tokens. The weights come from the artifact's headers; a DFlash drafter on the Hub at the z-lab
    drafter's stated shape and size, one that is not published (a folder on the build machine) left
    out, as the card's plain vLLM command leaves it out. None when the artifact is no hybrid GDN
    model or has no dense profile."""
    from hybrid_build.core.errors import HybridBuildError
    from hybrid_build.recipes.profiles import ServeProfile
    from hybrid_build.serve.speed import bandwidth as bw
    from hybrid_build.serve.speed import memory_plan as mem

    dense = ((bound.provenance.recipe.get("serve") or {}).get("profiles") or {}).get("dense")
    if not dense:
        return None
    try:
        profile = ServeProfile(**dense)
        ckpt = bound.checkpoint()
    except (ValueError, HybridBuildError):
        return None
    if "linear_attention" not in bw.layer_types(ckpt.text_config):
        return None
    spec = profile.speculative
    drafter, drafter_bytes, without = None, 0, None
    if spec is not None and spec.method == "dflash":
        if _local_drafter(dense):
            profile = profile.model_copy(update={"speculative": None})
            without = "without the drafter, which is not in this repository"
        else:
            drafter, drafter_bytes = dict(mem.DFLASH_DRAFTER), bw.DFLASH_122B.weight_bytes
    head = formats.head_quantized_at_load((ckpt.hybrid_info or {}).get("lm_head")) and profile.int8_lm_head
    weights = mem.served_weight_bytes(ckpt.tensors.values(), spec.method if spec else None, head)
    rows = []
    for hw in CARD_HARDWARE:
        try:
            p = mem.plan_on(hw, ckpt.text_config, profile, CARD_ENGINE, weights, drafter, drafter_bytes)
        except (mem.MemoryPlanError, KeyError, TypeError):
            continue
        contexts = [profile.max_model_len] + [c for c in (100_000, 32_768) if c < profile.max_model_len]
        fits = {c: p.streams_that_fit(c) for c in contexts}
        rows.append({"hardware": hw, "label": bw.HARDWARE[hw].label, "pool_tokens": p.pool_tokens,
                     "max_context_tokens": p.max_context_tokens, "reserve_basis": p.inputs.reserve_basis,
                     "fit": {c: (f.whole, f.next_tokens) for c, f in fits.items()},
                     "layout": p.inputs.layout, "prefix_match_unit": p.inputs.prefix_match_unit,
                     "num_speculative_tokens": p.inputs.num_speculative_tokens,
                     "kv_cache_dtype": p.inputs.kv_cache_dtype})
    if not rows:
        return None
    return {"engine": CARD_ENGINE, "gpu_memory_utilization": profile.gpu_memory_utilization,
            "max_model_len": profile.max_model_len, "without": without, "rows": rows}


def _memory_section(inp: CardInputs) -> list[str]:
    m = inp.memory
    if not m:
        return []
    first = m["rows"][0]
    kv = {"auto": "bf16"}.get(first["kv_cache_dtype"], first["kv_cache_dtype"])
    unit = first.get("prefix_match_unit")
    hits = (f" (vLLM's own pages with `--block-size {unit} --prefix-match-unit {unit}`: a resent prompt hits to within "
            f"{unit} tokens of its end)" if unit else "")
    contexts = sorted({c for r in m["rows"] for c in r["fit"]}, reverse=True)
    lines = ["### Memory: the KV pool and the streams that fit", "",
             f"The `dense` profile's KV cache as vLLM {m['engine']} plans it (`gpu_memory_utilization` "
             f"{m['gpu_memory_utilization']:g}, `max_model_len` {m['max_model_len']:,}, {first['layout']} prefix-cache "
             "layout" + hits
             + f", {kv} KV, {first['num_speculative_tokens']} speculative tokens"
             + (f"; {m['without']}" if m["without"] else "") + "), from this repository's configs and "
             "safetensors headers by the memory model `hybrid-build plan` and `hybrid-build serve` print, which "
             "matches vLLM's own planning functions run on CPU. The pool is the figure vLLM logs as \"GPU KV cache "
             "size\"; a stream holds its context's KV blocks plus the Gated DeltaNet state with one page per "
             "speculative token, whatever its length.", "",
             "| hardware | KV pool (tokens) | largest context | " + " | ".join(f"streams of {c:,}" for c in contexts)
             + " |", "|---|---|---|" + "---|" * len(contexts)]
    for r in m["rows"]:
        cells = []
        for c in contexts:
            whole, nxt = r["fit"].get(c, (0, 0))
            cells.append(f"{whole:,}" + (f" (the next gets {nxt:,})" if nxt else ""))
        lines.append(f"| {r['label']} | {r['pool_tokens']:,} | {r['max_context_tokens']:,} | " + " | ".join(cells)
                     + " |")
    bases = "; ".join(f"{r['label']}: {r['reserve_basis']}" for r in m["rows"])
    lines += ["", f"What vLLM keeps besides weights and KV cache (activations, CUDA graphs) is taken as: {bases}. "
              "`hybrid-build serve` prints these figures for the device it starts on and warns when the pool vLLM "
              "logs differs from them by more than 2%.", ""]
    return lines


def read_evaluation(bound) -> EvalStatus | None:
    """The artifact's eval report, checked against the build (its provenance sha256 must be the
    build's). None when there is no report."""
    evaluation = REPORTS["eval"]
    report = bound.report_json(evaluation)
    if report is None:
        return None
    if not isinstance(report, dict) or not isinstance(report.get("tasks"), list):
        return EvalStatus("stale", {}, f"{evaluation.names[0]} is not a report of `hybrid-build eval`")
    state, why = bound.report_state(evaluation)
    if state != "current":
        return EvalStatus("stale", report, why if state == "stale" else f"{why} (run with ARTIFACT)")
    return EvalStatus("current", report)


def reference_current(bound) -> bool:
    """Whether the artifact's reference (``validate.reference``) was made for the build there now:
    the card speaks of it only then, a stale one proves nothing about these weights."""
    reference = REPORTS["reference"]
    return bound.report_state(reference)[0] == "current" and all(bound.path(f).is_file() for f in reference.files)


def read_bench(bound) -> dict | None:
    """``hybrid-build bench``'s single-server report in the artifact, or None (absent or another shape)."""
    bench = REPORTS["bench"]
    report = bound.report_json(bench)
    if report is None:
        return None
    if not isinstance(report, dict) or not report or not isinstance(report.get("results"), list):
        log.warning("%s is not a single-server report of `hybrid-build bench`: left off the card", bench.main)
        return None
    return report


def card_inputs(bound, validation: ValidationStatus, files: dict[str, int], forced: bool) -> CardInputs:
    """Everything the card says, asked of the bound artifact (``core.bound``): the provenance, the
    reports, the reference, the headers, the source's card and config."""
    config = bound.config()
    meta = frontmatter(bound.text(CARD))
    tag = meta.get("pipeline_tag")
    if not isinstance(tag, str):
        tag = "image-text-to-text" if "vision_config" in config else "text-generation"
    return CardInputs(provenance=bound.provenance, validation=validation, license=find_license(meta, config),
                      converted_bytes=converted_sizes(bound), files=files, pipeline_tag=tag, forced=forced,
                      evaluation=read_evaluation(bound), bench=read_bench(bound),
                      reference=reference_current(bound), memory=memory_figures(bound))


# ------------------------------------------------------------------------------------ the source


@dataclass
class SourceView:
    """The provenance's ``source`` block as the card names it. Read defensively: provenance written
    before content fingerprints has no ``kind`` and a fingerprint of headers, not of bytes."""

    kind: str  # "hub" | "local"
    name: str  # Hub repo id, or the local folder's name (never a machine's path)
    revision: str | None
    fingerprint: str | None
    content: bool  # the fingerprint covers the files' bytes (every file has a sha256)

    @classmethod
    def of(cls, provenance: Provenance) -> "SourceView":
        src = provenance.source
        ident = str(src.get("id") or "")
        kind = src.get("kind")
        if kind not in ("hub", "local"):
            kind = "hub" if HUB_ID.match(ident) else "local"
        name = ident if kind == "hub" else (Path(ident).name or Path(str(src.get("path") or "")).name or "?")
        files = src.get("files") or {}
        content = bool(files) and all(isinstance(f, dict) and f.get("sha256") for f in files.values())
        fp = src.get("fingerprint")
        return cls(kind, name or "?", src.get("revision"), fp if isinstance(fp, str) and fp else None, content)

    @property
    def hub(self) -> bool:
        return self.kind == "hub" and bool(HUB_ID.match(self.name))

    def link(self) -> str:
        """Markdown naming the source: the Hub repo (at its revision), or the local folder by name and
        content hash."""
        if self.hub:
            url = f"https://huggingface.co/{self.name}" + (f"/tree/{self.revision}" if self.revision else "")
            return f"[{self.name}]({url})" + (f" (revision `{self.revision}`)" if self.revision else "")
        what = f"`{self.name}`"
        if self.fingerprint and self.content:
            what += f", content sha256 `{self.fingerprint[:16]}`"
        return f"a local checkpoint ({what})"


# ------------------------------------------------------------------------------------ rendering


def _g(v, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _format_of(prov: Provenance) -> OutputFormat:
    """The artifact's output format object (provenance written before formats were recorded: the default)."""
    return formats.get(prov.format or formats.DEFAULT)


def card_name(prov: Provenance) -> str:
    """The card's title and ``model-index`` name: the source's name (a Hub id's model part, or the
    local folder's name) with ``-hybrid``: the same wherever the artifact is published."""
    return f"{SourceView.of(prov).name.split('/')[-1]}-hybrid"


def card_data(inp: CardInputs) -> ModelCardData:
    prov = inp.provenance
    source = SourceView.of(prov)
    kinds = {c.get("kind") for c in prov.converted}
    tags = ["hybrid-build", "hybrid", "int4", "auto-round"]
    if "fp8" in kinds:
        tags.append("fp8")
    if "int8" in kinds:
        tags.append("int8")
    tags += _format_of(prov).card_tags
    tags.append("vllm")
    extra = {}
    if source.hub:
        extra["base_model_relation"] = "quantized"
    results = eval_results(inp)
    if results:
        extra.update(eval_results=results, model_name=card_name(prov))
    # no ``library_name``: the Hub's would offer a loading snippet, and no library loads this
    # checkpoint as it is (transformers reads neither the FP8 shared experts nor the int8 head of an
    # auto-round checkpoint; vLLM needs the plugin, and vLLM is a Hub "local app", not a library key)
    return ModelCardData(
        base_model=source.name if source.hub else None,
        license=inp.license.license,
        pipeline_tag=inp.pipeline_tag,
        tags=tags,
        **extra,
    )


def eval_results(inp: CardInputs) -> list[EvalResult]:
    """``model-index`` entries: the hybrid's accuracy and recovery per task (a current eval report),
    the end-to-end validation figures, and the bench speeds; each names the settings it was made with."""
    out: list[EvalResult] = []
    tool = f"hybrid-build {inp.provenance.tool.version or '?'}"
    ev = inp.evaluation
    if ev is not None and ev.current:
        rep = ev.report
        s, v = rep.get("settings") or {}, rep.get("versions") or {}
        args = {"backend": s.get("backend"), "limit": s.get("limit"), "lm_eval": v.get("lm_eval"),
                "hybrid_build": v.get("hybrid_build")}
        config = (f"hybrid-build {v.get('hybrid_build', '?')} eval, lm-eval {v.get('lm_eval', '?')}, backend "
                  f"{s.get('backend')}, " + ("all examples" if s.get("limit") is None else f"limit {s.get('limit')}"))
        for r in rep.get("tasks") or []:
            if not isinstance(r, dict) or not isinstance(r.get("hybrid"), (int, float)):
                continue
            metric = str(r.get("metric") or "acc").split(",")[0]
            common = dict(task_type="text-generation", dataset_type=r.get("dataset") or str(r.get("task")),
                          dataset_name=str(r.get("task")), dataset_config=str(r.get("task")), metric_config=config)
            task_args = {**args, "num_fewshot": r.get("num_fewshot"), "n": r.get("n"), "source": r.get("source"),
                         "p_value": r.get("p_value"), "verdict": r.get("verdict")}
            out.append(EvalResult(metric_type=metric, metric_value=round(float(r["hybrid"]), 4),
                                  metric_name=f"{metric} (hybrid)", metric_args=task_args, **common))
            if isinstance(r.get("recovery_pct"), (int, float)):
                out.append(EvalResult(metric_type="recovery", metric_value=round(float(r["recovery_pct"]), 2),
                                      metric_name="recovery % (hybrid / source)", **common))
    v = inp.validation
    e2e = (v.report or {}).get("end_to_end") or {}
    if v.state in ("passed", "failed") and e2e and not e2e.get("skipped") and "error" not in e2e:
        common = dict(task_type="text-generation", dataset_type="hybrid-build/validate-texts",
                      dataset_name="teacher-forced texts (hybrid-build validate)",
                      metric_config=f"{tool} validate, engine {e2e.get('engine', 'streamed')}",
                      metric_args={"engine": e2e.get("engine"), "tokens": e2e.get("tokens"), "passed": v.passed})
        for key, mtype, name in (("kl", "kl_divergence", "mean KL(source || hybrid)"),
                                 ("top1_agreement", "top1_agreement", "same top-1 token as the source"),
                                 ("ppl_change", "perplexity_change", "perplexity change vs the source")):
            if isinstance(e2e.get(key), (int, float)) and math.isfinite(e2e[key]):
                out.append(EvalResult(metric_type=mtype, metric_value=float(f"{e2e[key]:.6g}"), metric_name=name,
                                      **common))
    b = inp.bench
    if b:
        args = {k: b.get(k) for k in ("runs", "max_tokens", "temperature", "speculative")}
        for r in b.get("results") or []:
            if isinstance(r, dict) and isinstance(r.get("decode_tok_s"), (int, float)):
                out.append(EvalResult(task_type="text-generation", dataset_type="hybrid-build/bench-workloads",
                                      dataset_name=f"{r.get('workload')} (hybrid-build bench)",
                                      dataset_config=str(r.get("workload")),
                                      metric_type="decode_tokens_per_second",
                                      metric_value=round(float(r["decode_tok_s"]), 2),
                                      metric_name="decode tok/s, single stream", metric_args=args,
                                      metric_config=f"{tool} bench, {b.get('runs', '?')} runs, "
                                                    f"{b.get('max_tokens', '?')} tokens"))
    return out


def validation_figures(report: dict) -> list[tuple[str, object, str, object]]:
    """(figure, value, threshold name, threshold) rows: the headline numbers of validation.json."""
    t = report.get("thresholds") or {}
    weights = report.get("weights") or []
    fp8 = [w for w in weights if w.get("kind") == "fp8"]
    int8 = [w for w in weights if w.get("kind") == "int8"]
    acts = report.get("activations") or []
    head = report.get("lm_head") or {}
    e2e = report.get("end_to_end") or {}

    def worst(rows, key, fn=max):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return fn(vals) if vals else None

    rows = []
    if fp8:
        rows += [("FP8 shared experts: worst weight relative error", worst(fp8, "rel_error"),
                  "fp8_max_rel_error", t.get("fp8_max_rel_error")),
                 ("FP8 shared experts: worst 128x128 block relative error", worst(fp8, "max_block_rel_error"),
                  "fp8_max_block_rel_error", t.get("fp8_max_block_rel_error")),
                 ("FP8 shared experts: lowest cosine", worst(fp8, "cosine", min), "min_cosine", t.get("min_cosine"))]
    if int8:
        rows += [("int8 lm-head: weight relative error", worst(int8, "rel_error"),
                  "int8_max_rel_error", t.get("int8_max_rel_error")),
                 ("int8 lm-head: worst row relative error", worst(int8, "max_row_rel_error"),
                  "int8_max_row_rel_error", t.get("int8_max_row_rel_error"))]
    if acts:
        rows.append(("shared-expert MLP output: worst relative error", worst(acts, "rel_error"),
                     "mlp_max_rel_error", t.get("mlp_max_rel_error")))
    if head:
        rows += [("lm-head logits: top-1 agreement", head.get("top1_agreement"), "head_min_top1",
                  t.get("head_min_top1")),
                 ("lm-head logits: top-5 overlap", head.get("top5_overlap"), "head_min_top5_overlap",
                  t.get("head_min_top5_overlap")),
                 ("lm-head logits: KL", head.get("kl"), "head_max_kl", t.get("head_max_kl"))]
    if e2e and not e2e.get("skipped") and "error" not in e2e:
        rows += [("end to end: KL divergence from the source", e2e.get("kl"), "e2e_max_kl", t.get("e2e_max_kl")),
                 ("end to end: top-1 agreement", e2e.get("top1_agreement"), "e2e_min_top1", t.get("e2e_min_top1")),
                 ("end to end: perplexity change", e2e.get("ppl_change"), "e2e_max_ppl_change",
                  t.get("e2e_max_ppl_change"))]
    return rows


def _banner(inp: CardInputs) -> list[str]:
    v = inp.validation
    if v.passed:
        return []
    what = {"missing": "there is no validation report",
            "stale": "the validation report is older than the build",
            "failed": "the validation report says FAILED",
            "could not run": "validation could not run where it was tried"}.get(v.state, v.state)
    lines = [f"> **Warning:** published with `--force`: {what}."]
    if v.reason:
        lines.append(f"> {v.reason}")
    lines.append("> Do not rely on this checkpoint's quality until it validates.")
    return lines + [""]


def _local_drafter(profile: dict) -> str | None:
    """The DFlash drafter of a profile when it was a folder on the build machine (the demo's
    ``{source}-dflash``): not in the repository, nothing a reader can load. None otherwise."""
    spec = profile.get("speculative") or {}
    model = str(spec.get("model") or "")
    return model if spec.get("method") == "dflash" and model and not HUB_ID.match(model) else None


def _serve_section(inp: CardInputs) -> list[str]:
    """How to serve, in a copy of the repository (``.``): commands that run as printed wherever the
    artifact is published; a drafter that is not in the repository is said in words, not as a
    command with a name to fill in."""
    recipe = inp.provenance.recipe
    profiles = (recipe.get("serve") or {}).get("profiles") or {}
    dense = profiles.get("dense") or {}
    fmt = _format_of(inp.provenance)
    lines = ["## How to serve", "",
             "In a copy of this repository (`hf download` with this page's repository id and `--local-dir`, or a "
             "clone), from its folder.", "",
             "With hybrid-build, which serves it with the engine settings measured for this model, from the recipe "
             f"copied into the repository (`{RECIPE}`)"
             + (", and checks the server against its reference before calling it ready" if inp.reference else "")
             + f" (hybrid-build is not on PyPI: {_install_hint()})"]
    local = _local_drafter(dense)
    if local:
        lines[-1] += (". The recipe's `dense` profile drafts with a DFlash drafter that was a folder on the build "
                      "machine and is not in this repository: `hybrid-build serve . --profile dense --drafter` with "
                      "a DFlash drafter for the source model (a Hub id or a folder) serves it.")
        lines.append("")
    else:
        lines[-1] += ":"
        lines += ["", "```bash", "hybrid-build serve . --profile dense", "```", ""]
    if dense.get("description"):
        lines += [f"The `dense` profile: {dense['description']}.", ""]
    others = [p for p in profiles if p != "dense"]
    if others:
        lines += ["Other profiles in the recipe: " + ", ".join(f"`{p}`" for p in others) + ".", ""]
    args = ["vllm", "serve", "."]
    if dense.get("served_model_name"):
        args += ["--served-model-name", str(dense["served_model_name"])]
    if dense.get("max_model_len"):
        args += ["--max-model-len", str(dense["max_model_len"])]
    if dense.get("gpu_memory_utilization"):
        args += ["--gpu-memory-utilization", str(dense["gpu_memory_utilization"])]
    if dense.get("max_num_seqs"):
        args += ["--max-num-seqs", str(dense["max_num_seqs"])]
    if dense.get("enable_prefix_caching") is False:
        args.append("--no-enable-prefix-caching")
    spec = dense.get("speculative") or {}
    if spec.get("method") == "dflash" and spec.get("model") and not local:
        cfg = {"method": "dflash", "model": spec["model"],
               "num_speculative_tokens": spec.get("num_speculative_tokens", 12)}
        if spec.get("revision"):  # the drafter commit the recipe's figures rest on
            cfg["revision"] = spec["revision"]
        if spec.get("attention_backend"):
            cfg["attention_backend"] = spec["attention_backend"]
        args += ["--speculative-config", json.dumps(cfg, separators=(",", ":"))]
    elif spec.get("method") == "mtp":
        args += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens":
                                                     spec.get("num_speculative_tokens", 1)}, separators=(",", ":"))]
    for flag, key in (("--tool-call-parser", "tool_call_parser"), ("--reasoning-parser", "reasoning_parser")):
        if dense.get(key):
            args += [flag, str(dense[key])]
    if dense.get("tool_call_parser"):
        args.append("--enable-auto-tool-choice")
    lines += ["With plain vLLM:", ""]
    int8_head = any(c.get("kind") == "int8" for c in inp.provenance.converted)
    lines += [fmt.serving_note(int8_head), ""]
    lines += ["```bash", " ".join(shlex.quote(a) for a in args), "```", ""]
    if local:
        lines += ["Without a drafter (the recipe's is not published): add `--speculative-config` with a DFlash "
                  "drafter of your own to speculate.", ""]
    if spec.get("method") == "dflash":
        lines += [_drafter_engine_note(dense), ""]
    return lines + _memory_section(inp)


def _drafter_engine_note(dense: dict) -> str:
    """What plain vLLM lacks for the DFlash drafter (docs/serve.md, Agents): no warm-prefix claim."""
    note = ("With plain vLLM the DFlash drafter needs vLLM 0.26.0 or later when its layers mix sliding-window and "
            "full attention (0.25.1 raises NotImplementedError), and a prefix-cache hit with the drafter falls back "
            "to an earlier chunk end on 0.25.1 / 0.26.0 (`hybrid-build serve` adds the runtime fixes `kv_unify` and "
            "`prefix_align`); no warm-prefix time to first token is claimed for plain vLLM.")
    if dense.get("prefix_caching_note"):
        note += f" Prefix caching: {dense['prefix_caching_note']}"
    return note


def render_body(inp: CardInputs) -> str:
    prov = inp.provenance
    src = prov.source
    source = SourceView.of(prov)
    recipe = prov.recipe
    fmt = prov.format or "?"
    name = card_name(prov)
    src_link = source.link()
    conv = inp.converted_bytes
    parts = []
    if "fp8" in conv:
        parts.append(f"{conv['fp8']['modules']} shared-expert projections to FP8 E4M3 with 128x128 block scales")
    if "int8" in conv:
        parts.append("the lm-head to int8 with one scale per output row")
    lines = [f"# {name}", ""] + _banner(inp)
    lines += [f"A hybrid of {src_link}"
              + f", built by hybrid-build {prov.tool.version} with recipe "
              f"`{recipe.get('name', '?')}`, format `{fmt}`. The source's INT4 AutoRound tensors are kept byte for "
              "byte; " + (" and ".join(parts) if parts else "nothing else") + " were converted from BF16, which "
              "cuts the bytes read per decoded token.", ""]

    lines += ["## What was converted", "",
              "| kind | modules | parameters | BF16 bytes | stored bytes | ratio |", "|---|---|---|---|---|---|"]
    for kind, e in sorted(conv.items()):
        ratio = e["stored"] / e["bf16"] if e["bf16"] else float("nan")
        lines.append(f"| {kind} | {e['modules']} | {e['params']:,} | {e['bf16']:,} | {e['stored']:,} | {ratio:.3f} |")
    worst = {}
    for c in prov.converted:
        m = c.get("metrics") or {}
        if isinstance(m.get("rel_error"), (int, float)):
            worst[c.get("kind")] = max(worst.get(c.get("kind"), 0.0), m["rel_error"])
    if worst:
        lines += ["", "Worst relative weight error at conversion: "
                  + ", ".join(f"{k} {_g(v)}" for k, v in sorted(worst.items())) + "."]
    t = prov.tensors
    lines += ["", f"Tensors: {t.get('total', '?')} in all, {t.get('copied', '?')} copied unchanged from the source.",
              ""]

    # the source's safetensors files, as the row says: its config, tokenizer and index are not weights
    src_bytes = sum((f or {}).get("bytes", 0) for p, f in (src.get("files") or {}).items()
                    if p.endswith(".safetensors"))
    # the weights only: a report may be safetensors too (the reference)
    weights_after = sum(b for p, b in inp.files.items() if p.endswith(".safetensors") and not is_report(p))
    lines += ["## Sizes", "", "| what | bytes | size |", "|---|---|---|",
              f"| source weights (safetensors) | {src_bytes:,} | {human_bytes(src_bytes)} |",
              f"| hybrid weights (safetensors) | {weights_after:,} | {human_bytes(weights_after)} |",
              f"| all published files (this card aside) | {sum(inp.files.values()):,} | "
              f"{human_bytes(sum(inp.files.values()))} |", ""]
    if src_bytes:
        lines += [f"Weights change by {(weights_after - src_bytes) / src_bytes:+.2%} on disk.", ""]

    lines += _validation_section(inp)
    lines += _eval_section(inp)
    lines += _bench_section(inp)
    lines += _serve_section(inp)
    lines += _provenance_section(inp)
    lines += ["## License", ""]
    if inp.license.known:
        lines += [f"`{inp.license.license}`, carried over from {inp.license.origin}: the terms of "
                  f"{src_link} apply.", ""]
    else:
        lines += [f"The license of the source could not be determined ({inp.license.origin}); the metadata says "
                  f"`{UNKNOWN_LICENSE}`. The terms of {src_link} apply: check them and set the license before "
                  "sharing this repository.", ""]
    return "\n".join(lines)


def _install_hint() -> str:
    """Where to get hybrid-build: the source address its package metadata declares (pyproject's
    ``[project.urls]``), or, where it declares none, the step and the fact that no address is known."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("hybrid-build").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("source", "repository", "homepage") and url.strip():
            return f"install it from its source, {url.strip()}, with `pip install -e .` in a clone"
    return ("install it from its source with `pip install -e .` in a clone of the project; this build's "
            "hybrid-build declares no address for it")


def _what_validation_ran(rep: dict) -> str:
    """The checks the report says ran, in words: the card claims no check that did not run."""
    from hybrid_build.validate.report import checks_that_ran

    ran = checks_that_ran(rep)
    said = ["every converted tensor dequantized and compared with the BF16 source"]
    if {"activations", "lm_head"} & ran:
        said.append("the shared-expert MLPs and the lm-head run on the same inputs")
    if "end_to_end" in ran:
        said.append("a teacher-forced end-to-end comparison with the source model")
    else:
        e2e = rep.get("end_to_end") or {}
        why = "it could not run: " + e2e["could_not_run"] if e2e.get("could_not_run") else "it was skipped"
        said.append(f"no end-to-end comparison with the source model ({why})")
    return ", ".join(said[:-1]) + ", and " + said[-1]


def _validation_section(inp: CardInputs) -> list[str]:
    v = inp.validation
    rep = v.report
    lines = ["## Validation", ""]
    if v.state == "missing":
        return lines + ["No validation report: this artifact was published without being validated.", ""]
    state = {"passed": "passed", "failed": "**FAILED**", "stale": "from an earlier build (stale)"}.get(v.state, v.state)
    lines += [f"Validation {state}: {_what_validation_ran(rep)}.", ""]
    rows = validation_figures(rep)
    if rows:
        lines += ["| figure | value | threshold |", "|---|---|---|"]
        lines += [f"| {name} | {_g(val)} | {tname} {_g(tval)} |" for name, val, tname, tval in rows]
        lines.append("")
    checks = rep.get("checks") or []
    if checks:
        lines += ["| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c.get('name')} | {'pass' if c.get('passed') else '**FAIL**'} | "
                  f"{str(c.get('detail', '')).replace('|', '/')} |" for c in checks]
        lines.append("")
    failures = rep.get("failures") or []
    if failures:
        lines += ["Failures:", ""] + [f"- {f}" for f in failures[:20]]
        if len(failures) > 20:
            lines.append(f"- ... and {len(failures) - 20} more (see `{VALIDATION.main}`)")
        lines.append("")
    if VALIDATION.named(".png") in inp.files:  # a link that works on the Hub: the picture is uploaded with the card
        lines += [f"![relative error per layer]({VALIDATION.named('.png')})", ""]
    lines += [f"Per-tensor figures: `{VALIDATION.named('.md')}`; machine-readable: `{VALIDATION.main}`.", ""]
    return lines + _reference_lines(inp)


def _reference_lines(inp: CardInputs) -> list[str]:
    """What the reference is and proves, when it travels with this build."""
    ref = REPORTS["reference"]
    if not inp.reference or not all(f in inp.files for f in ref.files):
        return []
    size = sum(inp.files[f] for f in ref.files)
    return [f"Reference: `{ref.named('.safetensors')}` and `{ref.main}` ({size / 1e6:.2g} MB) hold this hybrid's own "
            "next-token distributions on the validation texts (top-20 token ids and log-probabilities per position, "
            "and the source's alongside), computed in fp32 from the dequantized weights of this build. "
            "`hybrid-build verify URL` checks a running server against it: a server whose prompt log-probabilities "
            "match computes this checkpoint's numerics (its kernels and runtime patches included) on these texts; "
            "it proves nothing about other texts or about sampling settings.", ""]


def _eval_section(inp: CardInputs) -> list[str]:
    ev = inp.evaluation
    if ev is None:
        return []
    lines = ["## Task accuracy", ""]
    if not ev.current:
        return lines + [f"`{EVAL.main}` is in this repository but its figures are not shown: {ev.reason}. "
                        "Run `hybrid-build eval` on this build to measure them.", ""]
    from hybrid_build.validate.eval.task_eval import markdown_rows, settings_line

    rep = ev.report
    try:
        rows = markdown_rows(rep)
        settings = settings_line(rep)
    except (KeyError, TypeError, ValueError) as e:
        return lines + [f"`{EVAL.main}` could not be read ({type(e).__name__}: {e}).", ""]
    models = rep.get("models") or {}
    lines += [f"lm-evaluation-harness on the source and on this hybrid, same tasks and settings ({settings}). "
              "Accuracy in percent; difference = hybrid - source with a 95% interval over the paired examples; "
              "recovery = hybrid / source; p: exact McNemar test on the examples only one of the two got right "
              "(p >= 0.05: within noise).", "", *rows, ""]
    backend = (rep.get("settings") or {}).get("backend")
    if backend == "hf":
        lines += ["Measured with transformers (float32): the hybrid's stored weights, dequantized, in the source "
                  "model; a serving engine's kernels can differ slightly.", ""]
    elif backend:
        names = ", ".join(f"{role} `{(m or {}).get('name')}`" for role, m in models.items())
        lines += [f"Measured against running servers ({names}).", ""]
    lines += [f"Per-example results: `{EVAL.main}`.", ""]
    return lines


def _bench_section(inp: CardInputs) -> list[str]:
    b = inp.bench
    if not b:
        return []
    lines = ["## Speed", "",
             f"`hybrid-build bench`: single stream, temperature {b.get('temperature', 0)}, {b.get('runs', '?')} "
             f"measured runs per workload, {b.get('max_tokens', '?')} tokens each"
             + (", speculative decoding on" if b.get("speculative") else "")
             + ". The hardware it ran on is not recorded in the report.", "",
             "| workload | decode tok/s | end-to-end tok/s | time to first token (s) | mean acceptance length |",
             "|---|---|---|---|---|"]
    for r in b.get("results") or []:
        if not isinstance(r, dict):
            continue
        acc = (r.get("acceptance") or {}).get("mean_acceptance_length")
        lines.append(f"| {r.get('workload')} | {_g(r.get('decode_tok_s'), '.1f')} | {_g(r.get('e2e_tok_s'), '.1f')} | "
                     f"{_g(r.get('ttft_s'), '.3f')} | {_g(acc, '.2f')} |")
    return lines + ["", f"Raw figures: `{REPORTS['bench'].main}`.", ""]


def _provenance_section(inp: CardInputs) -> list[str]:
    prov = inp.provenance
    source = SourceView.of(prov)
    if source.hub:
        src_line = f"- source: {source.link()}"
    else:
        src_line = f"- source: a local checkpoint, folder `{source.name}`"
        if source.fingerprint:
            src_line += (f", content sha256 `{source.fingerprint}` (over every file's sha256, in the manifest)"
                         if source.content else f", fingerprint `{source.fingerprint}` (of its headers and sizes)")
    lines = ["## Provenance", "",
             f"- tool: {prov.tool.name} {prov.tool.version}",
             *([f"- built: {prov.created}"] if prov.created else []),
             src_line,
             f"- recipe: `{prov.recipe.get('name', '?')}` (resolved copy: `{RECIPE}`)",
             f"- format: `{prov.format or '?'}`",
             f"- manifest: `{PROVENANCE}` (sha256 of every file below, every converted module and "
             "its error metrics)", "",
             "<details><summary>Files and sha256</summary>", "", "| file | bytes | sha256 |", "|---|---|---|"]
    for path, f in sorted(prov.files.items()):
        lines.append(f"| `{path}` | {f.bytes:,} | `{f.sha256}` |")
    lines += ["", "</details>", ""]
    return lines


def render_card(inp: CardInputs) -> ModelCard:
    """The card: YAML metadata from ``ModelCardData`` and the body above."""
    data = card_data(inp)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{render_body(inp)}")
