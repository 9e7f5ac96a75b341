"""The KV-cache fixes (``serve/runtime/kv_cache_fixes.py``) against vLLM's real sources and code, on CPU.

The anchors are read from the unpacked sources of each version: a fix installs only where the
function still says what it assumes. ``kv_probe.py`` then runs, in a subprocess with a version's
sources importable, vLLM's own KV-cache planning (``get_kv_cache_groups``, its page unification,
``resolve_kv_cache_block_sizes``), its KV-cache manager with the block pool and the block hasher,
and the scheduler's GDN chunk split, for the 122B target with the real DFlash drafter's shape:
a cold request then one with the same prefix and another 32-token suffix, at 8k / 32k / 64k.
"""
from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from hybrid_build.serve.runtime import kv_cache_fixes
from hybrid_build.serve.runtime.kv_cache_fixes import ANCHORS

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import vllm_sources  # noqa: E402

BLOCK = 2240  # 16 x ceil(GDN state 4,562,944 B / (16 x 2,048 B per token)): kv_cache_fixes' docstring


def function_source(root: Path, anchor) -> str | None:
    """The source text of ``anchor.qualname`` in the first of its modules that defines it."""
    for module in anchor.modules:
        path = root / (module.replace(".", "/") + ".py")
        if not path.exists():
            continue
        text = path.read_text()
        nodes: list = ast.parse(text).body
        node = None
        for part in anchor.qualname.split("."):
            node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
            if node is None:
                break
            nodes = node.body
        if node is not None:
            return ast.get_source_segment(text, node)
    return None


def _root(version: str) -> Path:
    root = vllm_sources.unpacked(version)
    if root is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    return root


@pytest.mark.vllm
@pytest.mark.parametrize("version, expected", [
    ("0.25.1", {"kv_unify": ["apply"], "prefix_align": ["apply"], "dflash_keep_last_block": ["apply", "apply"]}),
    # 0.26.0 pads GDN pages itself; its scheduler still drops the last block for DFlash
    ("0.26.0", {"kv_unify": ["upstream"], "prefix_align": ["apply"], "dflash_keep_last_block": ["apply", "apply"]}),
    # 0.33 plans the KV cache in kv_cache_planning (GDN pages padded) and only drops for EAGLE
    ("0.33.0", {"kv_unify": ["upstream"], "prefix_align": ["differs"],
                "dflash_keep_last_block": ["upstream", "upstream"]}),
    ("0.34.0", {"kv_unify": ["upstream"], "prefix_align": ["differs"],
                "dflash_keep_last_block": ["upstream", "upstream"]}),
])
def test_anchors_against_each_versions_source(version, expected):
    root = _root(version)
    got = {fix: [a.verdict(function_source(root, a)) for a in anchors] for fix, anchors in ANCHORS.items()}
    assert got == expected


@pytest.mark.vllm
def test_the_raise_and_the_assert_the_fixes_rest_on():
    """What the docstrings quote: 0.25.1's unify asserts after growing a block, and counts DFlash as
    EAGLE; 0.33 says DFlash needs no trailing-block drop."""
    unify = function_source(_root("0.25.1"), ANCHORS["kv_unify"][0])
    assert "assert new_spec.page_size_bytes == max_page_size" in unify and "MambaSpec" not in unify
    spec_src = (_root("0.25.1") / "vllm/config/speculative.py").read_text()
    assert 'return self.method in ("eagle", "eagle3", "mtp", "dflash", "dspark")' in spec_src
    new = " ".join((_root("0.33.0") / "vllm/config/speculative.py").read_text().split())
    assert "DFlash/DSpark build it from the target hidden state alone, so only EAGLE/EAGLE3/MTP require" in new


# the layouts compared per version and drafter shape: (name, fixes, prefix_match_unit); kv_unify is
# how 0.25.1 starts at all with this drafter (0.26.0 pads GDN pages itself)
KEEP = "dflash_keep_last_block"
LAYOUTS = {
    "0.25.1": [("vllm", "none", None), ("stock", "kv_unify", None), ("stock+keep_last", f"kv_unify,{KEEP}", None),
               ("prefix_align", f"kv_unify,prefix_align,{KEEP}", None)],
    "0.26.0": [("stock", "none", None), ("stock+keep_last", KEEP, None), ("stock+unit1120", KEEP, 1120),
               ("stock+unit64", KEEP, 64), ("stock+unit16", KEEP, 16), ("prefix_align", f"prefix_align,{KEEP}", None)],
    # 0.33 keeps DFlash's last block itself and plans in kv_cache_planning (prefix_align does not install)
    "0.33.0": [("stock", "none", None), ("stock+unit1120", "none", 1120), ("stock+unit64", "none", 64)],
    "0.34.0": [("stock", "none", None), ("stock+unit1120", "none", 1120), ("stock+unit64", "none", 64)],
}
# 0.25.1 refuses a mixed drafter (test_engine_check)
SHAPES = {"0.25.1": ("full6",), "0.26.0": ("full6", "mixed"), "0.33.0": ("full6", "mixed"),
          "0.34.0": ("full6", "mixed")}
