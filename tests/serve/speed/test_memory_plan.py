"""``serve/speed/memory_plan.py`` against vLLM's own KV-cache planning and ``KVCacheManager``, on CPU.

One subprocess per vLLM version (``kv_pool_probe.py``) runs every case: the 122B, 35B and 397B
recipes' serve profiles (their speculative method and tokens, KV dtype, prefix caching, the
layout serve installs on that version, ``max_model_len``), the DFlash profiles with the real
drafter's shape in both layer layouts, at a KV budget of 547 blocks of the 122B's stock page (the
public GB10 log at ``gpu_memory_utilization`` 0.82). The plan's pool (the figure vLLM logs) must be
within 1% of vLLM's, and the streams of 32k / 100k tokens the manager admits must be the plan's.
On 0.26.0 the same subprocess also runs a real engine start (``data/h100_run15.json``: the 122B at
full depth, 64 experts, the mixed drafter, ``prefix_align``): vLLM's planning on CPU and the plan
must both give the pool that engine logged.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hybrid_build.recipes.schema import load_recipe
from hybrid_build.serve.speed import memory_plan as mp

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import vllm_sources  # noqa: E402

sys.path.insert(0, str(HERE.parents[1] / "scripts" / "gpu"))
from agent_steps import drafter_config  # noqa: E402

from hybrid_build.pipeline.generators import synthetic as syn  # noqa: E402

BUDGET = 547 * 55_050_240  # bytes: lab/results/kv_pool_plan_vs_vllm_cpu.json states its basis
CONTEXTS = (32768, 100000)
RUN15 = json.loads((Path(__file__).parent / "data" / "h100_run15.json").read_text())
RUN15_ID = "h100-run15/122b-L48-e64/dense/mixed/prefix_align"


def run15_available_bytes() -> int:
    """The KV bytes that engine had: its ``--kv-cache-memory`` suggestion is the profiled budget
    less a 150 MiB buffer, from the same weight / peak / non-torch terms (0.26.0 gpu_worker.py;
    no CUDA graphs under enforce-eager), so the budget is the suggestion + 150 MiB."""
    return RUN15["logged"]["kv_cache_memory_suggestion"] + RUN15["logged"]["suggestion_buffer_bytes"]


def run15_inputs(**changes) -> mp.MemoryInputs:
    sv = RUN15["serve"]
    kw = dict(text_config=RUN15["text_config"], drafter_config=RUN15["drafter_config"], method=sv["method"],
              num_speculative_tokens=sv["num_speculative_tokens"], layout=sv["layout"],
              prefix_caching=sv["prefix_caching"], gpu_memory_utilization=sv["gpu_memory_utilization"],
              max_model_len=sv["max_model_len"], engine="0.26.0", async_scheduling=sv["async_scheduling"],
              max_num_batched_tokens=sv["max_num_batched_tokens"], kv_cache_memory_bytes=run15_available_bytes())
    return mp.MemoryInputs(**{**kw, **changes})


def run15_case() -> tuple[dict, mp.MemoryInputs]:
    i = run15_inputs()
    return ({"id": RUN15_ID, "text_config": i.text_config, "drafter_config": i.drafter_config, "method": i.method,
             "num_speculative_tokens": i.num_speculative_tokens, "kv_bytes": 2, "caching": True,
             "fixes": ["prefix_align"], "max_model_len": i.max_model_len,
             "available_memory": i.kv_cache_memory_bytes, "async_scheduling": i.async_scheduling,
             "contexts": [32768]}, i)


def text_config(recipe: str) -> dict:
    if recipe == "qwen3.5-122b-a10b":
        return dict(syn.QWEN35_122B_TEXT_CONFIG)
    if recipe == "qwen3.5-397b-a17b":
        return dict(syn.QWEN35_397B_TEXT_CONFIG)
    # the 35B's widths as scripts/gpu/driver.py gives them (hidden 2048, 40 layers 30 + 10, 16 / 32 GDN heads)
    return dict(syn.QWEN35_122B_TEXT_CONFIG, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                linear_num_value_heads=32,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)])


def cases(version: str) -> list[tuple[dict, mp.MemoryInputs]]:
    out = []
    for recipe in ("qwen3.5-122b-a10b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"):
        tc = text_config(recipe)
        for name, prof in load_recipe(recipe).serve.profiles.items():
            shapes = ("full6", "mixed") if prof.speculative and prof.speculative.method == "dflash" else (None,)
            for shape in shapes:
                if shape == "mixed" and version == "0.25.1":
                    continue  # its qwen3_dflash.py refuses the model (test_mixed_drafter_refused_on_0251)
                d = drafter_config(shape) if shape else None
                # the layout serve ships on this version, the one it falls back to without the unit, vLLM's own
                layouts = {mp.profile_layout(prof, version, drafter_config=d), "stock",
                           mp.profile_layout(prof, version, drafter_config=d, unit=False)} if shape else {"stock"}
                for layout in sorted(layouts):
                    i = mp.profile_inputs(tc, prof, version, d, layout=layout, kv_cache_memory_bytes=BUDGET)
                    fixes = (["kv_unify"] if version in ("0.23.0", "0.25.1") else []) + (
                        ["prefix_align"] if layout == "prefix_align" else [])
                    case = {"id": f"{recipe}/{name}/{shape or '-'}/{layout}", "text_config": tc,
                            "drafter_config": d, "method": i.method,
                            "num_speculative_tokens": i.num_speculative_tokens,
                            "kv_bytes": 1 if i.kv_cache_dtype.startswith("fp8") else 2, "caching": i.prefix_caching,
                            "fixes": fixes, "max_model_len": i.max_model_len, "available_memory": BUDGET,
                            "contexts": [c for c in CONTEXTS if c <= i.max_model_len],
                            "block_size": i.prefix_match_unit if layout == "fine_grained" else None}
                    out.append((case, i))
    if version == "0.26.0":
        out.append(run15_case())
    out.sort(key=lambda ci: "prefix_align" in ci[0]["fixes"])  # an installed prefix_align stays installed
    return out


def run_probe(version: str, tmp: Path) -> dict:
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    cs = cases(version)
    (tmp / "cases.json").write_text(json.dumps([c for c, _ in cs]))
    env = dict(os.environ, **vllm_sources.cache_env(version),
               PYTHONPATH=os.pathsep.join([pp, os.environ.get("PYTHONPATH", "")]),
               VLLM_LOGGING_LEVEL="ERROR")
    r = vllm_sources.run_python(version, [str(HERE / "kv_pool_probe.py"), str(tmp / "cases.json"),
                                          str(tmp / "out.json"), version], env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {r["id"]: r for r in json.loads((tmp / "out.json").read_text())}
    return {c["id"]: (c, i, got[c["id"]]) for c, i in cs}


def compare(version: str, tmp: Path) -> list[dict]:
    rows = []
    for cid, (_case, inputs, res) in run_probe(version, tmp).items():
        assert "crash" not in res, (cid, res.get("trace"))
        try:
            plan = mp.plan_memory(inputs)
        except mp.MemoryPlanError as e:
            assert "error" in res, f"{cid}: the plan refuses ({e}) but vLLM plans it"
            rows.append({"version": version, "case": cid, "vllm": res["error"], "plan": str(e)})
            continue
        assert "error" not in res, f"{cid}: vLLM refuses ({res['error']}) but the plan does not"
        err = plan.pool_tokens / res["pool_tokens"] - 1
        row = {"version": version, "case": cid, "vllm_pool_tokens": res["pool_tokens"],
               "plan_pool_tokens": plan.pool_tokens, "error": err, "vllm_blocks": res["num_blocks"],
               "plan_blocks": plan.num_blocks, "streams": {}}
        for ctx, s in res["streams"].items():
            fit = plan.streams_that_fit(int(ctx))
            row["streams"][ctx] = {"vllm": s, "plan": {"whole": fit.whole, "next_tokens": fit.next_tokens}}
        rows.append(row)
    return rows


@pytest.mark.vllm
@pytest.mark.parametrize("version", mp.ENGINE_VERSIONS)
def test_pool_and_streams_match_vllms_own_planning(version, tmp_path):
    rows = compare(version, tmp_path)
    bad = [r for r in rows if "error" in r and isinstance(r["error"], float) and abs(r["error"]) > 0.01]
    assert not bad, bad
    for r in rows:
        for ctx, s in r.get("streams", {}).items():
            assert s["plan"] == s["vllm"], (r["case"], ctx, s)
    if version == "0.26.0":  # the real engine's logged pool, by vLLM's planning on CPU and by the plan
        r = next(r for r in rows if r["case"] == RUN15_ID)
        logged = RUN15["logged"]["pool_tokens"]
        assert (r["vllm_pool_tokens"], r["plan_pool_tokens"]) == (logged, logged), r
    out = os.environ.get("HYBRID_BUILD_MEMORY_TABLE")
    if out:  # the lab table: HYBRID_BUILD_MEMORY_TABLE=FILE pytest ...
        prev = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        prev["rows"] = [r for r in prev.get("rows", []) if r["version"] != version] + rows
        Path(out).write_text(json.dumps(prev, indent=1))


def test_the_turn5_figures_of_the_122b_with_the_real_drafter():
    """The pool vLLM 0.26.0's own planning gave on CPU (448,102 stock, 327,380 prefix_align) at 547
    blocks, and the streams of 100k the manager admitted (3 and 2)."""
    prof = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"]
    prof = prof.model_copy(update={"speculative": prof.speculative.model_copy(update={"num_speculative_tokens": 12})})
    tc = text_config("qwen3.5-122b-a10b")
    got = {}
    for layout in ("stock", "prefix_align"):
        p = mp.plan_memory(mp.profile_inputs(tc, prof, "0.26.0", drafter_config("full6"), layout=layout,
                                             kv_cache_memory_bytes=BUDGET))
        got[layout] = (p.num_blocks, p.pool_tokens, p.streams_that_fit(100000).whole, p.kv_bytes_per_token)
    assert got == {"stock": (547, 448102, 3, 48 * 1024), "prefix_align": (547, 327380, 2, 72 * 1024)}


def test_the_h100_run15_pool():
    """The pool a real 0.26.0 engine logged (343,627 tokens at 41.72 GiB), from its configs and the
    budget its log gives; with one batch in flight (no async scheduling) a sliding-window drafter
    layer would count 7 blocks a request instead of 11, and the pool would be 2.1% larger."""
    logged = RUN15["logged"]
    assert round(run15_available_bytes() / 2**30, 2) == logged["available_kv_cache_gib"]
    p = mp.plan_memory(run15_inputs())
    assert p.pool_tokens == logged["pool_tokens"]
    assert round(p.pool_tokens / p.inputs.max_model_len, 2) == logged["max_concurrency"]
    sliding = [g for g in p.groups if g.kind == "sliding_window"]
    assert len(sliding) == 5 and {mp._max_request_blocks(g, p.inputs) for g in sliding} == {11}
    sync = mp.plan_memory(run15_inputs(async_scheduling=False))
    assert {mp._max_request_blocks(g, sync.inputs) for g in sync.groups if g.kind == "sliding_window"} == {7}
    assert sync.num_blocks == p.num_blocks and sync.pool_tokens > p.pool_tokens * 1.02


def test_log_comparison_warns_beyond_two_percent():
    prof = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"]
    p = mp.plan_memory(mp.profile_inputs(text_config("qwen3.5-122b-a10b"), prof, "0.26.0", drafter_config("full6"),
                                         layout="stock", kv_cache_memory_bytes=BUDGET))
    near = (f"(EngineCore pid=1) INFO 12-05 kv_cache_utils.py:2177] GPU KV cache size: "
            f"{int(p.pool_tokens * 1.015):,} tokens")
    far = "INFO [kv_cache_utils.py] GPU KV cache size: 327,380 tokens, Maximum concurrency for 262,144 tokens"
    assert mp.log_pool_tokens(near) == int(p.pool_tokens * 1.015)
    assert mp.compare_with_log(p, near) is None
    warning = mp.compare_with_log(p, far)
    assert warning and "327,380" in warning and f"{p.pool_tokens:,}" in warning
    assert mp.compare_with_log(p, "no pool line here") is None


def test_mixed_drafter_refused_on_0251():
    prof = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"]
    with pytest.raises(mp.MemoryPlanError, match="NotImplementedError"):
        mp.plan_memory(mp.profile_inputs(text_config("qwen3.5-122b-a10b"), prof, "0.25.1", drafter_config("mixed"),
                                         kv_cache_memory_bytes=BUDGET))


def test_the_fine_grained_layout_of_the_dense_profile():
    """The dense profile with the real (mixed) drafter: on 0.26.0 and 0.33.0 serve ships the fine_grained
    layout (--block-size 64 --prefix-match-unit 64, vLLM's own pages); the pool vLLM's own planning gave
    on CPU at 547 blocks (740,403, lab/results/prefix_layouts_real_drafter_cpu.json) against vLLM's
    stock layout's (745,259 at the 2,160 block on 0.26.0; 740,403 on 0.33.0) and prefix_align's (462,455),
    4 streams of 100k where prefix_align holds 3. A launch that does not pass the unit (docker, an
    unknown version) plans the layout it then gets."""
    prof = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"]
    tc, mixed = text_config("qwen3.5-122b-a10b"), drafter_config("mixed")

    def plan(version, layout=None):
        return mp.plan_memory(mp.profile_inputs(tc, prof, version, mixed, layout=layout, kv_cache_memory_bytes=BUDGET))

    for version, stock_pool in (("0.26.0", 745259), ("0.33.0", 740403)):
        fine = plan(version)
        assert fine.inputs.layout == "fine_grained" and fine.inputs.prefix_match_unit == 64 == fine.hit_unit
        assert {g.block_size for g in fine.groups} == {2176, 4352} and fine.pool_tokens == 740403
        assert plan(version, "stock").pool_tokens == stock_pool
        assert abs(fine.pool_tokens / stock_pool - 1) <= mp.LOG_DRIFT
        assert fine.streams_that_fit(100000).whole == 4
        assert fine.to_json()["layout"] == "fine_grained" and fine.to_json()["hit_unit"] == 64
    aligned = plan("0.26.0", "prefix_align")
    assert aligned.pool_tokens == 462455 and aligned.streams_that_fit(100000).whole == 3 and aligned.hit_unit == 2160
    # the fallbacks: without the unit, with the fix or dflash_keep_last_block off, on 0.25.1
    assert mp.profile_layout(prof, "0.26.0", drafter_config=mixed, unit=False) == "prefix_align"
    assert mp.profile_layout(prof, "0.33.0", drafter_config=mixed, unit=False) == "stock"
    assert mp.profile_layout(prof, "0.26.0", frozenset({mp.WINDOW_FIX}), mixed) == "prefix_align"
    assert mp.profile_layout(prof, "0.26.0", frozenset({mp.WINDOW_FIX}), drafter_config("full6")) == "fine_grained"
    assert mp.profile_layout(prof, "0.26.0", frozenset({"dflash_keep_last_block"}), mixed) == "prefix_align"
    assert mp.profile_layout(prof, "0.25.1", drafter_config=drafter_config("full6")) == "prefix_align"
    # the block follows the unit (--block-size): 48 gives vLLM's own 2,160 block on 0.26.0, lcm(48, 64) on 0.33.0
    assert {g.block_size for g in mp.with_changes(plan("0.26.0").inputs, prefix_match_unit=48).groups} == {2160, 4320}
    assert {g.block_size for g in mp.with_changes(plan("0.33.0").inputs, prefix_match_unit=48).groups} == {2304, 4608}


def test_the_start_check_tells_the_layouts_apart():
    """serve's start check (the pool vLLM logs against the plan, 2%): a server that came up with
    prefix_align's padded pages, or vLLM's stock 2,160 block, instead of the fine_grained layout planned
    is told apart (prefix_align by a warning; the stock block is within 1%, the same pool)."""
    prof = load_recipe("qwen3.5-122b-a10b").serve.profiles["dense"]
    i = mp.profile_inputs(text_config("qwen3.5-122b-a10b"), prof, "0.26.0", drafter_config("mixed"),
                          kv_cache_memory_bytes=BUDGET)
    fine = mp.plan_memory(i)
    line = "(EngineCore pid=1) INFO kv_cache_utils.py] GPU KV cache size: {:,} tokens"
    assert mp.compare_with_log(fine, line.format(740403)) is None
    warning = mp.compare_with_log(fine, line.format(mp.with_changes(i, layout="prefix_align").pool_tokens))
    assert warning and "462,455" in warning and "740,403" in warning
    assert mp.compare_with_log(fine, line.format(mp.with_changes(i, layout="stock").pool_tokens)) is None
