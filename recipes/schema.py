"""The recipe schema, the shipped recipes, and how a recipe is chosen for a source.

A recipe names what to convert (targets are exact module names or ``re:`` patterns), the scheme
for each part, the output format, the validation thresholds and the serving profiles. Unknown
keys are rejected; a validation error names the field and the allowed values (``RecipeError``,
exit 2).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from hybrid_build.core import formats
from hybrid_build.core.bounded_read import parse_yaml
from hybrid_build.core.errors import RecipeError
from hybrid_build.core.formats.base import OutputFormat
from hybrid_build.core.user_paths import read_text_file
from hybrid_build.recipes.profiles import SMOKE_EXPECT, ServeProfile

RECIPE_DIR = Path(__file__).resolve().parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_targets(targets: list[str]) -> list[str]:
    for t in targets:
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as e:
                raise ValueError(f"bad regular expression {t!r}: {e}")
    return targets


def target_matches(targets: list[str], module: str) -> bool:
    """A target is an exact module name, a name suffix after a dot, or ``re:`` + a full-match regex."""
    for t in targets:
        if t.startswith("re:"):
            if re.fullmatch(t[3:], module):
                return True
        elif module == t or module.endswith("." + t):
            return True
    return False


class SharedExpertSpec(_Strict):
    enabled: bool = True
    targets: list[str] = Field(default_factory=lambda: [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj"])
    scheme: Literal["fp8-block128"] = "fp8-block128"
    observer: Literal["minmax", "mse"] = "minmax"
    source: Literal["calibrate", "checkpoint"] = Field(
        "calibrate", description="calibrate locally, or take the tensors from an official FP8 checkpoint")
    fp8_checkpoint: str | None = Field(None, description="Hub id or folder of the official FP8 checkpoint")

    _targets = field_validator("targets")(classmethod(lambda cls, v: _check_targets(v)))


class HeadSpec(_Strict):
    enabled: bool = True
    targets: list[str] = Field(default_factory=lambda: ["lm_head"])
    scheme: Literal["int8-row"] = "int8-row"
    storage: Literal["gptq-int8", "bf16"] = "gptq-int8"
    chunk_rows: int = Field(4096, ge=1, description="rows quantized at a time (bounds memory)")

    _targets = field_validator("targets")(classmethod(lambda cls, v: _check_targets(v)))


def _check_format(name: str) -> str:
    """A registered output format (``core/formats``); the error lists them as a Literal's would."""
    if name not in formats.REGISTRY:
        quoted = [repr(n) for n in formats.names()]
        expected = " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


class OutputSpec(_Strict):
    format: str = Field(formats.DEFAULT, description="one of the registered output formats (core/formats)")
    max_shard_bytes: int = Field(5_000_000_000, ge=1_000_000)

    _format = field_validator("format")(classmethod(lambda cls, v: _check_format(v)))

    @property
    def fmt(self) -> OutputFormat:
        """The format object: every question about the output's layout goes to it."""
        return formats.get(self.format)


class ValidateSpec(_Strict):
    """Pass/fail thresholds. The FP8 and int8 bounds are a margin above the formats' floors on
    Gaussian weights (FP8 E4M3 block-128 ~0.026 relative error, int8 per-row ~0.009)."""

    fp8_max_rel_error: float = Field(0.045, gt=0)
    fp8_max_block_rel_error: float = Field(
        0.1, gt=0, description="worst 128x128 block: E4M3 rounds each value within 2^-4 relative, so a "
                               "correct block stays under 0.0625; one bad scale is not diluted by the tensor")
    int8_max_rel_error: float = Field(0.015, gt=0)
    int8_max_row_rel_error: float = Field(
        0.25, gt=0, description="worst lm-head row: symmetric per-row int8 keeps a row within sqrt(K)/254 "
                                "relative (0.22 at K=3072); a swapped or foreign row is ~1.4")
    min_cosine: float = Field(0.998, gt=0, le=1)
    mlp_max_rel_error: float = Field(0.06, gt=0)
    head_min_top1: float = Field(0.97, ge=0, le=1)
    head_min_top5_overlap: float = Field(0.9, ge=0, le=1)
    head_max_kl: float = Field(0.01, ge=0)
    e2e_max_kl: float = Field(0.02, ge=0)
    e2e_min_top1: float = Field(0.9, ge=0, le=1)
    e2e_max_ppl_change: float = Field(0.03, ge=0, description="relative perplexity change")
    e2e: bool = Field(True, description="run the end-to-end transformers forward (needs the model to fit in RAM)")


class VerifySpec(_Strict):
    """What `hybrid-build verify` (and `serve` before it says ready) accepts from a running server, against
    the artifact's reference (its own top-k next-token log-probabilities on the validate texts).

    Measured (lab/results/verify_real_vllm_h200.json: vLLM 0.25.1 on an H200 serving the tiny
    inc-hybrid through `hybrid-build serve`, 765 positions): the correct server against the reference
    gave KL mean 2.9e-5, p99 3.1e-4, max 5.9e-4, same top-1 0.867 (a random model's flat
    distributions; the source served as `base` against the source side: 9.5e-7, same top-1 0.997);
    with the Marlin MoE scale fix switched off it gave KL mean 5.2e-4 and same top-1 0.089 and
    failed. The defaults below are for trained models, whose served-vs-fp32 noise no run here has
    measured at full width, so they keep wide headroom over the tiny model's figures and over vLLM
    against transformers on it (KL mean 0.00089, max 0.0145; lab/gpu_runs.md, run 4); the tiny recipe
    sets its own from the measurement. The KL figure is a lower bound of the full-vocabulary KL (top-k
    with the tail lumped), so these bounds are at least as loose on the full KL as they read."""

    max_mean_kl: float = Field(
        0.01, ge=0, description="mean over all positions of the top-k KL(reference || server) estimate, nats "
                                "(11x the 0.00089 vLLM gave against transformers on the tiny model; 350x the "
                                "2.9e-5 a correct server gave against the reference)")
    max_p99_kl: float = Field(
        0.05, ge=0, description="99th percentile over all positions of that estimate, nats (3.4x the 0.0145 "
                                "maximum vLLM gave against transformers on the tiny model; 160x the 3.1e-4 p99 "
                                "against the reference)")
    min_same_top1: float = Field(
        0.9, ge=0, le=1, description="share of positions where the server's top-1 token is the reference's; a "
                                     "trained model's top-1 rarely flips under kernel noise (a random model's does: "
                                     "the tiny recipe lowers it)")


