"""Serving profiles: data that says how to start vLLM for one use (dense, dflash, base, mtp).

Profiles live in the recipe YAML (``serve.profiles``) so that a model's recipe carries the engine
settings measured for it; these models validate them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybrid_build.core.limits import MAX_SPECULATIVE_TOKENS, MAX_STREAMS, MAX_TOKENS

from .serve_names import (  # noqa: F401  (the names' home; imported from here too)
    DOCKER_IMAGE,
    SMOKE_EXPECT,
    SMOKE_PROMPT,
    SOURCE_PLACEHOLDER,
)

# a Hub revision as vLLM's SpeculativeConfig.revision takes it: a commit (or its prefix), a tag or a branch
REVISION = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$"


class DrafterSpec(BaseModel):
    """The speculative-decoding drafter: DFlash (a separate model) or the model's own MTP head."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["dflash", "mtp"]
    model: str | None = Field(None, description="drafter Hub id or folder (dflash only); `{source}` stands for "
                                                "the local source checkpoint's folder, e.g. `{source}-dflash`")
    # a Hub repository's main moves (a drafter retrained in place accepts differently):
    # a Hub drafter names the commit its profile's figures rest on, or says `revision: null` outright
    revision: str | None = Field(None, pattern=REVISION, description=(
        "the drafter's Hub revision (a commit, tag or branch) the profile's figures rest on: required for a Hub "
        "drafter; `null` serves the Hub's main, which moves (serve says so)"))
    num_speculative_tokens: int = Field(12, ge=1, le=MAX_SPECULATIVE_TOKENS)
    attention_backend: str | None = Field(
        "FLASH_ATTN", description="the DFlash drafter is non-causal: its backend must support that")

    @field_validator("model")
    @classmethod
    def _only_the_source_placeholder(cls, v: str | None) -> str | None:
        if v and ("{" in v.replace(SOURCE_PLACEHOLDER, "") or "}" in v.replace(SOURCE_PLACEHOLDER, "")):
            raise ValueError(f"{v!r}: the only placeholder a drafter model may hold is {SOURCE_PLACEHOLDER}")
        return v

    @model_validator(mode="after")
    def _hub_drafter_pinned(self) -> DrafterSpec:
        if self.method == "dflash" and is_hub_drafter(self.model) and "revision" not in self.model_fields_set:
            raise ValueError(f"the DFlash drafter {self.model} names no revision: pin the commit the profile's "
                             "figures rest on (revision: COMMIT), or write revision: null to serve the Hub's main, "
                             "which moves")
        return self


def is_hub_drafter(model: str | None) -> bool:
    """A drafter named by a Hub id (owner/name), not a folder (``{source}-dflash``, a path)."""
    from hybrid_build.core.checkpoint import HUB_ID

    return bool(model) and SOURCE_PLACEHOLDER not in model and not model.startswith((".", "/", "~")) \
        and bool(HUB_ID.match(model))


class ServeProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    artifact: Literal["hybrid", "source"] = Field(
        "hybrid", description="serve the hybrid artifact, or the untouched source checkpoint")
    int8_lm_head: bool = Field(False, description="serve the lm-head as int8 (stored, or quantized at load)")
    speculative: DrafterSpec | None = None
    attention_backend: str | None = None
    gpu_memory_utilization: float = Field(0.82, gt=0, le=1)
    max_model_len: int = Field(262144, ge=256, le=MAX_TOKENS)
    max_num_seqs: int = Field(4, ge=1, le=MAX_STREAMS)
    enable_prefix_caching: bool = True
    prefix_caching_note: str | None = Field(
        None, description="why this profile cannot cache a warm prefix well (or has caching off): `serve` prints "
                          "it, and `plan` / the model card claim no warm-prefix TTFT for it")
    note: str | None = Field(
        None, description="what this profile is not shown to survive (a defect no runtime fix removes, or a fix "
                          "not yet shown on a GPU): `serve` prints it at start")
    prefix_match_unit: int | None = Field(
        None, ge=16, multiple_of=16,
        description="vLLM's --prefix-match-unit (0.26.0 and later): prefix-cache hits land on this many tokens, "
                    "finer than the physical block (copy-on-write partial hits). serve passes it with the same "
                    "--block-size (every KV group's block then a multiple of it) where the served vLLM is one it was "
                    "measured on (0.26.0, 0.33.0, local engine): the fine_grained layout, vLLM's own KV pages "
                    "(runtime fix prefix_align off; dflash_keep_last_block on, and for a drafter with sliding-window "
                    "layers sliding_window_partial_hits, without which 0.26.0 asserts at its first lookup and 0.33.0 "
                    "turns them off); elsewhere prefix_align stays (lab/results/prefix_layouts_real_drafter_cpu.json)")
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="vLLM's --kv-cache-dtype: 'fp8' halves the bytes each decode step reads per token of "
                            "context in the full-attention layers (plan --kv-dtype fp8 shows the effect); check "
                            "the served numerics with `hybrid-build verify` before relying on it (docs/serve.md)")
    # Qwen3.5 emits <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>: in vLLM
    # 0.25.1-0.33.0 `qwen3_xml` and `qwen3_coder` are one parser of that format; in 0.23.0 they are two,
    # and only qwen3_xml works without those tags being tokens of the vocabulary (docs/serve.md, Tool calls)
    tool_call_parser: str | None = "qwen3_xml"
    reasoning_parser: str | None = "qwen3"
    load_format: str | None = None
    served_model_name: str = "qwen"
    extra_args: list[str] = Field(default_factory=list)
    extra_env: dict[str, str] = Field(default_factory=dict, description="environment for the server")

