"""The reference: the hybrid's (and the source's) own next-token distributions on the validate
texts, recorded by the streamed engine, so that a served copy can later be checked against them.

For each bundled text and each side (``hybrid``: the artifact's dequantized weights; ``source``:
the source's), per position, the top-``K`` token ids and their log-probabilities (log_softmax over
the full vocabulary, fp32 math) and the log-probability of the token that came next. ``K`` is 20,
what vLLM returns for ``prompt_logprobs`` by default; row ``t - 1`` predicts ``token_ids[t]`` from
``token_ids[:t]``, the alignment of vLLM's ``prompt_logprobs[t]`` (whose entry 0 is None). The
top-k log-probabilities also give the tail's mass (``1 - sum(exp(top))``), which is what a KL
estimate with the tail lumped into one bucket needs.

It is a known REPORT (``core.artifact.REPORTS["reference"]``), not a build output: it is computed
from the build's bytes by ``hybrid-build validate`` after the provenance is written, so the
provenance cannot hash it; it names the build it describes by ``provenance_sha256`` like the
validation report, and ``report_state`` says when a rebuild has made it stale.

Owns: ``ReferenceRecorder`` (fed logit chunks by ``streamed.compare_streamed``; keeps only top-k
per position), ``write_reference`` and ``read_reference``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid_build.core.artifact import REPORTS, provenance_sha256
from hybrid_build.core.bounded_read import read_json
from hybrid_build.core.errors import ArtifactError, UserError
from hybrid_build.core.safetensors_io import TMP_SUFFIX, write_bytes_atomic, write_text_atomic

REFERENCE = REPORTS["reference"]  # its files, named by core.artifact
SCHEMA_VERSION = 1
K = 20  # vLLM's default number of prompt logprobs
SIDES = ("hybrid", "source")
WHAT = ("Per position of each validate text, the top-k token ids and log-probabilities (fp32, full-vocabulary "
        "log_softmax) of the hybrid's and the source's next-token distributions, computed from their dequantized "
        "weights by the streamed engine; row t-1 predicts token_ids[t], as vLLM's prompt_logprobs[t].")
FIELDS = ("top_ids", "top_logprobs", "target_logprob")


@dataclass
class TextReference:
    """One text: its token ids and, per side, ``top_ids`` int32 [T-1, k], ``top_logprobs`` float32
    [T-1, k] (descending) and ``target_logprob`` float32 [T-1] (of ``token_ids[1:]``)."""

    name: str
    token_ids: list[int]
    top_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    top_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    target_logprob: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def positions(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class Reference:
    k: int
    provenance_sha256: str
    texts: dict[str, TextReference]
    engine: str = "streamed"
    dtype: str = "float32"

    @property
    def positions(self) -> int:
        return sum(t.positions for t in self.texts.values())


def tensor_name(text: str, side: str, what: str) -> str:
    return f"{text}.{side}.{what}"


# ------------------------------------------------------------------------------------ recording


class _TopK:
    """One side's running top-k logits and online logsumexp (float64) over vocabulary chunks, for
    one block of positions: [P, k] kept, never [P, vocab]."""

    def __init__(self, targets: torch.Tensor, k: int) -> None:
        self.targets, self.k = targets, k
        self.vals = self.ids = self.m = self.s = self.z_t = None

    def update(self, start: int, logits: torch.Tensor) -> None:
        z = logits.float()
        c = z.shape[1]
        ids = torch.arange(start, start + c, device=z.device).expand_as(z)
        if self.vals is None:
            vals, cand = z, ids
            self.z_t = torch.full((z.shape[0],), float("nan"), dtype=torch.float64, device=z.device)
        else:
            vals, cand = torch.cat([self.vals, z], 1), torch.cat([self.ids, ids], 1)
        top, where = torch.topk(vals, min(self.k, vals.shape[1]), dim=1)  # sorted, descending
        self.vals, self.ids = top, cand.gather(1, where)
        zd = z.double()
        cm = zd.max(1).values
        m = cm if self.m is None else torch.maximum(self.m, cm)
        s = (zd - m[:, None]).exp().sum(1)
        self.s = s if self.s is None else self.s * (self.m - m).exp() + s
        self.m = m
        t = self.targets.to(z.device)
        inside = (t >= start) & (t < start + c)
        self.z_t = torch.where(inside, zd.gather(1, (t - start).clamp(0, c - 1)[:, None])[:, 0], self.z_t)

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top ids int32, top log-probs float32, target log-prob float32), on the CPU."""
        lse = self.m + self.s.log()
        return (self.ids.to(torch.int32).cpu(), (self.vals.double() - lse[:, None]).float().cpu(),
                (self.z_t - lse).float().cpu())


