"""The memory figures ``serve`` prints before vLLM starts, and the check of the pool vLLM logs once it
has: the KV pool in tokens, the largest context one stream holds and the streams that fit, for the
launch's profile on this device, from ``serve.speed.memory_plan`` (the model ``plan`` and the card
use too).

What the plan rests on here: the served folder's config and safetensors headers (the weights), the
drafter's config.json (a local folder, a cached Hub file, else the z-lab drafter's stated shape)
and its weight files, the device's memory (``--hardware`` or the GPU ``nvidia-smi`` names) and the
reserve ``memory_plan.reserve_for`` states for it, and the vLLM version to be served (the planning
rules of the nearest version the plan knows at or below it; 0.26.0's when unknown).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybrid_build.core.bounded_read import InputRefused, read_json
from hybrid_build.serve.speed import memory_plan as mem

DEFAULT_ENGINE = "0.26.0"
AGENT_CONTEXTS = (100_000, 32_768)  # what an agent's main thread and its subagents hold


@dataclass
class LaunchMemory:
    """The plan for one launch, or why there is none (``why``)."""

    plan: mem.MemoryPlan | None
    why: str | None
    hardware: str | None = None
    engine_basis: str = ""
    max_num_seqs: int = 1
    unit: int | None = None  # --prefix-match-unit, when the launch passes it
    # without a plan (no weights to read: a config-only target), the layout's inputs: the pool it gives at
    # the budget vLLM logs is still checked (``check_log``)
    layout: mem.MemoryInputs | None = None
    at_logged_budget: dict | None = None  # what that check found

    def contexts(self) -> list[int]:
        i = self.plan.inputs
        return [i.max_model_len] + [c for c in AGENT_CONTEXTS if c < i.max_model_len]

    def lines(self) -> list[str]:
        """What serve prints before it starts (each line begins ``memory: ``)."""
        if self.plan is None:
            later = (f"; the {self.layout.layout} KV layout is checked at the budget vLLM logs" if self.layout else "")
            return [f"memory: not planned ({self.why}){later}"]
        p, i = self.plan, self.plan.inputs
        kv = {"auto": "bf16"}.get(i.kv_cache_dtype, i.kv_cache_dtype)
        fits = []
        for c in self.contexts():
            f = p.streams_that_fit(c)
            fits.append(f"{f.whole:,} x {c:,}" + (f" (the next gets {f.next_tokens:,})" if f.next_tokens else ""))
        each = p._context_in(max(p.num_blocks - 1, 0) // self.max_num_seqs) if self.max_num_seqs > 1 else 0
        seqs = (f"; max_num_seqs {self.max_num_seqs} streams hold up to {min(each, i.max_model_len):,} tokens each"
                if each else "")
        return [
            f"memory: KV pool {p.pool_tokens:,} tokens ({self.engine_basis}; {self.hardware}: "
            f"{i.total_bytes / 1e9:g} GB x gpu_memory_utilization {i.gpu_memory_utilization:g} - weights "
            f"{i.weights_bytes / 1e9:.1f} GB - drafter {i.drafter_bytes / 1e9:.1f} GB - reserve "
            f"{i.reserve_bytes / 1e9:.1f} GB, {i.reserve_basis}; {i.layout} prefix-cache layout"
            + (f" (--block-size {self.unit} --prefix-match-unit {self.unit})" if self.unit else "") + f", {kv} KV, "
            f"{i.num_speculative_tokens} speculative tokens)",
            f"memory: largest context one stream holds {p.max_context_tokens:,} tokens; streams that fit: "
            + ", ".join(fits) + seqs,
        ] + [f"memory: {n}" for n in p.notes]

    def to_json(self) -> dict:
        if self.plan is None:
            return {"planned": False, "why": self.why} | (
                {"at_logged_budget": self.at_logged_budget} if self.at_logged_budget else {})
        p = self.plan
        fit = [{"context": c, "whole": f.whole, "next_tokens": f.next_tokens}
               for c in self.contexts() for f in [p.streams_that_fit(c)]]
        return {"planned": True, "hardware": self.hardware, "engine_basis": self.engine_basis,
                "pool_tokens": p.pool_tokens, "max_context_tokens": p.max_context_tokens, "fit": fit,
                "plan": p.to_json()}

    def check_log(self, text: str) -> tuple[str | None, str | None, int | None]:
        """(a line saying the log agrees, a warning naming both pools, the logged pool) for vLLM's log
        since this start; both lines None when there is no plan or no pool line."""
        logged = mem.log_pool_tokens(text)
        missing = self._layout_fix_refused(text)
        if missing:
            return None, missing, logged
        if self.plan is None and self.layout is not None and logged is not None:
            return self._check_at_logged_budget(text, logged)
        if self.plan is None or logged is None:
            return None, None, logged
        warning = mem.compare_with_log(self.plan, text)
        if warning:
            return None, warning, logged
        return (f"memory: vLLM logged a KV pool of {logged:,} tokens; the plan said {self.plan.pool_tokens:,} "
                f"({logged / self.plan.pool_tokens - 1:+.1%})"), None, logged


    def _check_at_logged_budget(self, text: str, logged: int) -> tuple[str | None, str | None, int | None]:
        """No plan of the budget (the weights unknown): the layout's pool at the budget vLLM logged, which it
        rounds to 0.01 GiB, so the logged pool must fall inside the pools of that band, give or take
        ``memory_plan.BUDGET_SLACK``."""
        gib = mem.log_budget_gib(text)
        if gib is None:
            return None, None, logged
        lo, hi = mem.pool_at_logged_budget(self.layout, gib)
        self.at_logged_budget = {"budget_gib": gib, "pool_tokens": [lo, hi], "logged_pool_tokens": logged}
        band = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
        where = f"at the KV budget vLLM logged ({gib:g} GiB) the {self.layout.layout} layout gives {band} tokens"
        if lo * (1 - mem.BUDGET_SLACK) <= logged <= hi * (1 + mem.BUDGET_SLACK):
            return f"memory: vLLM logged a KV pool of {logged:,} tokens; {where}", None, logged
        return (None, f"vLLM's KV pool is {logged:,} tokens, but {where}: the KV layout differs from what vLLM did",
                logged)

    def _layout_fix(self) -> str | None:
        """The runtime fix the planned layout rests on (the plugin logs when it leaves one out)."""
        if self.plan is None:
            return None
        i = self.plan.inputs
        if i.layout == "fine_grained" and "sliding_attention" in ((i.drafter_config or {}).get("layer_types") or []):
            return mem.WINDOW_FIX
        return "prefix_align" if i.layout == "prefix_align" else None

    def _layout_fix_refused(self, text: str) -> str | None:
        """A warning when vLLM's log says the plugin did not apply the fix the planned layout rests on
        (its source is not the one the fix was written for): the pool may agree while the hits do not
        (a partial hit stops vLLM 0.26.0 without sliding_window_partial_hits)."""
        fix = self._layout_fix()
        from hybrid_build.serve.runtime.fixes import says_not_applied

        if fix is None or not says_not_applied(text, fix):
            return None
        return (f"the {self.plan.inputs.layout} prefix-cache layout was planned, but vLLM's log says runtime fix {fix} "
                "was not applied (this vLLM's source is not the one it was written for): serve with "
                f"--disable-fix {fix}, or a vLLM the fix was checked against")


def engine_for(version: str | None) -> tuple[str, str]:
    """The planning rules' version for a served vLLM version, and how to say it."""
    from hybrid_build.serve.runtime.fixes import base_version

    def key(v: str) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in v.split(".")[:3])

    if version is None:
        return DEFAULT_ENGINE, f"vLLM {DEFAULT_ENGINE}'s planning, the served version not known here"
    v = base_version(version)
    if v in mem.ENGINE_VERSIONS:
        return v, f"vLLM {v}'s planning"
    try:
        below = [k for k in mem.ENGINE_VERSIONS if key(k) <= key(v)]
    except ValueError:
        below = []
    if not below or not v[:1].isdigit():
        return DEFAULT_ENGINE, f"vLLM {DEFAULT_ENGINE}'s planning, the served {version} not one the plan knows"
    return below[-1], f"vLLM {below[-1]}'s planning, the nearest the plan knows to the served {version}"