_RUNS: dict[str, dict] = {}


def _layouts(version: str, tmp: Path) -> dict[tuple[str, str], dict]:
    """Every layout x drafter shape of ``version`` in one ``kv_probe.py --cases`` process (cached)."""
    if version not in _RUNS:
        cases = [{"version": version, "shape": shape, "layout": name, "fixes": fixes, "unit": unit}
                 for shape in SHAPES[version] for name, fixes, unit in LAYOUTS[version]]
        _RUNS[version] = {(x["shape"], x["layout"]): x for x in vllm_sources.run_kv_cases(version, cases, tmp)}
    return _RUNS[version]


def _blocks(res: dict) -> set[int]:
    return {g["block_size"] for g in res["groups"]}


def _hits(res: dict) -> dict[str, int]:
    return {k: v["warm_hit"] for k, v in res["hits"].items()}


@pytest.mark.vllm
def test_stock_0251_stops_at_the_page_assert_with_the_real_drafter(tmp_path):
    res = _layouts("0.25.1", tmp_path)[("full6", "vllm")]
    assert res["block_size"] == BLOCK and res["mamba_page_bytes"] == 4562944
    assert res["error"].startswith("AssertionError")


@pytest.mark.vllm
@pytest.mark.parametrize("version, shape", [("0.25.1", "full6"), ("0.26.0", "mixed")])
def test_without_prefix_align_a_warm_prefix_falls_back_to_an_earlier_chunk(version, shape, tmp_path):
    """The layout 0.26.0 measured on the H200 (warm 0.83 / 0.80 / 1.38 s vs cold 0.90 / 2.54 / 5.34 s
    at 8k / 32k / 64k): the target's attention at two GDN blocks, every group dropping its last block."""
    res = _layouts(version, tmp_path)[(shape, "stock")]
    assert _blocks(res) == {BLOCK, 2 * BLOCK} and res["scheduler_block_size"] == 2 * BLOCK
    assert res["manager_use_eagle"] is True
    assert _hits(res) == {"8192": 0, "32768": 26880, "65536": 53760}


