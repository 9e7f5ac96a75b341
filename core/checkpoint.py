"""Read a checkpoint from its config and safetensors headers only (no tensor data).

A checkpoint is read from ``config.json`` (VL or text-only form), its quantization config
(auto-round, FP8, compressed-tensors), the index, and the header of EVERY ``*.safetensors`` file
beside them, listed in the index or not (Intel's MTP tensors live in a file the index may not
list). Where the files are is a ``CheckpointFiles``: ``FolderFiles`` (a local folder) or
``hub_headers.HubFiles`` (a Hub repository read remotely, headers only); the checks are the same.
``Checkpoint.read_folder`` reads a folder, ``Checkpoint.open`` a folder or a Hub id downloaded whole
(what ``run`` converts), ``Checkpoint.open_headers`` a folder or a Hub id's headers (``inspect``,
``plan``: a few MB for a 70 GB checkpoint). What is wrong is collected as ``Problem``s, not raised,
so ``inspect`` can show them all; ``require_clean`` turns error-level problems into one ``SourceError``.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

from .bounded_read import JSON_CAP, check_depth, read_bytes
from .errors import SourceError
from .names import name_problem
from .safetensors_io import INDEX_NAME, TMP_SUFFIX, FileHeader, TensorHeader, read_header
from .tensor_classes import classify, dtype_problem, dtype_storage, module_storage, split_module

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Problem:
    severity: str  # "error" | "warning" | "info"
    code: str
    message: str


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    in_index: bool
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int
    klass: str
    storage: str

    def to_json(self) -> dict:
        return {"name": self.name, "file": self.file, "in_index": self.in_index, "dtype": self.dtype,
                "shape": list(self.shape), "bytes": self.nbytes, "class": self.klass, "storage": self.storage}


@dataclass
class QuantizationInfo:
    """The parts of ``quantization_config`` that hybrid-build acts on, whatever the method."""

    method: str | None
    raw: dict = field(default_factory=dict)

    @property
    def bits(self) -> int | None:
        return self.raw.get("bits")

    @property
    def group_size(self) -> int | None:
        return self.raw.get("group_size")

    @property
    def sym(self) -> bool | None:
        return self.raw.get("sym")

    @property
    def packing_format(self) -> str | None:
        return self.raw.get("packing_format")

    @property
    def extra_config(self) -> dict[str, dict]:
        return self.raw.get("extra_config") or {}

    @property
    def weight_block_size(self) -> list[int] | None:
        return self.raw.get("weight_block_size")

    @property
    def config_groups(self) -> dict:
        return self.raw.get("config_groups") or {}

    def layer_override(self, module: str) -> dict | None:
        """auto-round's per-layer ``extra_config`` entry for a module: an exact key wins,
        then the first regex key that matches the whole name."""
        extra = self.extra_config
        if module in extra:
            return extra[module]
        # the regex keys tried once per module name: a reader asks for each of a module's tensors
        seen = self.__dict__.setdefault("_override_of", {})
        if module not in seen:
            seen[module] = next((value for pattern, value in self._regex_keys() if pattern.fullmatch(module)), None)
        return seen[module]

    def _regex_keys(self) -> list[tuple[re.Pattern, dict]]:
        # compiled once: the real checkpoint has ~250 keys and ~100k module names to test
        cached = self.__dict__.get("_compiled")
        if cached is None:
            cached = []
            for key, value in self.extra_config.items():
                if not any(c in key for c in "*+?^$()[]{}|\\"):
                    continue  # a plain name only matches exactly (handled above)
                try:
                    cached.append((re.compile(key), value))
                except re.error:
                    continue
            self.__dict__["_compiled"] = cached
        return cached

    def module_bits(self, module: str) -> int | None:
        if self.method == "auto-round":
            override = self.layer_override(module) or {}
            return override.get("bits", self.bits)
        if self.method == "compressed-tensors":
            for group in self.config_groups.values():
                for target in group.get("targets", []):
                    pattern = target[3:] if target.startswith("re:") else re.escape(target)
                    if re.fullmatch(pattern, module) or (not target.startswith("re:") and module.endswith(target)):
                        return (group.get("weights") or {}).get("num_bits")
            return None
        return self.bits


def _quantization(config: dict) -> QuantizationInfo:
    raw = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not raw:
        return QuantizationInfo(None, {})
    method = raw.get("quant_method")
    if method in ("intel/auto-round", "auto_round", "autoround"):
        method = "auto-round"
    return QuantizationInfo(method, raw)


# config.json fields that planning reads as numbers; a wrong type is refused before anything is built
_INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size",
               "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size",
               "num_attention_heads", "num_key_value_heads", "head_dim", "full_attention_interval")


def _check_config_shape(config, path: Path | str) -> None:
    """A config.json that parses but is not what transformers writes: one line naming the field."""
    if not isinstance(config, dict):
        raise SourceError(f"{path}: expected a JSON object, found a {type(config).__name__}")
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise SourceError(f"{path}: text_config must be an object, found a {type(text).__name__}")
    for where, block in (("", config), ("text_config.", text)):
        for name in _INT_FIELDS:
            v = block.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SourceError(f"{path}: {where}{name} must be a non-negative integer, found {v!r}")
    layer_types = text.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(x, str) for x in layer_types)):
        raise SourceError(f"{path}: text_config.layer_types must be a list of strings")


class CheckpointFiles(Protocol):
    """Where a checkpoint's files are read from. ``where`` names the checkpoint in messages and
    ``name(file)`` one of its files; ``root`` is its local folder (None: nothing of it is local)."""

    where: str
    root: Path | None

    def name(self, file: str) -> str: ...

    def read_json(self, file: str) -> bytes | None:
        """The bytes of one of its JSON files; None when it has none of that name."""

    def safetensors_files(self) -> list[str]:
        """Its ``*.safetensors`` files, sorted."""

    def read_headers(self, files: list[str]) -> dict[str, FileHeader | SourceError]:
        """Each file's header, checked (``safetensors_io.header_from_json``), or why it is not one."""


