"""The checks of ``hybrid-build validate``: structure, weights, activations and the lm-head.

Each check reads the artifact (and the source it was built from) one tensor, or one row chunk of
the lm-head, at a time, so memory stays at one module's worth plus the lm-head's logits for a few
hundred hidden states. A check never raises for a bad artifact: it records findings (a failure
line that names the tensor and the metric) in ``Findings``; only input that cannot be read at all
raises, before any check runs.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid_build.calibration.fp8_block import BLOCK, dequantize_fp8_block
from hybrid_build.calibration.metrics import StreamingMetrics, error_metrics
from hybrid_build.core.artifact import CARD, CONFIG, META_DIR, PROVENANCE, QUANT_CONFIG
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.formats.base import OutputFormat
from hybrid_build.core.integrity import check_artifact
from hybrid_build.core.manifest import sha256_file
from hybrid_build.core.progress import ProgressFactory, close_bar, null_progress  # noqa: F401
from hybrid_build.core.provenance import Provenance
from hybrid_build.core.safetensors_io import INDEX_NAME
from hybrid_build.core.tensor_classes import layer_index, split_module
from hybrid_build.recipes.conversion import ConversionPlan
from hybrid_build.recipes.schema import Recipe, ValidateSpec

log = logging.getLogger(__name__)

COMPARE_CHUNK = 64 * 1024 * 1024
ACT_TOKENS = 128  # random inputs per shared-expert MLP
HEAD_TOKENS = 256  # random hidden states for the lm-head check
SEED = 1234

_close = close_bar


def exceeds(value: float, limit: float) -> bool:
    """NaN-safe ``value > limit``: a NaN metric fails."""
    return not (value <= limit)


def below(value: float, limit: float) -> bool:
    return not (value >= limit)


# ------------------------------------------------------------------------------------- rates on samples

ALPHA = 0.01  # how often an artifact whose true rate is exactly at its threshold may fail a rate check


def binomial_cdfs(n: int, p: float) -> list[float]:
    """P(X <= k) for k = 0..n, X ~ Binomial(n, p): running sums of the terms, each from
    log-probabilities (lgamma), so no factorial overflows at any n."""
    if p <= 0.0:
        return [1.0] * (n + 1)
    if p >= 1.0:
        return [0.0] * n + [1.0]
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    out, total = [], 0.0
    for i in range(n + 1):
        total += math.exp(ln - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
        out.append(min(1.0, total))
    out[-1] = 1.0
    return out


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return 0.0 if k < 0 else 1.0 if k >= n else binomial_cdfs(n, p)[k]


@dataclass
class RateTest:
    """A rate (top-1 agreement: ``agree`` of ``n`` positions) judged against a lower threshold ``t``
    on a sample. It fails only when a one-sided binomial test rejects "the true rate is at least t"
    at ``alpha``: P(X <= agree | n, t) < alpha. An artifact whose true rate is at least ``t`` then
    fails at most ``alpha`` of the time, however small the sample; the plain ``agree / n < t`` fails
    such an artifact about half the time at small n (one miss in 42 positions is already 2.4%).
    ``fail_at`` is the largest count that fails (-1: at this n no count can, and the rate is not
    judged: the sample is too small)."""

    rate: float
    agree: int
    n: int
    threshold: float
    alpha: float
    p_value: float
    fail_at: int

    @property
    def judged(self) -> bool:
        return self.fail_at >= 0

    @property
    def fails(self) -> bool:
        return not math.isfinite(self.rate) or self.p_value < self.alpha * (1 - 1e-9)  # rounding is not evidence

    def reason(self, label: str, name: str) -> str:
        """The failure line: the rate, the sample and the test that rejected it."""
        if not math.isfinite(self.rate):
            return f"{label} {self.rate} is not a number ({name})"
        return (f"{label} {self.rate:.4f} ({self.agree}/{self.n}) < {self.threshold} ({name}): one-sided binomial "
                f"P(X <= {self.agree} | n={self.n}, p={self.threshold}) = {self.p_value:.2g} < {self.alpha}")

    def note(self) -> str:
        """What the sample can show, for the check's detail."""
        if not self.judged:
            return (f"{self.n} positions: too few to judge against {self.threshold} (even 0/{self.n} has "
                    f"P = {binomial_cdf(0, self.n, self.threshold):.2g} >= {self.alpha})")
        return f"{self.agree}/{self.n}; fails at <= {self.fail_at}/{self.n} (binomial, alpha {self.alpha})"

    def to_json(self) -> dict:
        return {"agree": self.agree, "n": self.n, "threshold": self.threshold, "alpha": self.alpha,
                "p_value": self.p_value, "fail_at_or_below": self.fail_at, "judged": self.judged,
                "fails": self.fails}


