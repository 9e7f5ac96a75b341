"""The registry of what hybrid-build changes inside vLLM at run time, the switch that turns each
change off, and the vLLM versions this project has tested with what each needs.

``FIXES`` is the one list: the plugin, the docker patches and the CLI switch are derived from it.
Two mechanisms apply a fix: the plugin's ``register()`` (local engine, every vLLM process) calls its
``hook`` (``module:function`` in this package), and ``patches/apply.py`` applies its ``patch``
(a module of ``patches/``: docker engine, inside the image before ``vllm serve``). One fix may have
both (the same rule written for 0.25+ and as an anchor edit on 0.23). Adding a fix is one entry
here plus its module. Either way it has one id here and one switch:

    HYBRID_BUILD_DISABLE_FIXES=marlin_moe_scale,kv_unify     (or ``all``)

``hybrid-build serve --disable-fix ID`` sets it. An unknown id is refused (a typo must not leave a
fix on while its user thinks it is off). Turning a fix off and running ``hybrid-build verify``
shows whether a given vLLM still needs it.

Standard library only: ``patches/apply.py`` imports this module in the container, where
hybrid-build is not installed.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

ENV_DISABLE = "HYBRID_BUILD_DISABLE_FIXES"
ALL = "all"


def not_applied_line(fix: str, why: str) -> str:
    """The line the plugin logs for a fix it left out (``says_not_applied`` reads it back from vLLM's log)."""
    return f"hybrid-build: runtime fix {fix} not applied: {why}"


def says_not_applied(text: str, fix: str) -> bool:
    """Whether vLLM's log ``text`` holds the plugin's line for leaving ``fix`` out (``not_applied_line``)."""
    return f"hybrid-build: runtime fix {fix} not applied: " in text


@dataclass(frozen=True)
class Fix:
    id: str
    fixes: str                 # what goes wrong in stock vLLM without it
    upstream: str              # vLLM issue(s) where known, else ""
    needed_on: tuple[str, ...]  # the tested versions it is applied on
    # ``module:function`` in this package that the plugin's register() calls (local engine) with the
    # enabled ids of the fixes sharing that hook; it installs them where their source anchors hold
    hook: str | None = None
    patch: str | None = None   # module in patches/ (docker engine, vLLM 0.23.0)

    @property
    def plugin(self) -> bool:
        """Applied by the plugin (local engine)."""
        return self.hook is not None


FIXES: tuple[Fix, ...] = (
    Fix("inc_fp8_dispatch", "FP8 layers (the shared experts) inside an auto-round INT4 checkpoint are read as "
        "8-bit integers: INC takes data_type from the global config; the fix gives them the block-FP8 method",
        "46311 (fix PR 46322)", ("0.23.0", "0.25.1", "0.26.0", "0.33.0", "0.34.0"), hook="plugin:install_inc",
        patch="inc_fp8_dispatch"),
    Fix("int8_lm_head", "the int8 lm-head: a stored 8-bit head under the bare `lm_head` key reaches the VL "
        "model's nested head, a BF16 head is quantized at load (HYBRID_BUILD_LM_HEAD=quantize-at-load) and runs "
        "the int8 GEMV; off, the head is served as stock vLLM reads it",
        "53896 (review: the head may never get quant_config)", ("0.23.0", "0.25.1", "0.26.0", "0.33.0", "0.34.0"),
        hook="plugin:install_inc", patch="int8_lm_head"),
    Fix("marlin_moe_scale", "Marlin MoE gate/up (w13) scales get the channel-wise layout when "
        "moe_intermediate_size <= group_size < hidden_size: the routed experts compute garbage (the tiny "
        "fixture; not the 122B, so the docker image does without it)",
        "50196", ("0.25.1", "0.26.0", "0.33.0", "0.34.0"), hook="upstream_fixes:install"),
    Fix("kv_unify", "a DFlash drafter whose KV page is larger than the hybrid target's: vLLM 0.25.1 grows every "
        "smaller page by a ratio of block sizes, which cannot grow a GDN state page, and stops at `assert "
        "new_spec.page_size_bytes == max_page_size` (the 122B with its real drafter); the fix pads the GDN pages "
        "as vLLM 0.26.0 does (0.23.0: pads pages that do not divide instead of raising NotImplementedError)",
        "43626, 46480", ("0.23.0", "0.25.1"), hook="kv_cache_fixes:install", patch="kv_unify"),
    Fix("prefix_align", "prefix caching with a DFlash drafter on a hybrid model: the groups' blocks differ (the "
        "target's attention grows to 2x the GDN block), so a warm prefix hits only on their common multiple; the "
        "fix keeps every group at the GDN block with padded pages (0.23.0: rounds mamba_block_size up to the "
        "attention block). Not installed where a profile's "
        "--prefix-match-unit gives finer hits without the padding", "", ("0.23.0", "0.25.1", "0.26.0"),
        hook="kv_cache_fixes:install", patch="prefix_align"),
    Fix("mamba_eagle_drop", "prefix caching on a hybrid GDN model with an EAGLE-style drafter whose last matching "
        "block is dropped (MTP, EAGLE; DFlash without prefix_align): MambaManager ignores the drop the other groups "
        "apply, so the coordinator returns the GDN hit, one block past the attention groups', and the resumed "
        "request's attention layers get a block inside their context whose KV was never computed (wrong output; "
        "shown on CPU with the mtp profile's layout); the fix searches one block less, as vLLM 0.26.0's "
        "coordinator does", "48375, 43559", ("0.23.0", "0.25.1"),
        hook="align_mode_fixes:install", patch="mamba_eagle_drop"),
    Fix("mamba_state_seed", "the V2 model runner seeds a resumed request's GDN state column with the smallest group "
        "block (16 tokens with the real drafter's sliding layers) instead of the GDN block: the align pre-copy reads "
        "past the block-table row (Xid 31); the fix divides by mamba_block_size, as vLLM 0.33.0 does",
        "53142 (PR 55601)", ("0.25.1", "0.26.0"), hook="align_mode_fixes:install"),
    Fix("align_accept_snapshot", "the V2 model runner's align preprocess reads and resets the live accepted-token "
        "buffer that async scheduling may be updating: the pre-copy gets an out-of-range offset (Xid 31); the fix "
        "hands the kernel a snapshot and writes its resets back (GPU kernel: shown on a GPU only)",
        "56736 (PR 56756)", ("0.25.1", "0.26.0", "0.33.0", "0.34.0"), hook="align_mode_fixes:install"),
    Fix("dflash_keep_last_block", "DFlash drops the last matching prefix-cache block as EAGLE does (0.25.1 / 0.26.0 "
        "count it under use_eagle()), so a warm prefix hits an earlier chunk end (53,760 of 65,568 tokens at 64k); "
        "DFlash writes its context K/V from the target's hidden states at the same positions, so nothing in the last "
        "block is provisional: the fix keeps it, as vLLM 0.33 does (needs_eagle_block_drop)", "",
        ("0.25.1", "0.26.0"), hook="kv_cache_fixes:install"),
    Fix("sliding_window_partial_hits", "prefix caching with --prefix-match-unit and a drafter with sliding-window "
        "layers (the 122B's real DFlash drafter): vLLM 0.26.0's SlidingWindowManager asserts at its first lookup "
        "with a unit finer than its block (the engine dies at the first request) and 0.33.0 / 0.34.0 turn partial "
        "hits off for the whole model, so a warm prefix hits only on the coarse block grid unless every page is "
        "padded (prefix_align); the fix gives the sliding "
        "manager partial hits: the blocks its window reaches, the last one copied on write as vLLM does for full "
        "attention", "", ("0.26.0", "0.33.0", "0.34.0"), hook="window_hits:install"),
    Fix("fla_smem_sm121", "FLA chunk kernels on GB10 (sm121, 99 KiB shared memory per block) pick the small "
        "tiles (speed only); threshold from HYBRID_BUILD_FLA_SMEM_BYTES", "", ("0.23.0",),
        patch="fla_smem_sm121"),
)
FIX_IDS: tuple[str, ...] = tuple(f.id for f in FIXES)


def hooks() -> dict[str, tuple[str, ...]]:
    """The plugin's hooks, each with the ids of the fixes it installs (``FIXES`` order)."""
    out: dict[str, tuple[str, ...]] = {}
    for f in FIXES:
        if f.hook:
            out[f.hook] = out.get(f.hook, ()) + (f.id,)
    return out


def patches() -> dict[str, str]:
    """The docker engine's patch modules (``patches/``) by fix id, in ``FIXES`` order."""
    return {f.id: f.patch for f in FIXES if f.patch}


@dataclass(frozen=True)
class TestedVersion:
    version: str
    engine: str                # "docker" or "local"
    how: str                   # what was tested
    fixes: tuple[str, ...]     # the fixes applied there
    image: str | None = None   # the docker image that carries it


TESTED_VERSIONS: tuple[TestedVersion, ...] = (
    TestedVersion("0.23.0", "docker", "the DGX Spark image with the source patches (anchors checked against "
                  "the real 0.23.0 source)",
                  ("kv_unify", "prefix_align", "inc_fp8_dispatch", "int8_lm_head", "mamba_eagle_drop",
                   "fla_smem_sm121"),
                  image="ghcr.io/aeon-7/aeon-vllm-ultimate:2026-06-18-v0.23.0-dflashfix"),
    TestedVersion("0.25.1", "local", "served on the H200 with the plugin (docs/gpu.md); a DFlash drafter with mixed "
                  "sliding/full layers does not start on it (docs/serve.md, Start table)",
                  ("inc_fp8_dispatch", "int8_lm_head", "marlin_moe_scale", "kv_unify", "prefix_align",
                   "mamba_eagle_drop", "mamba_state_seed", "align_accept_snapshot", "dflash_keep_last_block")),
    TestedVersion("0.26.0", "local", "the full-depth 122B with the real drafter's shape started on the H200 (prefix "
                  "caching on); the plugin checked against its source on CPU",
                  ("inc_fp8_dispatch", "int8_lm_head", "marlin_moe_scale", "prefix_align", "mamba_state_seed",
                   "align_accept_snapshot", "dflash_keep_last_block", "sliding_window_partial_hits")),
    TestedVersion("0.33.0", "local", "the plugin checked against its source on CPU (layer dispatch, Marlin "
                  "weight prep); not yet served on a GPU", ("inc_fp8_dispatch", "int8_lm_head", "marlin_moe_scale",
                                                             "align_accept_snapshot", "sliding_window_partial_hits")),
    TestedVersion("0.34.0", "local", "checked against its source on CPU (layer dispatch, Marlin weight prep, the int8 "
                  "head, the fixes' anchors, the memory plan against its KV planning, the scheduler's align-mode "
                  "invariants, the drafter rules); not yet served on a GPU",
                  ("inc_fp8_dispatch", "int8_lm_head", "marlin_moe_scale", "align_accept_snapshot",
                    "sliding_window_partial_hits")),
)


class UnknownFixError(ValueError):
    """The switch names an id that is not in the registry."""


def parse_ids(text: str, source: str = ENV_DISABLE) -> frozenset[str]:
    """The fix ids in a comma-separated list (``all`` is every fix); an unknown id raises
    ``UnknownFixError`` with one line listing the valid ids."""
    ids = {part.strip().replace("-", "_") for part in text.split(",") if part.strip()}
    if ALL in ids:
        return frozenset(FIX_IDS)
    unknown = sorted(ids - set(FIX_IDS))
    if unknown:
        raise UnknownFixError(f"{source}: unknown runtime fix {', '.join(map(repr, unknown))} "
                              f"(valid: {', '.join(FIX_IDS)}, or {ALL})")
    return frozenset(ids)


def disabled_fixes(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The ids the environment switches off (``HYBRID_BUILD_DISABLE_FIXES``)."""
    return parse_ids((os.environ if environ is None else environ).get(ENV_DISABLE, ""))


def off_line(fix_id: str) -> str:
    """The one line a process logs for a fix it leaves out."""
    return f"hybrid-build: runtime fix {fix_id} is off ({ENV_DISABLE}); vLLM runs without it"


def base_version(version: str) -> str:
    """``0.25.1`` from ``0.25.1+cu130`` or ``v0.25.1``; a dev/rc build keeps its suffix (untested)."""
    return version.strip().lstrip("v").split("+", 1)[0]


def tested(version: str) -> TestedVersion | None:
    return next((t for t in TESTED_VERSIONS if t.version == base_version(version)), None)


def tested_image(image: str) -> TestedVersion | None:
    return next((t for t in TESTED_VERSIONS if t.image == image), None)


def untested_warning(version: str | None) -> str | None:
    """The one warning line for a vLLM outside the tested set (None for a tested one)."""
    if version is not None and tested(version) is not None:
        return None
    what = f"vLLM {version}" if version else "this vLLM (its version could not be read)"
    listed = ", ".join(f"{t.version} ({t.engine})" for t in TESTED_VERSIONS)
    return (f"{what} is not one hybrid-build has tested ({listed}; docs/serve.md); serving anyway: "
            "`hybrid-build verify` checks the numerics it serves")


VERSION_RE = re.compile(r"\bv?(\d+\.\d+\.\d+\S*)")


def version_in(text: str) -> str | None:
    """The version on a tool's last output line (``vllm --version`` prints it there; earlier lines
    may be log lines holding other dotted numbers, such as addresses)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = VERSION_RE.search(lines[-1]) if lines else None
    return found.group(1) if found else None