class FolderFiles:
    """A checkpoint folder on this machine."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.where = str(self.root)

    def name(self, file: str) -> str:
        return str(self.root / file)

    def read_json(self, file: str) -> bytes | None:
        path = self.root / file
        return _json_bytes(path) if path.exists() else None

    def safetensors_files(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("*.safetensors") if not p.name.endswith(TMP_SUFFIX))

    def read_headers(self, files: list[str]) -> dict[str, FileHeader | SourceError]:
        out: dict[str, FileHeader | SourceError] = {}
        for f in files:
            try:
                out[f] = read_header(self.root / f)
            except SourceError as e:
                out[f] = e
        return out


@dataclass
class Checkpoint:
    root: Path | None  # None: read from the Hub's headers, nothing of it is on this machine
    config: dict
    quant: QuantizationInfo
    index: dict | None
    tensors: dict[str, TensorInfo]
    files: list[str]
    problems: list[Problem]
    source_id: str | None = None
    revision: str | None = None

    # ------------------------------------------------------------------ config views
    @property
    def is_vl(self) -> bool:
        return "text_config" in self.config

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def lm_prefix(self) -> str:
        return "model.language_model." if self.is_vl else "model."

    @property
    def hybrid_info(self) -> dict | None:
        """The ``hybrid_build`` block this tool writes into the configs it produces."""
        return self.config.get("hybrid_build")

    @cached_property
    def modules(self) -> dict[str, dict[str, TensorInfo]]:
        """module name -> part name -> tensor."""
        out: dict[str, dict[str, TensorInfo]] = {}
        for t in self.tensors.values():
            module, part = split_module(t.name)
            out.setdefault(module, {})[part] = t
        return out

    def path_of(self, t: TensorInfo) -> Path:
        if self.root is None:
            raise SourceError(f"{self.source_id}: read from the Hub's headers only, its tensors are not here")
        return self.root / t.file

    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    def require_clean(self) -> None:
        errors = self.errors()
        if errors:
            more = (f" (and {len(errors) - 1} more problem(s); `hybrid-build inspect` lists them)"
                    if len(errors) > 1 else "")
            raise SourceError(errors[0].message + more)

    # ------------------------------------------------------------------ reading
    @classmethod
    def open(cls, source: str | os.PathLike, revision: str | None = None) -> "Checkpoint":
        """A folder, or a Hub id downloaded whole into the Hub cache (resumable, with progress)."""
        root, source_id, resolved_rev = resolve_source(source, revision)
        return cls.read_folder(root, source_id=source_id, revision=resolved_rev)

    @classmethod
    def open_headers(cls, source: str | os.PathLike, revision: str | None = None) -> "Checkpoint":
        """A folder, or a Hub id read remotely, headers only: the JSON files and each shard's header,
        nothing of the weights (offline, the Hub cache's snapshot, as ``open``)."""
        if Path(source).expanduser().exists() or _offline():
            return cls.open(source, revision)
        repo_id = _hub_id(source)
        from .hub_headers import HubFiles

        files = HubFiles.open(repo_id, revision)
        return cls._read(files, source_id=repo_id, revision=files.commit)

    @classmethod
    def read_folder(cls, root: Path, source_id: str | None = None, revision: str | None = None) -> "Checkpoint":
        root = Path(root)
        if not root.exists():
            raise SourceError(f"{root}: no such file or directory")
        if not root.is_dir():
            raise SourceError(f"{root}: not a directory (a checkpoint is a folder with config.json)")
        return cls._read(FolderFiles(root), source_id=source_id, revision=revision)

    @classmethod
    def _read(cls, src: CheckpointFiles, source_id: str | None = None, revision: str | None = None) -> "Checkpoint":
        raw = src.read_json("config.json")
        if raw is None:
            raise SourceError(f"{src.where}: missing config.json (not a transformers checkpoint folder)")
        cfg_name = src.name("config.json")
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SourceError(f"{cfg_name}: invalid JSON ({e.msg} at line {e.lineno})")
        except UnicodeDecodeError:
            raise SourceError(f"{cfg_name}: invalid JSON (not UTF-8 text)") from None
        _check_config_shape(config, cfg_name)
        quant = _quantization(config)
        problems: list[Problem] = []

        index = None
        raw = src.read_json(INDEX_NAME)
        if raw is not None:
            try:
                index = json.loads(raw)
                weight_map = index["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise SourceError(f"{INDEX_NAME}: invalid index (expected JSON with a weight_map)")
        weight_map: dict[str, str] = (index or {}).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise SourceError(f"{INDEX_NAME}: invalid index (its weight_map is not an object)")
        bad = sorted({f if isinstance(f, str) else repr(f) for f in weight_map.values()
                      if not isinstance(f, str) or name_problem(f) or "/" in f})
        for entry in bad:  # never opened: the shards are the folder's own *.safetensors files
            problems.append(Problem("error", "bad_index_entry",
                                    f"{INDEX_NAME} maps tensors to {entry!r}, which is not a file name in "
                                    "this folder"))
        weight_map = {k: v for k, v in weight_map.items() if isinstance(v, str) and v not in bad}

        files = src.safetensors_files()
        if not files:
            raise SourceError(f"{src.where}: no *.safetensors files")
        for missing in sorted(set(weight_map.values()) - set(files)):
            n = sum(1 for f in weight_map.values() if f == missing)
            problems.append(Problem("error", "missing_file",
                                    f"index lists {n} tensor(s) in {missing}, which does not exist"))
        indexed_files = set(weight_map.values())
        if index is not None:
            for f in files:
                if f not in indexed_files:
                    problems.append(Problem("info", "unindexed_file",
                                            f"{f} is not listed in the index; its tensors are read too"))

        headers = {}
        for f, h in src.read_headers(files).items():
            if isinstance(h, SourceError):
                problems.append(Problem("error", "bad_file", str(h)))
            else:
                headers[f] = h

        # first pass: where each tensor lives, and duplicates
        located: dict[str, tuple[str, TensorHeader]] = {}
        for f, h in headers.items():
            for name, th in h.tensors.items():
                if name in located:
                    problems.append(Problem("error", "duplicate_tensor",
                                            f"tensor {name} is stored in both {located[name][0]} and {f}"))
                    continue
                located[name] = (f, th)
        for name, f in weight_map.items():
            if f in headers and name not in headers[f].tensors:
                problems.append(Problem("error", "missing_tensor", f"index maps {name} to {f}, which does not hold it"))
            elif name in located and located[name][0] != f and f in headers:
                problems.append(Problem("error", "index_mismatch",
                                        f"index maps {name} to {f}, but it is stored in {located[name][0]}"))

        # module-level storage: every part of a quantized module shares the module's storage
        parts_of: dict[str, dict[str, str]] = {}
        for name, (_, th) in located.items():
            module, part = split_module(name)
            parts_of.setdefault(module, {})[part] = th.dtype
        tensors: dict[str, TensorInfo] = {}
        module_bits = {module: quant.module_bits(module) for module in parts_of}
        for name, (f, th) in sorted(located.items()):
            module, _ = split_module(name)
            storage = module_storage(parts_of[module], module_bits[module]) or dtype_storage(th.dtype)
            in_index = (weight_map.get(name) == f) if index is not None else True
            tensors[name] = TensorInfo(name, f, in_index, th.dtype, th.shape, th.start, th.nbytes,
                                       classify(name), storage)
            why = dtype_problem(name, tensors[name].klass, th.dtype)
            if why:
                problems.append(Problem("error", "bad_dtype", f"{f}: {why}"))

        ckpt = cls(src.root, config, quant, index, tensors, files, problems, source_id, revision)
        ckpt.problems.extend(_packing_problems(ckpt))
        if ckpt.hybrid_info or any(t.storage == "fp8" and t.klass == "shared_expert" for t in tensors.values()):
            ckpt.problems.append(Problem(
                "warning", "already_hybrid",
                "this checkpoint is already a hybrid (FP8 shared experts or a hybrid_build block)"))
        return ckpt


def _packing_problems(ckpt: Checkpoint) -> list[Problem]:
    """GPTQ packing rules: qweight [K/pack, N] int32, scales [K/g, N], qzeros [K/g, N/pack]."""
    out = []
    for module, parts in ckpt.modules.items():
        qw = parts.get("qweight")
        if qw is None:
            continue
        bits = ckpt.quant.module_bits(module) or 4
        pack = 32 // bits
        scales = parts.get("scales")
        if qw.dtype != "I32" or len(qw.shape) != 2:
            out.append(Problem("error", "bad_packing",
                               f"{module}.qweight must be a 2-D int32 tensor, is {qw.dtype} {list(qw.shape)}"))
            continue
        k, n = qw.shape[0] * pack, qw.shape[1]
        if scales is None or len(scales.shape) != 2:
            out.append(Problem("error", "bad_packing", f"{module} has qweight but no 2-D scales"))
            continue
        groups = scales.shape[0]
        if scales.shape[1] != n:
            out.append(Problem("error", "bad_packing", f"{module}.scales has {scales.shape[1]} columns, qweight {n}"))
        group_size = ckpt.quant.group_size or 128
        override = ckpt.quant.layer_override(module) or {}
        group_size = override.get("group_size", group_size)
        if group_size and group_size > 0 and groups != -(-k // group_size):
            out.append(Problem("error", "bad_packing",
                               f"{module}: {groups} scale groups for K={k} does not match group_size {group_size}"))
        qz = parts.get("qzeros")
        if qz is not None and (qz.shape[0] != groups or qz.shape[1] * pack != n):
            out.append(Problem("error", "bad_packing",
                               f"{module}.qzeros shape {list(qz.shape)} does not match {groups} groups x N={n}/{pack}"))
    return out


def _json_bytes(path: Path) -> bytes:
    """The bytes of one of the checkpoint's JSON files (``core/bounded_read``): a FIFO, device or
    folder in its place refused in one line (reading a FIFO would block forever), at most
    ``JSON_CAP`` bytes, nested at most ``MAX_DEPTH`` deep."""
    data = read_bytes(path, str(path), JSON_CAP, error=SourceError)
    check_depth(data.decode("utf-8", "replace"), str(path))
    return data


def resolve_source(source: str | os.PathLike, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """A local folder as is; a Hub id (``org/name``) through huggingface_hub's cache."""
    path = Path(source).expanduser()
    if path.exists():
        return path, None, revision
    text = _hub_id(source)
    from huggingface_hub import snapshot_download

    from .hub_errors import hub_error, hub_exceptions

    try:
        local = snapshot_download(text, revision=revision, local_files_only=_offline())
    except hub_exceptions() as e:  # offline, not found, gated, unauthorized, bad revision...: said in one line
        raise hub_error(e, text, revision=revision) from None
    rev = Path(local).name  # snapshot folders are named by commit hash
    return Path(local), text, rev


def _hub_id(source: str | os.PathLike) -> str:
    """``source`` as a Hub id (``org/name``), or the one line for a path that does not exist."""
    text = str(source)
    if not HUB_ID.match(text) or text.startswith((".", "/")):
        raise SourceError(f"{source}: no such file or directory")
    return text


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false")
