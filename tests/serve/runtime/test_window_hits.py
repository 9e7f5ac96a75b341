"""The runtime fix ``sliding_window_partial_hits`` (``serve/runtime/window_hits.py``) against vLLM's real
sources and code, on CPU.

The anchors are read from each version's unpacked source. ``window_hit`` (the fine-grained lookup) runs
on a stand-in block pool. Then vLLM's own code: ``kv_probe.py`` (one subprocess per version: KV-cache
planning, ``KVCacheManager`` with its coordinator, block pool and hasher, the scheduler's GDN chunk
split) for the 122B with the real DFlash drafter's shape (5 sliding-window layers of 4096 + 1 full) and
the dense profile's 6 speculative tokens, every layout stock and fixed; and ``align_probe.py`` (vLLM's
Scheduler through multi-turn conversations with random accepted counts and resumes, every step's
block tables checked) with the fix off and on.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hybrid_build.serve.runtime import window_hits
from hybrid_build.serve.runtime.window_hits import ANCHORS, FIX_ID, window_hit

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_sources  # noqa: E402
from test_kv_cache_fixes import _root, function_source  # noqa: E402

KEEP = "dflash_keep_last_block"
UNIT = 64  # the 122B profiles' prefix_match_unit (recipes/qwen3.5-122b-a10b.yaml)
DENSE_TOKENS = 6


# ---- the anchors, in each version's source

@pytest.mark.vllm
@pytest.mark.parametrize("version, expected", [
    # no partial-hit machinery at all (no CoW bookkeeping, no partial entries)
    ("0.25.1", ["differs", "apply", "differs", "differs", "differs"]),  # its base caching asks the mask too
    ("0.26.0", ["apply"] * 5),
    ("0.33.0", ["apply"] * 5),
    ("0.34.0", ["apply"] * 5),
])
def test_anchors_against_each_versions_source(version, expected):
    root = _root(version)
    assert [a.verdict(function_source(root, a)) for a in ANCHORS] == expected


@pytest.mark.vllm
def test_the_texts_the_fix_rests_on():
    """What the module's docstring quotes: 0.26.0's sliding manager asserts on a lookup finer than its block; 0.33.0 /
    0.34.0 turn partial hits off for a model with a manager that does not support them; the sliding
    manager overrides none of the base class's CoW path in any of them."""
    import ast

    src = (_root("0.26.0") / "vllm/v1/core/single_type_kv_cache_manager.py").read_text()
    assert '"SlidingWindowManager does not support fine-grained (partial) cache hits"' in src
    for v in ("0.33.0", "0.34.0"):
        utils = " ".join((_root(v) / "vllm/v1/core/kv_cache_utils.py").read_text().split())
        assert "and not manager_cls.supports_fine_grained_hash_lookup" in utils, v
        assert '"Disabling fine-grained prefix-cache hits because these KV "' in utils, v
    for v in ("0.26.0", "0.33.0", "0.34.0"):
        tree = ast.parse((_root(v) / "vllm/v1/core/single_type_kv_cache_manager.py").read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SlidingWindowManager")
        own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert not own & set(window_hits.NOT_OVERRIDDEN), (v, own)
        assert "supports_fine_grained_hash_lookup" not in {t.id for n in cls.body if isinstance(n, ast.AnnAssign)
                                                           for t in [n.target] if isinstance(t, ast.Name)}, v


# ---- the lookup on a stand-in pool

class Pool:
    """Blocks cached by hash (hash -> block), as ``BlockPool.get_cached_block`` answers per group."""

    null_block = "null"

    def __init__(self, cached: dict[str, str]):
        self.cached = cached

    def get_cached_block(self, block_hash, group_ids):
        got = self.cached.get(block_hash)
        return [got] * len(group_ids) if got else None


def hashes(n_units: int) -> list[str]:
    return [f"h{i + 1}" for i in range(n_units)]  # h{k}: the prefix of k units


def test_a_partial_hit_needs_the_window_and_the_partial_tail():
    # unit 4, block 16, window 20: a hit at 40 tokens reads [21, 40): blocks 1 (16-31) and 2 (32-47, partial)
    pool = Pool({"h4": "A", "h8": "B", "h10": "C-partial", "h12": "C"})
    blocks, hit = window_hit(hashes(12), 44, [0, 1], pool, window=20, block=16, unit=4, drop_last_unit=False)
    assert hit == 40 and blocks == (["null", "B", "C-partial"],) * 2
    # the same window, block 1 not cached: no hit reaches past 16 tokens; the first block's own hash is
    pool = Pool({"h4": "A", "h10": "C-partial", "h12": "C"})
    blocks, hit = window_hit(hashes(12), 44, [0], pool, window=20, block=16, unit=4, drop_last_unit=False)
    assert hit == 16 and blocks == (["A"],)
    # nothing cached at a unit boundary: no hit
    assert window_hit(hashes(12), 44, [0], Pool({}), 20, 16, 4, False) == (([],), 0)


def test_the_longest_hit_is_taken_and_max_length_bounds_it():
    pool = Pool({"h4": "A", "h8": "B", "h9": "C-part", "h12": "C-part2"})
    assert window_hit(hashes(12), 48, [0], pool, 20, 16, 4, False)[1] == 48  # h12 ends block 2 (full)
    assert window_hit(hashes(12), 47, [0], pool, 20, 16, 4, False)[1] == 36  # bounded: h9, inside block 2
    blocks, hit = window_hit(hashes(12), 47, [0], pool, 20, 16, 4, False)
    assert blocks == (["null", "B", "C-part"],)  # window 20 at 36 tokens reaches back to token 17: block 1


def test_an_eagle_group_drops_one_unit_and_reads_its_window():
    # matched end 40 (partial C), hit 36: the window at 36 reaches token 17, block 1; the tail block holds 36
    pool = Pool({"h4": "A", "h8": "B", "h10": "C-partial"})
    blocks, hit = window_hit(hashes(12), 44, [0], pool, 20, 16, 4, drop_last_unit=True)
    assert hit == 36 and blocks == (["null", "B", "C-partial"],)
    # a matched end on a block boundary drops back into the block before: that block's own hash counts
    pool = Pool({"h4": "A", "h8": "B"})
    blocks, hit = window_hit(hashes(8), 32, [0], pool, 20, 16, 4, drop_last_unit=True)
    assert hit == 28 and blocks == (["A", "B"],)


# ---- vLLM's own KV planning, manager and scheduler split (kv_probe.py)

# the layouts per version: (name, fixes, --prefix-match-unit and --block-size). stock: vLLM alone;
# prefix_align: the plugin's padded layout (0.26.0 only); fine_grained: vLLM's own pages with the unit,
# without and with the fix. 0.26.0 drops DFlash's last block as EAGLE's unless dflash_keep_last_block
LAYOUTS = {
    "0.26.0": [("stock", "none", None), ("prefix_align", f"prefix_align,{KEEP}", None),
               ("fine_grained, fix off", KEEP, UNIT), ("fine_grained", f"{KEEP},{FIX_ID}", UNIT)],
    "0.33.0": [("stock", "none", None), ("fine_grained, fix off", "none", UNIT), ("fine_grained", FIX_ID, UNIT)],
}
LAYOUTS["0.34.0"] = LAYOUTS["0.33.0"]
_RUNS: dict[str, dict] = {}


def layouts(version: str, tmp: Path) -> dict[tuple[str, str, int], dict]:
    """Every layout x drafter shape x speculative tokens (6: the dense profile; 12: dflash) of ``version``
    in one ``kv_probe.py --cases`` process (cached); by (shape, layout, tokens)."""
    if version not in _RUNS:
        cases = [{"version": version, "shape": shape, "layout": name, "fixes": fixes, "unit": unit,
                  "block_flag": unit, "spec_tokens": tokens}
                 for tokens in (DENSE_TOKENS, 12) for name, fixes, unit in LAYOUTS[version]
                 for shape in ("mixed", "full6")]
        results = vllm_sources.run_kv_cases(version, cases, tmp)
        _RUNS[version] = {(x["shape"], x["layout"], x["spec_tokens"]): x for x in results}
    return _RUNS[version]


def _hits(res: dict) -> dict[str, int]:
    return {k: v["warm_hit"] for k, v in res.get("hits", {}).items()}


@pytest.mark.vllm
@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_the_real_drafter_hits_the_whole_prefix_at_the_stock_pool(version, tmp_path):
    """With the real drafter (5 sliding + 1 full) and 6 speculative tokens, the fine_grained layout with
    the fix hits >= 95% of every warm prompt at 8k / 32k / 64k (the whole shared prefix) and its pool is
    within 2% of vLLM's own layout's; without the fix 0.26.0 stops at vLLM's assertion on the first
    partial hit and 0.33.0 / 0.34.0 turn partial hits off (the hits fall back to the coarse block grid);
    on 0.26.0 prefix_align's padding costs over a third of the pool and misses the 8k mark."""
    runs = layouts(version, tmp_path)
    stock, fixed = runs[("mixed", "stock", DENSE_TOKENS)], runs[("mixed", "fine_grained", DENSE_TOKENS)]
    off = runs[("mixed", "fine_grained, fix off", DENSE_TOKENS)]
    assert fixed["install"][FIX_ID] == "applied" and FIX_ID not in off["install"]
    assert fixed["hash_block_size"] == UNIT and all(g["block_size"] % UNIT == 0 for g in fixed["groups"])
    for ctx, h in fixed["hits"].items():
        assert h["cold_hit"] == 0 and h["warm_hit"] >= 0.95 * h["prompt"], (ctx, h)
        assert h["warm_hit"] == int(ctx), (ctx, h)  # the whole shared prefix
    assert abs(fixed["pool_tokens"] / stock["pool_tokens"] - 1) <= 0.02, (fixed["pool_tokens"], stock["pool_tokens"])
    assert min(_hits(stock)[c] / h["prompt"] for c, h in stock["hits"].items()) < 0.95  # what the fix changes
    if version == "0.26.0":
        assert "SlidingWindowManager does not support fine-grained (partial) cache hits" in off["error"]
        aligned = runs[("mixed", "prefix_align", DENSE_TOKENS)]
        assert aligned["pool_tokens"] < 0.7 * fixed["pool_tokens"]
        assert aligned["hits"]["8192"]["warm_hit"] < 0.95 * aligned["hits"]["8192"]["prompt"]
    else:
        assert off["partial_hits"] is False and fixed["partial_hits"] is True and "error" not in off
        assert _hits(off) == _hits(stock)
    full6 = runs[("full6", "fine_grained", DENSE_TOKENS)]  # no sliding layer: the fix changes nothing there
    assert _hits(full6) == _hits(fixed) == _hits(runs[("full6", "fine_grained, fix off", DENSE_TOKENS)])
    out = os.environ.get("HYBRID_BUILD_LAYOUT_TABLE")
    if out:  # the lab table: HYBRID_BUILD_LAYOUT_TABLE=FILE pytest -m vllm this file (every version)
        prev = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        rows = [{k: r.get(k) for k in ("version", "shape", "layout", "spec_tokens", "fixes", "unit", "pool_tokens",
                                       "num_blocks", "hash_block_size", "scheduler_block_size", "partial_hits",
                                       "error")}
                | {"block_sizes": sorted({g["block_size"] for g in r.get("groups", [])}),
                   "warm_hits": {c: [h["warm_hit"], h["prompt"]] for c, h in r.get("hits", {}).items()} or None}
                for r in runs.values()]
        prev["rows"] = [r for r in prev.get("rows", []) if r["version"] != version] + rows
        prev["basis"] = (
            "vLLM's own get_kv_cache_groups, get_kv_cache_config_from_groups, KVCacheManager (coordinator, block "
            "pool, block hasher) and Scheduler._mamba_block_aligned_split on CPU (tests/serve/kv_probe.py): the "
            "122B target, a DFlash drafter of the real shape (mixed: 5 sliding-window-4096 + 1 full layer; full6: "
            "6 full layers), bf16 KV; a cold request then the same prefix with another 32-token suffix, prompts "
            "of 8,224 / 32,800 / 65,568 tokens (warm_hits: [hit, prompt]); pool: the tokens vLLM logs at a KV "
            "budget of 547 x 55,050,240 B (the public GB10 log at gpu_memory_utilization 0.82). fine_grained: "
            "--block-size 64 --prefix-match-unit 64 (unit 64), with and without sliding_window_partial_hits")
        Path(out).write_text(json.dumps(prev, indent=1))


# ---- vLLM's own Scheduler through conversations (align_probe.py)

ALIGN_FIXES = {"0.26.0": f"{KEEP},mamba_state_seed", "0.33.0": "none", "0.34.0": "none"}


def _align(version: str, tmp: Path) -> tuple[dict, dict]:
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    base = ALIGN_FIXES[version]
    with_fix = FIX_ID if base == "none" else f"{base},{FIX_ID}"
    cases = f"mixed@{DENSE_TOKENS}:{base}:{UNIT};mixed@{DENSE_TOKENS}:{with_fix}:{UNIT}"
    env = dict(os.environ, **vllm_sources.cache_env(version),
               PYTHONPATH=os.pathsep.join([pp, os.environ.get("PYTHONPATH", "")]), VLLM_LOGGING_LEVEL="ERROR")
    argv = [str(HERE / "align_probe.py"), cases, str(tmp / "work"), str(tmp / "out.json")]
    r = vllm_sources.run_python(version, argv, env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    off, on = json.loads((tmp / "out.json").read_text())
    return off, on


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(ALIGN_FIXES))
def test_scheduler_keeps_the_invariants_with_partial_window_hits(version, tmp_path):
    """The real drafter's layout with --block-size 64 --prefix-match-unit 64, 2 conversations x 4 turns and a
    fork, random accepted counts: with the fix, 8 of 10 requests resume from a partial hit of every group
    (the sliding-window, full-attention and GDN tails copied on write) and no step breaks an invariant;
    without it 0.26.0's engine dies at the first request's lookup (vLLM's own assertion) and 0.33.0 / 0.34.0
    resume on the coarse block grid only."""
    off, on = _align(version, tmp_path)
    assert on["install"][FIX_ID] == "applied" and on["partial_hits"] is True
    assert on["groups"] == ["full 2176", "full 4352", "mamba 2176", "window 2176"] and on["hash_block"] == UNIT
    assert on["start"] is None and on["crash"] is None and on["violation"] is None, on
    resumed = [r for r in on["requests"] if r["hit"]]
    assert len(on["requests"]) == 10 and len(resumed) == 8 and all(r["partial"] for r in resumed)
    assert all(r["seed"] == (r["hit"] - 1) // on["mamba_block"] for r in resumed)
    if version == "0.26.0":
        assert "SlidingWindowManager does not support fine-grained (partial) cache hits" in (off["crash"] or ""), off
    else:
        assert off["partial_hits"] is False and off["crash"] is None and off["violation"] is None
        assert all(r["hit"] % 4352 == 0 for r in off["requests"])
        assert sum(r["hit"] for r in off["requests"]) < sum(r["hit"] for r in resumed)


@pytest.mark.vllm
def test_the_switch_through_the_plugins_register():
    """The plugin's register() on vLLM 0.26.0's real modules installs the fix by default and leaves vLLM's
    own sliding manager with HYBRID_BUILD_DISABLE_FIXES=sliding_window_partial_hits (one log line says so)."""
    pp = vllm_sources.cpu_pythonpath("0.26.0")
    if pp is None:
        pytest.skip("vLLM 0.26.0 sources not prepared (run .ci/vllm_sources.sh)")
    code = ("import json, logging; logging.basicConfig(level=logging.WARNING)\n"
            "from hybrid_build.serve.runtime import plugin; plugin.register()\n"
            "from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager as S\n"
            "f = S.__dict__['find_longest_cache_hit'].__func__\n"
            "print(json.dumps([S.supports_fine_grained_hash_lookup, getattr(f, 'hybrid_build_fix', False)]))")
    got = {}
    for off in ("", FIX_ID):
        env = dict(os.environ, **vllm_sources.cache_env("0.26.0"), PYTHONPATH=pp, VLLM_LOGGING_LEVEL="ERROR",
                   HYBRID_BUILD_DISABLE_FIXES=off)
        r = vllm_sources.run_python("0.26.0", ["-c", code], env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        got[off] = (json.loads(r.stdout.strip().splitlines()[-1]), r.stderr)
    assert got[""][0] == [True, True] and "take partial prefix-cache hits" in got[""][1]
    assert got[FIX_ID][0] == [False, False]
    assert f"runtime fix {FIX_ID} is off (HYBRID_BUILD_DISABLE_FIXES)" in got[FIX_ID][1]