def rate_test(rate: float, n: int, threshold: float, alpha: float = ALPHA) -> RateTest:
    """``RateTest`` of an observed ``rate`` over ``n`` positions (a NaN rate fails)."""
    agree = int(round(rate * n)) if math.isfinite(rate) else 0
    cdfs = binomial_cdfs(n, threshold)
    fail_at = max((k for k, c in enumerate(cdfs) if c < alpha * (1 - 1e-9)), default=-1)
    p = cdfs[min(max(agree, 0), n)] if math.isfinite(rate) else 0.0
    return RateTest(rate, agree, n, threshold, alpha, p, fail_at)


@dataclass
class Findings:
    """Failure lines and a short detail per named check, in the order checks ran."""

    details: dict[str, str] = field(default_factory=dict)
    failed: dict[str, list[str]] = field(default_factory=dict)
    could_not_run: dict[str, str] = field(default_factory=dict)  # check -> why (engine, GPU, tool missing)

    def cannot_run(self, check: str, why: str) -> None:
        """The environment could not run ``check``: neither passed nor failed."""
        self.could_not_run[check] = why
        self.details[check] = f"could not run: {why}"

    def fail(self, check: str, line: str) -> None:
        self.failed.setdefault(check, []).append(f"{check}: {line}")
        self.details.setdefault(check, "")

    def note(self, check: str, detail: str) -> None:
        self.details[check] = detail

    @property
    def failures(self) -> list[str]:
        return [line for lines in self.failed.values() for line in lines]


@dataclass
class ValidationInputs:
    artifact: Checkpoint
    source: Checkpoint
    recipe: Recipe
    provenance: Provenance | None
    plan: ConversionPlan
    progress: ProgressFactory = null_progress
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    activation_labels: dict[str, str] = field(default_factory=dict)  # where an input came from, if not a file

    @property
    def spec(self) -> ValidateSpec:
        return self.recipe.validate_

    @property
    def fmt(self) -> OutputFormat:
        return self.recipe.output.fmt

    @property
    def head_storage(self) -> str:
        return self.recipe.lm_head.storage

    def converted(self, kind: str) -> list[str]:
        return [c.module for c in self.plan.of_kind(kind)]

    def head_quantized(self) -> bool:
        """The head is stored int8 (a BF16 head is copied; the serve plugin quantizes it at load)."""
        return self.fmt.stores_head(self.head_storage)

    def stored_heads(self) -> list[str]:
        return self.converted("int8") if self.head_quantized() else []


# ------------------------------------------------------------------------------------- structure