def installed_vllm() -> str | None:
    """The vLLM installed here, by its package metadata (no import, no subprocess: for --dry-run)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def drafter_config(name: str | None, revision: str | None) -> tuple[dict, int, str]:
    """The drafter's config, weight bytes, and where they come from."""
    from hybrid_build.serve.speed.bandwidth import DFLASH_122B

    if name and Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
        try:
            cfg = read_json(folder / "config.json", "config.json")
        except (OSError, InputRefused):
            cfg = dict(mem.DFLASH_DRAFTER)
        return cfg, sum(f.stat().st_size for f in folder.glob("*.safetensors")), "its folder"
    cfg = None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", revision=revision) if name else None
        if isinstance(cached, str):
            cfg = read_json(Path(cached), "config.json")
    except Exception:  # noqa: BLE001 - an unreadable cache entry: the stated shape below
        cfg = None
    if cfg:
        return cfg, DFLASH_122B.weight_bytes, "its cached config"
    return dict(mem.DFLASH_DRAFTER), DFLASH_122B.weight_bytes, "not read here: the z-lab drafter's stated shape"


def plan_for_launch(launch, version: str | None, hardware: str | None, disabled: frozenset[str] = frozenset(),
                    ) -> LaunchMemory:
    """The memory plan of ``launch`` (a ``LaunchPlan``) served by vLLM ``version`` on ``hardware``
    (a ``plan`` preset name; None: unknown)."""
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.core.errors import HybridBuildError

    profile = launch.vllm.profile if launch.vllm is not None else None
    if profile is None:
        return LaunchMemory(None, "no serve profile resolved")
    if mem.device_bytes(hardware) is None:
        return LaunchMemory(None, "the device's memory is not known here: --hardware gb10|h200|h100|rtx-pro-6000")
    folder = Path(launch.model).expanduser()
    if not folder.is_dir():
        return LaunchMemory(None, f"{launch.model} is not a local folder: its weights are not known here")
    try:
        ckpt = Checkpoint.read_folder(folder)
    except HybridBuildError as e:
        why = f"the served checkpoint's headers cannot be read ({e})"
        return LaunchMemory(None, why, hardware, layout=_layout_only(launch, folder, version, disabled))
    if "linear_attention" not in mem._layer_types(ckpt.text_config):
        return LaunchMemory(None, "not a hybrid Gated DeltaNet model: the memory plan models those")
    spec = profile.speculative
    weights = mem.served_weight_bytes(ckpt.tensors.values(), spec.method if spec else None,
                                      bool(launch.env.get("HYBRID_BUILD_LM_HEAD")))
    drafter_cfg, drafter_bytes = None, 0
    if spec is not None and spec.method == "dflash":
        drafter_cfg, drafter_bytes, _ = drafter_config(launch.drafter, launch.drafter_revision)
    engine, basis = engine_for(version)
    try:
        plan = mem.plan_on(hardware, ckpt.text_config, profile, engine, weights, drafter_cfg, drafter_bytes, disabled,
                           unit=bool(launch.prefix_match_unit))
    except mem.MemoryPlanError as e:
        return LaunchMemory(None, str(e), hardware, basis)
    except (KeyError, TypeError, ValueError) as e:
        return LaunchMemory(None, f"the config lacks what the plan reads ({type(e).__name__}: {e})", hardware, basis)
    return LaunchMemory(plan, None, hardware, basis, profile.max_num_seqs, launch.prefix_match_unit)