class ReferenceRecorder:
    """What ``streamed.compare_streamed`` feeds: ``start(token_ids)`` once, then for each block of
    positions (texts concatenated, each text's last token left out) ``begin(lo, hi)``, every
    vocabulary chunk's logits of both models in order (``update``) and ``end()``.
    ``reference(provenance)`` assembles what was recorded once it is ``complete``."""

    def __init__(self, k: int = K) -> None:
        self.k = k
        self.token_ids: dict[str, list[int]] = {}
        self.targets = torch.zeros(0, dtype=torch.long)
        self._parts: dict[str, list[tuple[torch.Tensor, ...]]] = {s: [] for s in SIDES}
        self._block: dict[str, _TopK] | None = None
        self._next = 0

    def start(self, token_ids: Mapping[str, Sequence[int] | torch.Tensor]) -> None:
        self.token_ids = {n: [int(i) for i in torch.as_tensor(ids).flatten().tolist()] for n, ids in token_ids.items()}
        self.targets = torch.cat([torch.as_tensor(ids[1:], dtype=torch.long) for ids in self.token_ids.values()])

    @property
    def complete(self) -> bool:
        return bool(self.token_ids) and self._block is None and self._next == self.targets.numel()

    def begin(self, lo: int, hi: int) -> None:
        if lo != self._next or self._block is not None:
            raise ValueError(f"position blocks must come in order: expected {self._next}, got {lo}")
        self._block = {s: _TopK(self.targets[lo:hi], self.k) for s in SIDES}
        self._next = hi

    def update(self, start: int, source_logits: torch.Tensor, hybrid_logits: torch.Tensor) -> None:
        self._block["source"].update(start, source_logits)
        self._block["hybrid"].update(start, hybrid_logits)

    def end(self) -> None:
        for side, acc in self._block.items():
            self._parts[side].append(acc.result())
        self._block = None

    def reference(self, provenance: str) -> Reference:
        if not self.complete:
            raise ValueError(f"{self._next} of {self.targets.numel()} positions were recorded")
        whole = {s: [torch.cat(col) for col in zip(*parts)] for s, parts in self._parts.items()}
        texts, pos = {}, 0
        for name, ids in self.token_ids.items():
            lo, hi = pos, pos + len(ids) - 1
            pos = hi
            texts[name] = TextReference(name, ids, *({s: whole[s][i][lo:hi] for s in SIDES} for i in range(3)))
        return Reference(self.k, provenance, texts)


# ------------------------------------------------------------------------------------ files


def planned_bytes(token_counts: Sequence[int], k: int = K) -> int:
    """An upper bound of the bytes of the reference's two files for texts of these token counts:
    per position and side ``k`` ids and log-probabilities and the target's (4 bytes each), a
    safetensors header entry per tensor, the token ids as JSON."""
    positions = sum(max(n - 1, 0) for n in token_counts)
    tensors = len(token_counts) * len(SIDES) * len(FIELDS)
    return positions * len(SIDES) * (2 * k * 4 + 4) + tensors * 256 + sum(token_counts) * 12 + 4096


def write_reference(artifact: Path, reference: Reference, stage: bool = False) -> list[Path]:
    """Write the reference's two files into ``artifact`` (safetensors first, each atomically; the
    JSON, which ``report_state`` reads, last). ``stage``: leave both under their temporary names
    (``TMP_SUFFIX`` added) for the caller to rename, in the order returned. The tensors are
    serialized in memory (a few hundred bytes a position) and written by Python: a full disk is an
    ``OSError`` naming the file, and the file's mode follows the umask like the other reports'."""
    from safetensors.torch import save

    artifact = Path(artifact)
    main, tensors_path = REFERENCE.path(artifact), artifact / REFERENCE.named(".safetensors")
    main.parent.mkdir(parents=True, exist_ok=True)
    tensors = {tensor_name(t.name, side, what): getattr(t, what)[side].contiguous()
               for t in reference.texts.values() for side in SIDES for what in FIELDS}
    tmp = tensors_path.with_name(tensors_path.name + TMP_SUFFIX)
    write_bytes_atomic(tmp, save(tensors, metadata={"provenance_sha256": reference.provenance_sha256,
                                                    "schema_version": str(SCHEMA_VERSION), "k": str(reference.k)}))
    if stage:
        staged_main = main.with_name(main.name + TMP_SUFFIX)
        write_text_atomic(staged_main, json.dumps(_reference_json(reference)) + "\n")
        return [tmp, staged_main]
    os.replace(tmp, tensors_path)
    write_text_atomic(main, json.dumps(_reference_json(reference)) + "\n")
    return [tensors_path, main]