@pytest.mark.vllm
@pytest.mark.parametrize("version, shape", [("0.25.1", "full6"), ("0.26.0", "mixed"), ("0.26.0", "full6")])
def test_prefix_align_hits_up_to_the_last_block_boundary(version, shape, tmp_path):
    res = _layouts(version, tmp_path)[(shape, "prefix_align")]
    assert res["install"]["prefix_align"] == res["install"][KEEP] == "applied"
    assert _blocks(res) == {BLOCK} and len({g["page"] for g in res["groups"]}) == 1
    assert res["scheduler_block_size"] == res["hash_block_size"] == res["cache_block_size"] == BLOCK
    assert res["manager_use_eagle"] is False
    for ctx, h in res["hits"].items():
        assert h["cold_hit"] == 0
        assert h["warm_hit"] == h["prompt"] // BLOCK * BLOCK, ctx  # everything but the partial last block
    assert res["hits"]["65536"]["recomputed"] == 608


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.26.0", "0.33.0", "0.34.0"])
def test_the_prefix_match_unit_gives_full_prefix_hits_without_padding(version, tmp_path):
    """The default the 122B's profiles ship (prefix_match_unit 64, passed on the versions of
    UNIT_ENGINES with a drafter without sliding-window layers): on vLLM's own code, with the last
    block kept and the stock layout, a warm prefix hits within one unit of the prompt at 8k / 32k /
    64k (the whole shared prefix) and the pool is the stock layout's (prefix_align's padding costs 27%
    on 0.26.0); without the unit the hit falls back. With the mixed (sliding) drafter and no more than these
    fixes, vLLM 0.26.0 asserts at its first lookup and 0.33.0 turns partial hits off: there the unit
    needs sliding_window_partial_hits too (test_window_hits.py)."""
    from hybrid_build.recipes.schema import load_recipe
    from hybrid_build.serve.speed.memory_plan import UNIT_ENGINES

    runs = _layouts(version, tmp_path)
    unit = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"].prefix_match_unit
    assert version in UNIT_ENGINES and BLOCK % unit == 0
    res = runs[("full6", f"stock+unit{unit}")]
    assert res["hash_block_size"] == unit and _blocks(res) == {BLOCK, 2 * BLOCK}
    assert res["install"] == ({KEEP: "applied"} if version == "0.26.0" else {})
    for ctx, h in res["hits"].items():
        assert h["cold_hit"] == 0 and 0 <= h["prompt"] - h["warm_hit"] < unit, (ctx, h)
        assert h["warm_hit"] >= int(ctx) - int(ctx) % unit  # the shared prefix, to the unit
    stock = runs[("full6", "stock+keep_last" if version == "0.26.0" else "stock")]
    assert res["pool_tokens"] == stock["pool_tokens"]
    assert _hits(stock)["65536"] < res["hits"]["65536"]["warm_hit"]
    if version == "0.26.0":
        aligned = runs[("full6", "prefix_align")]
        assert all(res["hits"][c]["warm_hit"] >= aligned["hits"][c]["warm_hit"] for c in res["hits"])
        assert res["pool_tokens"] > aligned["pool_tokens"] * 1.3
        assert "SlidingWindowManager does not support fine-grained" in runs[("mixed", f"stock+unit{unit}")]["error"]
    else:
        mixed = runs[("mixed", f"stock+unit{unit}")]
        assert mixed["partial_hits"] is False and _hits(mixed) == _hits(runs[("mixed", "stock")])
    out = os.environ.get("HYBRID_BUILD_LAYOUT_TABLE")
    if out:  # the lab table: HYBRID_BUILD_LAYOUT_TABLE=FILE pytest -m vllm this file
        rows = [{k: r.get(k) for k in ("version", "shape", "layout", "fixes", "unit", "pool_tokens", "num_blocks",
                                       "hash_block_size", "scheduler_block_size", "error")}
                | {"warm_hits": _hits(r) if r.get("hits") else None}
                for v in ("0.25.1", "0.26.0", "0.33.0") for r in _layouts(v, tmp_path).values()]
        Path(out).write_text(json.dumps({
            "basis": "vLLM's own get_kv_cache_groups, get_kv_cache_config_from_groups, KVCacheManager, block hasher "
                     "and Scheduler._mamba_block_aligned_split on CPU (tests/serve/kv_probe.py): the 122B target, a "
                     "DFlash drafter of the real shape (full6: 6 full-attention layers; mixed: 5 sliding-4096 + 1 "
                     "full), 12 speculative tokens, bf16 KV; a cold request then the same prefix with another "
                     "32-token suffix, prompts of 8,224 / 32,800 / 65,568 tokens; pool: the tokens vLLM logs at a KV "
                     "budget of 547 x 55,050,240 B (the public GB10 log at gpu_memory_utilization 0.82)",
            "chosen": {"0.25.1": "prefix_align (no --prefix-match-unit in 0.25.1; a mixed drafter does not start)",
                       "0.26.0/full6": "stock+unit64 (the whole shared prefix, the stock pool)",
                       "0.26.0/mixed": "stock+unit64 with sliding_window_partial_hits (without it a partial hit "
                                       "asserts in SlidingWindowManager; lab/results/prefix_layouts_real_drafter_cpu"
                                       ".json); prefix_align where no unit is passed",
                       "0.33.0/full6": "stock+unit64 (as 0.26.0)",
                       "0.33.0/mixed": "stock+unit64 with sliding_window_partial_hits (without it 0.33.0 turns "
                                       "partial hits off; prefix_align does not install there)"},
            "stand_in_0.33.0": "0.33.0's GDN spec as tests/serve/kv_pool_probe.py builds it: no prefill-checkpoint "
                               "blocks (num_prefill_checkpoint_blocks 0), so the scheduler's internal-checkpoint path "
                               "is not taken",
            "rows": rows}, indent=1))


def test_no_drop_init_only_for_dflash():
    seen = []

    class Stock:
        def __init__(self, vllm_config, *rest):
            seen.append(kv_cache_fixes._NO_BLOCK_DROP.get())

    init = kv_cache_fixes.no_drop_init(Stock.__init__)

    def config(method):
        return type("C", (), {"speculative_config": type("S", (), {"method": method})()})()

    a, b = object.__new__(Stock), object.__new__(Stock)
    init(a, config("dflash"))
    init(b, vllm_config=config("eagle3"))
    assert seen == [True, False] and a.hybrid_build_no_block_drop and not hasattr(b, "hybrid_build_no_block_drop")
    assert kv_cache_fixes._NO_BLOCK_DROP.get() is False