def _layout_only(launch, folder: Path, version: str | None, disabled: frozenset[str]) -> mem.MemoryInputs | None:
    """The launch's KV layout from the folder's config.json alone (weights and budget unknown), for the
    check at the budget vLLM logs; None where the config does not give one."""
    profile = launch.vllm.profile
    try:
        config = read_json(folder / "config.json", "config.json")
    except (OSError, InputRefused):
        return None
    text_config = (config.get("text_config") or config) if isinstance(config, dict) else {}
    try:
        if not isinstance(text_config, dict) or "linear_attention" not in mem._layer_types(text_config):
            return None
    except (KeyError, TypeError, ValueError):  # no layer count: not a config the plan reads
        return None
    spec = profile.speculative
    drafter_cfg = (drafter_config(launch.drafter, launch.drafter_revision)[0]
                   if spec is not None and spec.method == "dflash" else None)
    engine, _ = engine_for(version)
    layout = mem.profile_layout(profile, engine, disabled, drafter_cfg, bool(launch.prefix_match_unit))
    i = mem.profile_inputs(text_config, profile, engine, drafter_cfg, layout=layout)
    try:
        mem.plan_memory(i)  # a config the plan models (its widths read as the weights-based plan reads them)
    except (mem.MemoryPlanError, KeyError, TypeError, ValueError):
        return None
    return i
