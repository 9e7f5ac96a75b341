"""What a vLLM version can start, and cache, with a DFlash drafter beside the hybrid target: read
before ``serve`` starts anything, from the drafter's and the target's config.json and the engine's
vLLM version.

Each rule rests on a text in the vLLM source of the versions it names (``SourceFact``);
``tests/serve/launch/test_engine_check.py`` fails when a checked version's source no longer says it. A
combination that will not start is one line and an exit code: 3 when the installed vLLM is what
must change (``EngineCannotRun``), 2 when a switch of the command line stops it (``UserError``).
What can start but not cache a warm prefix well is a note serve prints, and ``caching_claim`` says
whether a warm-prefix figure may be claimed for it. Versions outside the checked set get no verdict
here (serve's untested-version warning covers them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.bounded_read import InputRefused, read_json
from hybrid_build.core.errors import ExternalToolError, UserError
from hybrid_build.serve.runtime.fixes import base_version

SLIDING, FULL = "sliding_attention", "full_attention"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class EngineCannotRun(ExternalToolError):
    """The installed engine cannot run this drafter: another vLLM (or engine) is needed."""

    exit_code = 3


@dataclass(frozen=True)
class SourceFact:
    """A text a rule rests on, in a file of the vLLM wheel, for the versions listed."""

    versions: tuple[str, ...]
    path: str
    text: str
    only: bool = True  # and in no other checked version (what tells the versions apart)


# vLLM 0.25.1 refuses a drafter that mixes sliding-window and full attention layers
MIXED_RAISES = SourceFact(("0.25.1",), "vllm/model_executor/models/qwen3_dflash.py",
                          "DFlash does not yet support mixed sliding/full attention via")
# 0.26.0 and 0.33.0 accept it on the V2 model runner, which they force for it unless told otherwise,
# and want a window for its sliding layers
MIXED_NEEDS_V2 = SourceFact(("0.26.0", "0.33.0"), "vllm/model_executor/models/qwen3_dflash.py",
                            "DFlash drafters with mixed sliding/full attention require")
MIXED_FORCES_V2 = SourceFact(("0.26.0", "0.33.0"), "vllm/config/vllm.py", "if self._dflash_needs_multi_kv_group():")
# 0.34.0 has no V1 model runner left, so nothing to force: it refuses VLLM_USE_V2_MODEL_RUNNER set to anything but 1
V1_REMOVED = SourceFact(("0.34.0",), "vllm/platforms/interface.py", "Model Runner V1 has been removed")
WINDOW_READ = SourceFact(("0.25.1", "0.26.0", "0.33.0", "0.34.0"), "vllm/model_executor/models/qwen3_dflash.py",
                         '"swa_window_size", getattr(config, "sliding_window", None)')
# 0.25.1 grows every smaller page by a block-size ratio and asserts; a GDN page cannot grow
PAGE_ASSERT = SourceFact(("0.25.1", "0.26.0"), "vllm/v1/core/kv_cache_utils.py",
                         "assert new_spec.page_size_bytes == max_page_size", only=False)
PAGE_PADS_GDN = SourceFact(("0.26.0",), "vllm/v1/core/kv_cache_utils.py", "elif isinstance(layer_spec, MambaSpec):")
FACTS = (MIXED_RAISES, MIXED_NEEDS_V2, MIXED_FORCES_V2, V1_REMOVED, WINDOW_READ, PAGE_ASSERT, PAGE_PADS_GDN)
# 0.23.0 (PyPI) builds every drafter layer as full attention: its qwen3_dflash.py reads neither
# layer_types nor a sliding window (a test checks that absence)
CHECKED = ("0.23.0", "0.25.1", "0.26.0", "0.33.0", "0.34.0")
# where prefix_align (the plugin, or the 0.23.0 patch) is written for; elsewhere no warm-prefix claim
PREFIX_ALIGN_LOCAL = ("0.25.1", "0.26.0")


@dataclass
class Shapes:
    """What the rules read from the two configs (None: not known)."""

    drafter_types: list[str] | None = None
    drafter_window: int | None = None     # what vLLM's DFlash reads for its sliding layers
    drafter_kv_bytes: int | None = None   # per token and layer, before the KV dtype (x2 bytes)
    target_kv_bytes: int | None = None
    target_hybrid: bool | None = None     # has linear-attention (GDN) layers

    @property
    def mixed(self) -> bool:
        t = self.drafter_types or []
        return SLIDING in t and any(x != SLIDING for x in t)

    @property
    def larger_drafter_pages(self) -> bool | None:
        if self.drafter_kv_bytes is None or self.target_kv_bytes is None:
            return None
        return self.drafter_kv_bytes > self.target_kv_bytes


def kv_bytes(cfg: dict) -> int | None:
    """K and V elements per token in one attention layer (2 x kv heads x head dim)."""
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    dim = cfg.get("head_dim") or (cfg["hidden_size"] // cfg["num_attention_heads"]
                                  if cfg.get("hidden_size") and cfg.get("num_attention_heads") else None)
    return 2 * heads * dim if heads and dim else None


def shapes(drafter: dict | None, target: dict | None) -> Shapes:
    text = (target or {}).get("text_config") or target or {}
    types = (drafter or {}).get("layer_types")
    hybrid = None
    if text.get("layer_types"):
        hybrid = "linear_attention" in text["layer_types"]
    elif "full_attention_interval" in text or "linear_num_value_heads" in text:
        hybrid = True
    d = drafter or {}
    # transformers' Qwen3Config keeps sliding_window only with use_sliding_window; vLLM's DFlash reads
    # dflash_config.swa_window_size first, then that attribute
    window = (d.get("dflash_config") or {}).get("swa_window_size") or \
        (d.get("sliding_window") if d.get("use_sliding_window") else None)
    return Shapes(drafter_types=list(types) if isinstance(types, list) else None, drafter_window=window,
                  drafter_kv_bytes=kv_bytes(drafter) if drafter else None,
                  target_kv_bytes=kv_bytes(text) if text else None, target_hybrid=hybrid)


@dataclass
class Verdict:
    notes: list[str] = field(default_factory=list)
    caching: str = "effective"   # effective / coarse / unclaimed / off


def check(version: str | None, engine: str, spec: Shapes, off: frozenset[str], env: dict[str, str],
          prefix_caching: bool, prefix_match_unit: int | None = None) -> Verdict:
    """The verdict for a DFlash drafter of ``spec`` on vLLM ``version`` (``engine``: local or docker)
    with the fixes in ``off`` switched off; raises EngineCannotRun / UserError for a combination that
    will not start. ``env``: the server's environment (a profile's extra_env over this process's).
    ``prefix_match_unit``: the unit the launch passes (the fine_grained layout, prefix_align off)."""
    v = base_version(version) if version else None
    out = Verdict(caching="effective" if prefix_caching else "off")
    if v not in CHECKED:
        out.notes.append(f"the DFlash drafter was not checked against {'vLLM ' + v if v else 'this vLLM'} "
                         f"(checked: {', '.join(CHECKED)})")
        if prefix_caching:
            out.caching = "unclaimed"
        return out
    if v in V1_REMOVED.versions and env.get(V2_ENV, "1").strip() != "1":
        raise UserError(f"vLLM {v} has only its V2 model runner and refuses {V2_ENV}={env[V2_ENV]} at start "
                        "(platforms/interface.py: \"Model Runner V1 has been removed\"): unset it")
    if spec.mixed:
        _mixed(v, engine, spec, env, out)
    if spec.target_hybrid and spec.larger_drafter_pages:
        if v == "0.25.1" and "kv_unify" in off:
            raise UserError("vLLM 0.25.1 cannot place this DFlash drafter's KV pages beside the hybrid target's (its "
                            "kv_cache_utils.py asserts page_size_bytes == max_page_size: a GDN page cannot grow); "
                            "the runtime fix kv_unify pads them: do not disable it")
        if v == "0.23.0" and "kv_unify" in off:
            raise UserError("vLLM 0.23.0 cannot place this DFlash drafter's KV pages beside the hybrid target's; the "
                            "runtime patch kv_unify pads them: do not disable it")
    if prefix_caching and spec.target_hybrid:
        _caching(v, engine, spec, off, out, prefix_match_unit)
    return out


def _mixed(v: str, engine: str, spec: Shapes, env: dict[str, str], out: Verdict) -> None:
    if v == "0.25.1":
        raise EngineCannotRun("vLLM 0.25.1 cannot run a DFlash drafter with mixed sliding/full layer_types (its "
                              "qwen3_dflash.py raises NotImplementedError); use vLLM 0.26.0 or later, or the docker "
                              "engine")
    if v in ("0.26.0", "0.33.0", "0.34.0") and spec.drafter_window is None:
        raise UserError(f"vLLM {v} gives this DFlash drafter's sliding-window layers no window: its config sets "
                        "neither dflash_config.swa_window_size nor use_sliding_window with sliding_window "
                        "(transformers drops sliding_window without it), so qwen3_dflash.py raises ValueError; fix "
                        "the drafter's config.json")
    if v in ("0.26.0", "0.33.0") and env.get(V2_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        raise UserError(f"vLLM {v} runs a DFlash drafter with mixed sliding/full layer_types only on its V2 model "
                        f"runner, and {V2_ENV}={env[V2_ENV]} turns that off: unset it")
    if v == "0.23.0":
        out.notes.append("vLLM 0.23.0's qwen3_dflash.py (PyPI source) builds every drafter layer as full attention: "
                         "the drafter's sliding-window layers see the whole context there, unlike in training "
                         f"({engine} engine; its image may differ)")


def _caching(v: str, engine: str, spec: Shapes, off: frozenset[str], out: Verdict, unit: int | None = None) -> None:
    pages_differ = spec.larger_drafter_pages is not False  # unknown counts as differing
    from hybrid_build.serve.speed.memory_plan import UNIT_ENGINES, WINDOW_FIX

    if (unit and engine == "local" and v in UNIT_ENGINES and not (spec.mixed and WINDOW_FIX in off)
            and "dflash_keep_last_block" not in off):
        return  # the fine_grained layout: vLLM's own pages, hits within one unit (engine.match_unit)
    if engine == "local" and v in PREFIX_ALIGN_LOCAL:
        if "prefix_align" in off or "dflash_keep_last_block" in off:
            out.caching = "coarse"
            out.notes.append("prefix caching with this drafter on the hybrid target: a warm prefix hits an earlier "
                             "chunk end (DFlash drops the last block as EAGLE does" +
                             ("; the groups' blocks differ" if pages_differ else "") +
                             "): runtime fix prefix_align or dflash_keep_last_block is off, so no warm-prefix TTFT "
                             "is claimed")
        return
    out.caching = "unclaimed"
    why = (f"vLLM {v}'s KV planning is not the source prefix_align was written for" if v >= "0.33" else
           f"the {engine} engine's vLLM {v} has not been measured with a drafter and prefix caching")
    out.notes.append(f"prefix caching with this drafter on the hybrid target: {why}; it is on, but no "
                     "warm-prefix TTFT is claimed")


def read_config(where: str | None, revision: str | None = None) -> tuple[dict | None, str | None]:
    """A model's config.json: a local folder, or a Hub id (the cached file, else a download when the
    Hub can be reached); (None, why) when it cannot be read."""
    if not where:
        return None, "no drafter named"
    path = Path(where).expanduser()
    if path.is_dir():
        try:
            return read_json(path / "config.json", str(path / "config.json")), None
        except (OSError, InputRefused) as e:
            return None, str(e)
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(where, "config.json", revision=revision)
        found = cached if isinstance(cached, str) else hf_hub_download(where, "config.json", revision=revision)
        return read_json(Path(found), f"{where} config.json"), None
    except Exception as e:  # offline, unknown repo, gated: the check is skipped, vLLM will say more
        return None, f"{where}: config.json not readable ({type(e).__name__})"


def server_env(plan_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **plan_env}