def expected_parts(inp: ValidationInputs, module: str, kind: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """part -> (dtype, shape) that the output format requires for a converted module."""
    src = inp.source.modules[module]["weight"]
    n, k = src.shape
    if kind == "fp8":
        return inp.fmt.fp8_parts(n, k)
    if not inp.head_quantized():
        return {"weight": (src.dtype, (n, k))}
    return inp.fmt.head_parts(n, k)


def check_index(inp: ValidationInputs, f: Findings) -> None:
    """Index and files agree: every listed file exists and holds what the index says; every
    tensor stored is listed (vLLM reads only the files the index names)."""
    art = inp.artifact
    for p in art.problems:
        if p.severity == "error":
            f.fail("index", p.message)
    if art.index is None:
        f.fail("index", f"{INDEX_NAME} is missing (the build did not finish)")
    else:
        listed = set(art.index.get("weight_map", {}).values())
        for name in sorted(set(art.files) - listed):
            f.fail("index", f"{name} is not listed in the index: vLLM would not load its tensors")
        unlisted = [t.name for t in art.tensors.values() if not t.in_index]
        if unlisted:
            f.fail("index", f"{len(unlisted)} stored tensor(s) not listed in the index, e.g. {unlisted[0]}")
    f.details.setdefault("index", f"{len(art.files)} files, {len(art.tensors)} tensors")


def check_provenance(inp: ValidationInputs, f: Findings) -> None:
    """Every file against provenance.json (``core.integrity``: size and sha256, cached by stat, no
    file the provenance does not list); the converted list against the recipe."""
    prov = inp.provenance
    if prov is None:
        f.fail("provenance", f"{PROVENANCE} is missing or not valid JSON")
        return
    found = check_artifact(inp.artifact.root, prov, inp.progress, reports=False)  # validate rewrites the reports
    for line in found.problems:
        f.fail("provenance", line)
    conv = {c.get("module"): c.get("kind") for c in prov.converted}
    for c in inp.plan.conversions:
        if c.kind == "int8" and not inp.head_quantized():
            continue  # a BF16 head is copied, quantized later by the serve plugin
        if c.module not in conv:
            f.fail("provenance", f"{c.module}: the recipe converts it but {PROVENANCE} does not list it")
        elif conv[c.module] != c.kind:
            f.fail("provenance", f"{c.module}: {PROVENANCE} says {conv[c.module]}, the recipe {c.kind}")
    planned = {c.module for c in inp.plan.conversions}
    for module in sorted(set(conv) - planned):
        f.fail("provenance", f"{module}: listed as converted in {PROVENANCE}, but the recipe does not convert it")
    f.note("provenance", f"{found.matched}/{found.files} files match their sha256 ({found.cached} from the hash cache, "
                         f"{found.hashed} hashed)")


# the files the build writes itself; every other file of the source it copies unchanged
WRITTEN = (CONFIG, QUANT_CONFIG, INDEX_NAME)


def check_copied_files(inp: ValidationInputs, f: Findings) -> None:
    """The files the build copies unchanged from the source (chat template, tokenizer, generation
    config) against the source's sha256, recorded in the provenance and checked against the source
    itself when it was opened (``core.source_identity.open_recorded_source``): a swapped chat template
    or tokenizer fails naming the file, even where the provenance's own entry was rewritten to match;
    so does such a file that the source does not have. The card (``CARD``) is left out: publish
    replaces it."""
    prov = inp.provenance
    if prov is None:
        return
    record = (prov.source or {}).get("files") or {}
    if not any(isinstance(e, dict) and e.get("sha256") for e in record.values()):
        return  # a provenance from before sources were recorded by content: nothing to compare with
    root = inp.artifact.root
    checked = 0
    for name, entry in sorted(record.items()):
        if name.endswith(".safetensors") or name in WRITTEN or name == CARD or not isinstance(entry, dict):
            continue
        path = root / name
        if not path.is_file() or path.is_symlink():
            f.fail("provenance", f"{name}: the source's file is not in the artifact as a regular file")
            continue
        got = sha256_file(path)
        if entry.get("sha256") and got != entry["sha256"]:
            f.fail("provenance", f"{name} is not the source's (sha256 {got[:12]}..., the source's "
                                 f"{entry['sha256'][:12]}...): the build copies it unchanged")
        checked += 1
    for name in sorted(prov.files):
        if (name in record or name.endswith(".safetensors") or name in WRITTEN or name == CARD
                or name.startswith(f"{META_DIR}/")):
            continue
        f.fail("provenance", f"{name} is not a file of the source: the build writes none of that name, and copies "
                             "only the source's")
    before = f.details.get("provenance")
    f.note("provenance", (f"{before}; " if before else "") + f"{checked} file(s) copied from the source checked "
                         "against its sha256")


def check_tensors(inp: ValidationInputs, f: Findings) -> None:
    """Every source tensor accounted for (copied with the same dtype, shape and bytes, or converted
    into exactly the parts its scheme requires), and nothing else in the artifact."""
    src, art = inp.source, inp.artifact
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    copied: list[str] = []
    kinds = {c.module: c.kind for c in inp.plan.conversions}
    for module, parts in src.modules.items():
        kind = kinds.get(module)
        if kind is not None:
            expected.update({f"{module}.{p}": v for p, v in expected_parts(inp, module, kind).items()})
        elif (repacked := inp.fmt.int4_parts(parts)) is not None:
            expected.update({f"{module}.{p}": v for p, v in repacked.items()})
        else:
            for t in parts.values():
                expected[t.name] = (t.dtype, t.shape)
                copied.append(t.name)
    missing = [n for n in expected if n not in art.tensors]
    # tensors of a file whose header cannot be read: one line per file, not one per tensor
    weight_map = (art.index or {}).get("weight_map", {})
    unreadable = {fn for fn in set(weight_map.values()) if fn not in {t.file for t in art.tensors.values()}}
    lost: dict[str, int] = {}
    for name in missing:
        if weight_map.get(name) in unreadable:
            lost[weight_map[name]] = lost.get(weight_map[name], 0) + 1
    for fn, count in sorted(lost.items()):
        f.fail("tensors", f"{count} tensor(s) the index maps to {fn} cannot be read (file missing or damaged)")
    missing = [n for n in missing if weight_map.get(n) not in unreadable]
    for name in missing[:20]:
        origin = "converted" if split_module(name)[0] in kinds else "source"
        f.fail("tensors", f"{name} ({origin} tensor) is missing from the artifact")
    if len(missing) > 20:
        f.fail("tensors", f"... and {len(missing) - 20} more missing tensors")
    extra = sorted(set(art.tensors) - set(expected))
    for name in extra[:20]:
        f.fail("tensors", f"{name} is in the artifact but neither copied from the source nor produced by the recipe")
    for name, (dtype, shape) in expected.items():
        t = art.tensors.get(name)
        if t is not None and (t.dtype != dtype or tuple(t.shape) != tuple(shape)):
            f.fail("tensors", f"{name}: {t.dtype} {list(t.shape)}, the scheme requires {dtype} {list(shape)}")
    f.note("tensors", f"{len(src.tensors)} source tensors: {len(copied)} copied, "
                      f"{len(inp.plan.conversions)} modules converted; {len(art.tensors)} artifact tensors")
    _compare_copied(inp, f, [n for n in copied if n in art.tensors and art.tensors[n].nbytes == src.tensors[n].nbytes])
    _compare_repacked(inp, f, expected)


def _compare_repacked(inp: ValidationInputs, f: Findings, expected: dict) -> None:
    """Repacked INT4 modules (a format whose ``int4_parts`` are not the source's) must hold the
    source's codes and scales bit for bit; the format says how to read them back."""
    converted = {c.module for c in inp.plan.conversions}
    repacked = {m: p for m, parts in inp.source.modules.items() if m not in converted
                and (p := inp.fmt.int4_parts(parts)) is not None}
    if not repacked:
        return
    art, src = _Reader(inp.artifact), _Reader(inp.source)
    bar = inp.progress(total=len(repacked), desc="compare INT4 repack", unit="module")
    bad = 0
    for module, parts in sorted(repacked.items()):
        bar.update(1)
        if not _readable(inp.artifact, module, list(parts)):
            continue
        if not inp.fmt.int4_matches(art, src, module, inp.source.tensors[module + ".qweight"].shape):
            bad += 1
            if bad <= 20:
                f.fail("tensors", f"{module}: repacked INT4 tensors do not hold the source's qweight/scales")
    _close(bar)


def _compare_copied(inp: ValidationInputs, f: Findings, names: list[str]) -> None:
    """Copied tensors must be the source's bytes; compared in bounded chunks."""
    total = sum(inp.source.tensors[n].nbytes for n in names)
    bar = inp.progress(total=total, desc="compare copied tensors", unit="B", unit_scale=True)
    bad = 0
    handles: dict[Path, object] = {}
    try:
        for name in names:
            s, a = inp.source.tensors[name], inp.artifact.tensors[name]
            if not _same_bytes(handles, inp.source.path_of(s), s.start, inp.artifact.path_of(a), a.start, s.nbytes):
                bad += 1
                if bad <= 20:
                    f.fail("tensors", f"{name}: copied tensor differs from the source's bytes")
            bar.update(s.nbytes)
    finally:
        for h in handles.values():
            h.close()  # type: ignore[attr-defined]
        _close(bar)
    if bad > 20:
        f.fail("tensors", f"... and {bad - 20} more copied tensors differ from the source")


def _same_bytes(handles: dict, p1: Path, o1: int, p2: Path, o2: int, n: int) -> bool:
    for p in (p1, p2):
        if p not in handles:
            handles[p] = open(p, "rb")
    f1, f2 = handles[p1], handles[p2]
    done = 0
    while done < n:
        step = min(COMPARE_CHUNK, n - done)
        f1.seek(o1 + done)
        f2.seek(o2 + done)
        if f1.read(step) != f2.read(step):
            return False
        done += step
    return True


def check_config(inp: ValidationInputs, f: Findings) -> None:
    """The quantization config declares each converted module's scheme, as formats.md specifies."""
    art = inp.artifact
    info = art.hybrid_info
    if not info:
        f.fail("scheme", "config.json has no hybrid_build block")
    else:
        if info.get("format") != inp.fmt.name:
            f.fail("scheme",
                   f"config.json hybrid_build.format is {info.get('format')!r}, the recipe says {inp.fmt.name!r}")
        listed = set(info.get("fp8_modules") or [])
        if listed and listed != set(inp.converted("fp8")):
            f.fail("scheme", f"config.json hybrid_build.fp8_modules lists {len(listed)} modules, "
                             f"the recipe converts {len(inp.converted('fp8'))}")
    failures, detail = inp.fmt.config_problems(art.quant, inp.converted("fp8"), inp.stored_heads())
    for line in failures:
        f.fail("scheme", line)
    f.details.setdefault("scheme", detail)


# ------------------------------------------------------------------------------------- reading


def _readable(art: Checkpoint, module: str, parts: list[str]) -> bool:
    return all(f"{module}.{p}" in art.tensors for p in parts)


_NUMPY_DTYPES = {"I32": "int32", "F16": "float16", "F32": "float32", "BF16": "uint16", "I8": "int8", "U8": "uint8"}


def _read(ckpt: Checkpoint, name: str, cols: slice | None = None) -> torch.Tensor:
    t = ckpt.tensors[name]
    if cols is None or t.dtype not in _NUMPY_DTYPES or len(t.shape) != 2:
        with safe_open(str(ckpt.path_of(t)), framework="pt") as fh:
            return fh.get_tensor(name) if cols is None else fh.get_slice(name)[:, cols]
    # A column block of a row-major tensor through a memory map: only the touched pages are read.
    # (The GPTQ head's qweight is [K/4, N]; a safetensors slice over columns read all 763 MB of it
    # for every 4k-row chunk of the head check.)
    import numpy as np

    mm = np.memmap(ckpt.path_of(t), dtype=_NUMPY_DTYPES[t.dtype], mode="r", offset=t.start, shape=t.shape)
    out = torch.from_numpy(np.array(mm[:, cols]))  # a copy: the map is read-only
    return out.view(torch.bfloat16) if t.dtype == "BF16" else out


def _count_bad_scale(s: torch.Tensor) -> tuple[int, int, int]:
    s = s.float()
    return int(torch.isnan(s).sum()), int(torch.isinf(s).sum()), int((s <= 0).sum())


def _scale_findings(f: Findings, name: str, s: torch.Tensor) -> bool:
    nan, inf, nonpos = _count_bad_scale(s)
    for count, what in ((nan, "NaN"), (inf, "Inf"), (nonpos, "zero or negative")):
        if count:
            f.fail("finite", f"{name}: {count} {what} scale value(s)")
    return not (nan or inf or nonpos)


def fp8_nan_codes(q: torch.Tensor) -> int:
    """float8_e4m3fn has no Inf; S.1111.111 is NaN."""
    return int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())