class MatchSpec(_Strict):
    """Config values (of the text config) that a source must have for this recipe to be chosen."""

    model_type: list[str] = Field(default_factory=list)
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_experts: int | None = None


class ServeSpec(_Strict):
    default_profile: str = "dense"
    profiles: dict[str, ServeProfile] = Field(default_factory=dict)
    smoke_expect: str | None = Field(
        SMOKE_EXPECT, description="what `serve`'s smoke-test answer (the capital of France) must contain, "
                             "case-insensitive; null: any non-empty answer (a model with random weights)")


class Recipe(_Strict):
    name: str
    description: str = ""
    source: str | None = Field(None, description="the source checkpoint this recipe was written for")
    match: MatchSpec = Field(default_factory=MatchSpec)
    shared_experts: SharedExpertSpec = Field(default_factory=SharedExpertSpec)
    lm_head: HeadSpec = Field(default_factory=HeadSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    validate_: ValidateSpec = Field(default_factory=ValidateSpec, alias="validate")
    verify: VerifySpec = Field(default_factory=VerifySpec)
    serve: ServeSpec = Field(default_factory=ServeSpec)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)

    def matches(self, text_config: dict, model_type: str) -> bool:
        return not self.mismatches(text_config, model_type)

    def mismatches(self, text_config: dict, model_type: str) -> list[str]:
        """Each way the source's config differs from this recipe's ``match`` block."""
        m = self.match
        out = []
        if m.model_type and model_type not in m.model_type and text_config.get("model_type") not in m.model_type:
            out.append(f"model_type is {model_type!r}, the recipe is for {', '.join(m.model_type)}")
        for key in ("hidden_size", "num_hidden_layers", "num_experts"):
            want = getattr(m, key)
            if want is not None and text_config.get(key) != want:
                out.append(f"{key} is {text_config.get(key)}, the recipe is for {want}")
        return out

    @property
    def specificity(self) -> int:
        """How many config values the ``match`` block pins (a family recipe pins only the type)."""
        return sum(getattr(self.match, k) is not None for k in ("hidden_size", "num_hidden_layers", "num_experts"))


def _allowed_at(loc: tuple) -> list[str]:
    """Field names valid at the place an unknown key was found (dict levels take any key)."""
    model: Any = Recipe
    parts = list(loc[:-1])
    while parts:
        part = parts.pop(0)
        fields = getattr(model, "model_fields", None) or {}
        info = next((f for n, f in fields.items() if n == part or f.alias == part), None)
        if info is None:
            return []
        model = info.annotation
        if getattr(model, "__origin__", None) is dict:  # dict[str, Model]: skip the key
            model = model.__args__[1]
            parts = parts[1:]
    fields = getattr(model, "model_fields", {})
    return [f.alias or n for n, f in fields.items()]


def _explain(e: ValidationError, where: str) -> RecipeError:
    err = e.errors()[0]
    loc = tuple(err["loc"])
    field = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_at(loc)
        return RecipeError(f"{where}: unknown field '{field}' (allowed: {', '.join(allowed)})")
    msg = err["msg"]
    if err["type"] == "literal_error":
        msg = "must be one of " + err["ctx"]["expected"]
    return RecipeError(f"{where}: field '{field}': {msg}")


def parse_recipe(data: Any, where: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a YAML mapping, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise _explain(e, where) from None


def list_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPE_DIR.glob("*.yaml"))}


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name, or a YAML file."""
    shipped = list_recipes()
    path = shipped.get(str(name_or_path)) or Path(name_or_path)
    if not path.exists():
        raise RecipeError(f"recipe {name_or_path!r}: not a file and not a shipped recipe "
                          f"(shipped: {', '.join(shipped)})")
    text = read_text_file(path, "recipe")  # a binary file, a FIFO or a folder: one line, never a hang
    try:
        data = parse_yaml(text, f"recipe {path.name}")  # nested too deep: one line, never a RecursionError
    except yaml.YAMLError as e:
        raise RecipeError(f"{path.name}: not valid YAML ({str(e).splitlines()[0]})")
    return parse_recipe(data, path.name)


def select_recipe(text_config: dict, model_type: str) -> Recipe:
    """The shipped recipe whose ``match`` block fits the source config; the one that pins the
    most values wins, so a model's own recipe beats its family's (``qwen3.5-moe``), whose targets
    come from the model's structure alone."""
    fitting = [r for r in map(load_recipe, list_recipes())
               if r.match != MatchSpec() and r.matches(text_config, model_type)]
    if fitting:
        return max(fitting, key=lambda r: r.specificity)
    raise RecipeError(f"no shipped recipe matches this model (model_type {model_type!r}, hidden "
                      f"{text_config.get('hidden_size')}, {text_config.get('num_hidden_layers')} layers); "
                      f"pass --recipe (shipped: {', '.join(list_recipes())})")