def _reference_json(reference: Reference) -> dict:
    return {"schema_version": SCHEMA_VERSION, "provenance_sha256": reference.provenance_sha256, "k": reference.k,
            "engine": reference.engine, "dtype": reference.dtype,
            "texts": {t.name: {"token_ids": t.token_ids} for t in reference.texts.values()},
            "positions": reference.positions, "what": WHAT}


def read_reference(artifact: Path, bound: bool = False) -> Reference:
    """The reference in ``artifact``. Missing files are a ``UserError`` (run validate); files that
    do not belong together, or to the build now in the folder, or whose values are not finite
    log-probabilities <= 0 (refused whole, never half-used), are an ``ArtifactError``. ``bound``: the
    artifact is opened and checked first (``core.bound``: every file and report against the
    provenance, the reference against the digests the report records), and refused on any problem."""
    from hybrid_build.core.bound import open_artifact, reference_problems

    artifact = Path(artifact)
    if bound:
        opened = open_artifact(artifact)
        opened.require("the reference is not the one validate wrote for this build; run `hybrid-build validate` again")
    problems = reference_problems(artifact, None)
    if problems:
        raise ArtifactError(f"{artifact}: {problems[0]}; run `hybrid-build validate` again")
    data = _read_json(artifact)
    tensors, meta = _read_tensors(artifact)
    built = data["provenance_sha256"]
    if meta.get("provenance_sha256") != built:
        raise ArtifactError(f"{artifact}: {REFERENCE.named('.safetensors')} and {REFERENCE.main} are from different "
                            "builds; run `hybrid-build validate` again")
    now = provenance_sha256(artifact)
    if now is not None and now != built:
        raise ArtifactError(f"{artifact}: {REFERENCE.main} was made for another build of this folder; run "
                            "`hybrid-build validate` again")
    k = data["k"]
    texts = {name: _text(name, entry, tensors, k, artifact) for name, entry in data["texts"].items()}
    return Reference(k, built, texts, data.get("engine", "streamed"), data.get("dtype", "float32"))


def _read_json(artifact: Path) -> dict:
    path = REFERENCE.path(artifact)
    if not path.exists():
        raise UserError(f"{artifact}: no {REFERENCE.main}: run `hybrid-build validate` (streamed engine) on it "
                        "first")
    try:  # a regular file, capped, nested at most MAX_DEPTH (core/bounded_read)
        data = read_json(path, REFERENCE.main, error=ArtifactError)
    except (OSError, ArtifactError) as e:
        raise ArtifactError(f"{path}: unreadable ({e}); run `hybrid-build validate` again") from None
    ok = (isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION
          and isinstance(data.get("provenance_sha256"), str) and isinstance(data.get("k"), int)
          and isinstance(data.get("texts"), dict))
    if not ok:
        raise ArtifactError(f"{path}: not a schema-{SCHEMA_VERSION} reference; run `hybrid-build validate` again")
    return data


def _read_tensors(artifact: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    path = artifact / REFERENCE.named(".safetensors")
    if not path.is_file():
        raise UserError(f"{artifact}: no {REFERENCE.named('.safetensors')}: run `hybrid-build validate` "
                        "(streamed engine) on it first")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {n: f.get_tensor(n) for n in f.keys()}, f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise ArtifactError(f"{path}: unreadable ({' '.join(str(e).split())}); run `hybrid-build validate` "
                            "again") from None


_DTYPES = {"top_ids": torch.int32, "top_logprobs": torch.float32, "target_logprob": torch.float32}


def _text(name: str, entry: dict, tensors: dict[str, torch.Tensor], k: int, artifact: Path) -> TextReference:
    ids = entry.get("token_ids") if isinstance(entry, dict) else None
    if not isinstance(ids, list) or len(ids) < 2:
        raise ArtifactError(f"{artifact}: {REFERENCE.main}: text {name!r} has no token ids")
    text = TextReference(name, [int(i) for i in ids])
    rows = text.positions
    for side in SIDES:
        for what in FIELDS:
            key = tensor_name(name, side, what)
            t = tensors.get(key)
            shape = (rows,) if what == "target_logprob" else (rows, k)
            if t is None or tuple(t.shape) != shape or t.dtype != _DTYPES[what]:
                got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                raise ArtifactError(f"{artifact}: {REFERENCE.named('.safetensors')}: {key} is {got}, expected "
                                    f"{_DTYPES[what]} {list(shape)}; the two reference files do not belong together")
            getattr(text, what)[side] = t
    return text