# ------------------------------------------------------------------------------------- weights


def block_rel_errors(ref: torch.Tensor, approx: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Relative Frobenius error of every [block, block] tile: [ceil(N/b), ceil(K/b)]."""
    n, k = ref.shape
    nb, kb = -(-n // block), -(-k // block)
    pad = (0, kb * block - k, 0, nb * block - n)
    r = torch.nn.functional.pad(ref.double(), pad).reshape(nb, block, kb, block)
    e = torch.nn.functional.pad((approx.double() - ref.double()), pad).reshape(nb, block, kb, block)
    rn = r.pow(2).sum(dim=(1, 3)).sqrt()
    en = e.pow(2).sum(dim=(1, 3)).sqrt()
    return torch.where(rn > 0, en / rn, torch.where(en > 0, torch.full_like(en, math.inf), torch.zeros_like(en)))


def row_rel_errors(ref: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    rn = ref.double().norm(dim=1)
    en = (approx.double() - ref.double()).norm(dim=1)
    return torch.where(rn > 0, en / rn, torch.where(en > 0, torch.full_like(en, math.inf), torch.zeros_like(en)))


def load_fp8(inp: ValidationInputs, module: str, f: Findings) -> torch.Tensor | None:
    """The converted module dequantized, or None (with findings) when its parts are missing or broken."""
    art = inp.artifact
    scale_part = inp.fmt.fp8_scale_part
    if not _readable(art, module, ["weight", scale_part]):
        f.fail("weights", f"{module}: cannot be checked, its tensors are missing")
        return None
    q = _read(art, module + ".weight")
    s = _read(art, f"{module}.{scale_part}")
    ok = _scale_findings(f, f"{module}.{scale_part}", s)
    if q.dtype != torch.float8_e4m3fn:
        f.fail("weights", f"{module}.weight: dtype {q.dtype}, expected float8_e4m3fn")
        return None
    nan = fp8_nan_codes(q)
    if nan:
        f.fail("finite", f"{module}.weight: {nan} NaN FP8 code(s)")
        ok = False
    n, k = q.shape
    if tuple(s.shape) != (-(-n // BLOCK), -(-k // BLOCK)):
        f.fail("weights",
               f"{module}: scale shape {list(s.shape)} does not tile weight {[n, k]} in {BLOCK}x{BLOCK} blocks")
        return None
    w = dequantize_fp8_block(q, s)
    if not ok:
        log.debug("%s has non-finite or non-positive scales; metrics will show it", module)
    return w


def check_fp8_weights(inp: ValidationInputs, f: Findings) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Dequantized FP8 vs BF16 source for every shared-expert projection. Returns the entries and
    the dequantized weights by module (small: 3 x 3072 x 1024 per layer) for the activation check."""
    spec = inp.spec
    entries: list[dict] = []
    keep: dict[str, torch.Tensor] = {}
    modules = inp.converted("fp8")
    bar = inp.progress(total=len(modules), desc="check FP8 weights", unit="tensor")
    for module in modules:
        bar.update(1)
        w = load_fp8(inp, module, f)
        if w is None:
            continue
        ref = _read(inp.source, module + ".weight").float()
        m = error_metrics(ref, w)
        blocks = block_rel_errors(ref, w)
        flat = int(torch.nan_to_num(blocks, nan=math.inf).argmax())
        worst = [flat // blocks.shape[1], flat % blocks.shape[1]]
        worst_val = float(blocks.reshape(-1)[flat])
        entry = {"module": module, "kind": "fp8", "layer": layer_index(module), "shape": list(ref.shape), **m,
                 "max_block_rel_error": worst_val, "worst_block": worst}
        reasons = []
        if exceeds(m["rel_error"], spec.fp8_max_rel_error):
            reasons.append(f"relative error {m['rel_error']:.4g} > {spec.fp8_max_rel_error} (fp8_max_rel_error)")
        if below(m["cosine"], spec.min_cosine):
            reasons.append(f"cosine {m['cosine']:.6g} < {spec.min_cosine} (min_cosine)")
        if exceeds(worst_val, spec.fp8_max_block_rel_error):
            bad = int((~(blocks <= spec.fp8_max_block_rel_error)).sum())
            reasons.append(f"block {worst} relative error {worst_val:.4g} > {spec.fp8_max_block_rel_error} "
                           f"(fp8_max_block_rel_error; {bad} of {blocks.numel()} blocks over)")
        entry["passed"] = not reasons
        for r in reasons:
            f.fail("weights", f"{module}: {r}")
        entries.append(entry)
        keep[module] = w
    _close(bar)
    return entries, keep


# ------------------------------------------------------------------------------------- lm-head


class _Reader:
    """A checkpoint's tensors as the output formats read them back (``formats.base.TensorReader``)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    def read(self, name: str, cols: slice | None = None) -> torch.Tensor:
        return _read(self.ckpt, name, cols)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        t = self.ckpt.tensors[name]
        with safe_open(str(self.ckpt.path_of(t)), framework="pt") as fh:
            return fh.get_slice(name)[lo:hi]


def _head_rows(inp: ValidationInputs, module: str, lo: int, hi: int) -> torch.Tensor:
    """Rows lo:hi of the converted head, dequantized, read without the rest."""
    if not inp.head_quantized():
        return _Reader(inp.artifact).rows(module + ".weight", lo, hi).float()
    return inp.fmt.head_rows(_Reader(inp.artifact), module, lo, hi)


def head_parts(inp: ValidationInputs, module: str) -> list[str]:
    if not inp.head_quantized():
        return ["weight"]
    return list(inp.fmt.head_parts(*inp.source.tensors[module + ".weight"].shape))


def _head_structure(inp: ValidationInputs, module: str, f: Findings) -> bool:
    """Scales finite and positive, and what else the format requires of a stored head (zeros)."""
    if not inp.head_quantized():
        return True
    scale = f"{module}.{inp.fmt.head_scale_part}"
    ok = _scale_findings(f, scale, _read(inp.artifact, scale))
    for line in inp.fmt.head_problems(_Reader(inp.artifact), module):
        f.fail("finite", line)
        ok = False
    return ok


def head_hidden_states(inp: ValidationInputs, k: int) -> torch.Tensor:
    """Calibration hidden states when given, else unit-RMS normals scaled by the final norm, as
    the real hidden states reach the head (Qwen3.5's RMSNorm multiplies by 1 + weight)."""
    given = inp.activations.get("lm_head")
    if given is not None:
        return given.float().reshape(-1, k)
    gen = torch.Generator().manual_seed(SEED)
    h = torch.randn(HEAD_TOKENS, k, generator=gen)
    norm = inp.source.lm_prefix + "norm.weight"
    if norm in inp.source.tensors:
        h = h * (1.0 + _read(inp.source, norm).float())
    return h


def check_head(inp: ValidationInputs, f: Findings) -> tuple[list[dict], dict]:
    """int8 lm-head vs BF16 source, streamed in row chunks: weight metrics and the worst row, and
    logits on hidden states: top-1 agreement, top-5 overlap, KL(source || int8), max logit error."""
    spec = inp.spec
    modules = inp.converted("int8")
    if not modules:
        return [], {}
    module = modules[0]
    if not _readable(inp.artifact, module, head_parts(inp, module)):
        f.fail("lm_head", f"{module}: cannot be checked, its tensors are missing")
        return [], {"module": module, "passed": False}
    _head_structure(inp, module, f)
    n, k = inp.source.tensors[module + ".weight"].shape
    h = head_hidden_states(inp, k)
    chunk = inp.recipe.lm_head.chunk_rows
    ref_logits = torch.empty(h.shape[0], n)
    hyb_logits = torch.empty(h.shape[0], n)
    m = StreamingMetrics()
    row_err = torch.empty(n, dtype=torch.float64)
    bar = inp.progress(total=n, desc=f"check {module}", unit="row")
    with safe_open(str(inp.source.path_of(inp.source.tensors[module + ".weight"])), framework="pt") as fh:
        src = fh.get_slice(module + ".weight")
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            ref = src[lo:hi].float()
            w = _head_rows(inp, module, lo, hi)
            m.update(ref, w)
            row_err[lo:hi] = row_rel_errors(ref, w)
            ref_logits[:, lo:hi] = h @ ref.t()
            hyb_logits[:, lo:hi] = h @ w.t()
            bar.update(hi - lo)
    _close(bar)
    wm = m.result()
    worst_row = int(torch.nan_to_num(row_err, nan=math.inf).argmax())
    worst_val = float(row_err[worst_row])
    quantized = inp.head_quantized()
    entry = {"module": module, "kind": "int8" if quantized else "bf16", "layer": None, "shape": [n, k], **wm,
             "max_row_rel_error": worst_val, "worst_row": worst_row}
    reasons = []
    if quantized:
        if exceeds(wm["rel_error"], spec.int8_max_rel_error):
            reasons.append(f"relative error {wm['rel_error']:.4g} > {spec.int8_max_rel_error} (int8_max_rel_error)")
        if below(wm["cosine"], spec.min_cosine):
            reasons.append(f"cosine {wm['cosine']:.6g} < {spec.min_cosine} (min_cosine)")
        if exceeds(worst_val, spec.int8_max_row_rel_error):
            bad = (~(row_err <= spec.int8_max_row_rel_error)).nonzero().reshape(-1).tolist()
            reasons.append(f"row {worst_row} relative error {worst_val:.4g} > {spec.int8_max_row_rel_error} "
                           f"(int8_max_row_rel_error; {len(bad)} row(s) over: {bad[:8]})")
    elif exceeds(wm["rel_error"], 0.0):
        reasons.append(f"BF16 lm-head differs from the source (relative error {wm['rel_error']:.4g})")
    entry["passed"] = not reasons
    for r in reasons:
        f.fail("weights", f"{module}: {r}")

    logits = logit_metrics(ref_logits, hyb_logits)
    head = {"module": module, "tokens": int(h.shape[0]),
            "inputs": inp.activation_labels.get("lm_head", "calibration") if "lm_head" in inp.activations
            else "random (final-norm scale)", **logits}
    lreasons = []
    # one position in a few dozen is already a few percent: judged by a binomial bound on the sample
    top1 = rate_test(logits["top1_agreement"], int(h.shape[0]), spec.head_min_top1)
    head["top1_test"] = top1.to_json()
    if top1.fails:
        lreasons.append(top1.reason("top-1 agreement", "head_min_top1"))
    if below(logits["top5_overlap"], spec.head_min_top5_overlap):
        lreasons.append(f"top-5 overlap {logits['top5_overlap']:.4f} < {spec.head_min_top5_overlap} "
                        "(head_min_top5_overlap)")
    if exceeds(logits["kl"], spec.head_max_kl):
        lreasons.append(f"KL {logits['kl']:.4g} > {spec.head_max_kl} (head_max_kl)")
    for r in lreasons:
        f.fail("lm_head", f"{module}: {r}")
    head["passed"] = not lreasons
    f.note("lm_head", f"top-1 {logits['top1_agreement']:.4f} ({top1.note()}), top-5 overlap "
                      f"{logits['top5_overlap']:.4f}, KL {logits['kl']:.3g}, "
                      f"max logit error {logits['max_logit_error']:.3g}")
    return [entry], head


def logit_metrics(ref: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Agreement of two [T, V] logit matrices: KL(ref || approx) per token (mean and max), top-1
    agreement, top-5 overlap, max absolute logit error. Computed 16 tokens at a time: in float64
    over a 248,320-token vocabulary the whole matrix's temporaries would take gigabytes."""
    kls, top1, overlaps, max_err = [], [], [], 0.0
    k = min(5, ref.shape[-1])
    for lo in range(0, ref.shape[0], 16):
        r, a = ref[lo:lo + 16], approx[lo:lo + 16]
        lp = torch.log_softmax(r.double(), dim=-1)
        lq = torch.log_softmax(a.double(), dim=-1)
        kls.append((lp.exp() * (lp - lq)).sum(-1))
        t5r, t5a = r.topk(k, dim=-1).indices, a.topk(k, dim=-1).indices
        overlaps.append((t5r.unsqueeze(-1) == t5a.unsqueeze(-2)).any(-1).float().sum(-1) / k)
        top1.append((r.argmax(-1) == a.argmax(-1)).float())
        max_err = max(max_err, float((r - a).abs().max()))
    kl, overlap, agree = torch.cat(kls), torch.cat(overlaps), torch.cat(top1)
    return {
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float(agree.mean()),
        "top5_overlap": float(overlap.mean()),
        "max_logit_error": max_err,
    }


# ------------------------------------------------------------------------------------- activations


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def shared_expert_groups(modules: list[str]) -> dict[str, dict[str, str]]:
    """``...mlp.shared_expert`` -> {"gate": module, "up": module, "down": module}."""
    groups: dict[str, dict[str, str]] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        groups.setdefault(parent, {})[leaf.removesuffix("_proj")] = m
    return groups


def _mlp_inputs(inp: ValidationInputs, parent: str, hidden: int, layer_seed: int) -> tuple[torch.Tensor, str]:
    given = inp.activations.get(parent)
    if given is not None:
        return given.float().reshape(-1, hidden), "calibration"
    gen = torch.Generator().manual_seed(SEED + layer_seed)
    x = torch.randn(ACT_TOKENS, hidden, generator=gen)
    # the MLP reads post_attention_layernorm's output: unit RMS times (1 + weight)
    norm = parent.removesuffix(".mlp.shared_expert") + ".post_attention_layernorm.weight"
    if norm in inp.source.tensors:
        x = x * (1.0 + _read(inp.source, norm).float())
        return x, "random (post-attention norm scale)"
    return x, "random (unit RMS)"


def check_activations(inp: ValidationInputs, f: Findings, dequantized: dict[str, torch.Tensor]) -> list[dict]:
    """Each layer's shared-expert SwiGLU (times its sigmoid gate) with source and converted weights
    on the same inputs: relative output error."""
    spec = inp.spec
    out = []
    groups = shared_expert_groups(inp.converted("fp8"))
    for i, (parent, parts) in enumerate(sorted(groups.items(), key=lambda kv: (layer_index(kv[0] + ".") or 0, kv[0]))):
        if set(parts) != {"gate", "up", "down"}:
            continue
        if not all(parts[p] in dequantized for p in ("gate", "up", "down")):
            f.fail("activations", f"{parent}: not run, a projection could not be read")
            continue
        ref = {p: _read(inp.source, parts[p] + ".weight").float() for p in ("gate", "up", "down")}
        x, kind = _mlp_inputs(inp, parent, ref["gate"].shape[1], layer_index(parent + ".") or i)
        y_ref = swiglu(x, ref["gate"], ref["up"], ref["down"])
        y_hyb = swiglu(x, dequantized[parts["gate"]], dequantized[parts["up"]], dequantized[parts["down"]])
        gate_name = parent + "_gate.weight"  # ...mlp.shared_expert_gate
        if gate_name in inp.source.tensors:
            g = torch.sigmoid(x @ _read(inp.source, gate_name).float().t())
            y_ref, y_hyb = y_ref * g, y_hyb * g
        m = error_metrics(y_ref, y_hyb)
        entry = {"module": parent, "layer": layer_index(parent + "."), "tokens": int(x.shape[0]), "inputs": kind,
                 "rel_error": m["rel_error"], "cosine": m["cosine"], "max_abs_error": m["max_abs_error"]}
        entry["passed"] = not exceeds(m["rel_error"], spec.mlp_max_rel_error)
        if not entry["passed"]:
            f.fail("activations", f"{parent}: output relative error {m['rel_error']:.4g} > {spec.mlp_max_rel_error} "
                                  f"(mlp_max_rel_error)")
        out.append(entry)
    if out:
        worst = max(out, key=lambda e: e["rel_error"] if e["rel_error"] == e["rel_error"] else math.inf)
        f.note("activations", f"{len(out)} shared-expert MLPs; worst relative output error {worst['rel_error']:.4g} "
                              f"(layer {worst['layer']})")
    return out


def load_activations(path: Path | None) -> dict[str, torch.Tensor]:
    """Calibration activations: a safetensors file whose keys are ``<...>.mlp.shared_expert``
    (inputs [T, H] of that MLP) and ``lm_head`` (final hidden states [T, H])."""
    if path is None:
        return {}
    from safetensors.torch import load_file

    return load_file(str(path))

