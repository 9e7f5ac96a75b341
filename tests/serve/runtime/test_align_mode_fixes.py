"""The align-mode crash-family fixes (``serve/runtime/align_mode_fixes.py``) against each vLLM
version's real source, and vLLM's own Scheduler and KV-cache manager driven through multi-turn
conversations with each fix off and on (``align_probe.py``, one subprocess per version)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hybrid_build.serve.runtime.align_mode_fixes import ANCHORS, state_of

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_sources  # noqa: E402
from test_kv_cache_fixes import _root, function_source  # noqa: E402

# version -> fix -> state, read in each version's source (docs/serve.md, "The align-mode crash family")
EXPECTED = {
    # 0.23.0's V2 runner has no align mode (the V1 runner serves it): the seed and snapshot texts are not there
    "0.23.0": {"mamba_eagle_drop": "applied", "mamba_state_seed": "refused", "align_accept_snapshot": "refused"},
    "0.25.1": {"mamba_eagle_drop": "applied", "mamba_state_seed": "applied", "align_accept_snapshot": "applied"},
    # 0.26.0's coordinator gives the GDN group no margin; 0.33.0 also seeds by mamba_block_size
    "0.26.0": {"mamba_eagle_drop": "upstream", "mamba_state_seed": "applied", "align_accept_snapshot": "applied"},
    "0.33.0": {"mamba_eagle_drop": "upstream", "mamba_state_seed": "upstream", "align_accept_snapshot": "applied"},
    "0.34.0": {"mamba_eagle_drop": "upstream", "mamba_state_seed": "upstream", "align_accept_snapshot": "applied"},
}


@pytest.mark.vllm
@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_anchors_against_each_versions_source(version):
    root = _root(version)
    got = {fix: state_of([a.verdict(function_source(root, a)) for a in anchors]) for fix, anchors in ANCHORS.items()}
    assert got == EXPECTED[version]


@pytest.mark.vllm
def test_the_texts_the_defects_rest_on():
    """What the module's docstring quotes: the GDN lookup never reads the drop flag (every version),
    0.25.1's coordinator gives every dropping group a block of margin, 0.25.1 / 0.26.0 seed by the
    smallest block, and the preprocess kernel reads the live accepted-token buffer (0.33.0 and 0.34.0 too)."""
    for v in EXPECTED:
        body = function_source(_root(v), ANCHORS["mamba_eagle_drop"][0])
        assert body.count("drop_eagle_block") == 1, v  # the signature only
    for v in ("0.25.1", "0.26.0"):
        assert ") // self.cache_config.block_size" in function_source(_root(v), ANCHORS["mamba_state_seed"][0])
    for v in ("0.33.0", "0.34.0"):
        assert "self.num_accepted_tokens_gpu," in function_source(_root(v), ANCHORS["align_accept_snapshot"][0]), v


def _probe(version: str, cases: str, tmp_path: Path) -> dict[str, dict]:
    """Every case of one version in one subprocess; results by ``shape:fixes``."""
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    out = tmp_path / "out.json"
    env = dict(os.environ, **vllm_sources.cache_env(version),
               PYTHONPATH=os.pathsep.join([pp, os.environ.get("PYTHONPATH", "")]),
               VLLM_LOGGING_LEVEL="ERROR")
    r = vllm_sources.run_python(version, [str(HERE / "align_probe.py"), cases, str(tmp_path / "work"), str(out)],
                                env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return {case: res for case, res in zip(cases.split(";"), json.loads(out.read_text()))}


def _clean(res: dict, min_hits: int = 6) -> None:
    """The layout started, every step kept the invariants, and requests resumed from cached prefixes."""
    assert res["start"] is None and res["crash"] is None, (res["start"], res["crash"])
    assert res["violation"] is None, res["violation"]
    assert len(res["requests"]) == 10 and sum(r["hit"] > 0 for r in res["requests"]) >= min_hits
    assert all(r["seed"] == (r["hit"] - 1) // res["mamba_block"] for r in res["requests"] if r["hit"])


# a group below the GDN block in align mode: the coordinator needs every block divisible by the hash
# block, which 0.25.1 / 0.26.0 take as the LCM when a GDN block differs from cache_config.block_size
NO_START = "divisible by hash_block_size"
# each version's cases, run in this order (a fix stays installed once on: it is off first); a DFlash
# case with prefix_align names dflash_keep_last_block too, as the plugin installs both by default
CASES = {
    "0.25.1": "sliding6:none;mtp:none;mtp:mamba_eagle_drop;"
              "full6:kv_unify,prefix_align,mamba_eagle_drop,mamba_state_seed,dflash_keep_last_block",
    "0.26.0": "mtp:none;sliding6:none;mixed:none;mixed:prefix_align,mamba_state_seed,dflash_keep_last_block",
    "0.33.0": "mtp:none;mixed:none",
    "0.34.0": "mtp:none;mixed:none",
}


@pytest.mark.vllm
@pytest.mark.slow
def test_0251_mtp_hit_runs_past_the_attention_hit_without_mamba_eagle_drop(tmp_path):
    """The `mtp` profile's layout (the MTP layer in the target's attention group, every group on the
    GDN block, the EAGLE drop on): with mamba_eagle_drop off, the GDN lookup ignores the drop and
    the coordinator returns a hit one block past the attention groups' (the resumed request's
    attention block there was never computed); with it on, every step keeps the invariants. A group
    below the GDN block (the state seed's defect) does not start at all."""
    res = _probe("0.25.1", CASES["0.25.1"], tmp_path)
    assert NO_START in (res["sliding6:none"]["start"] or ""), res["sliding6:none"]
    off, on = res["mtp:none"], res["mtp:mamba_eagle_drop"]
    assert off["install"] == {} and on["install"] == {"mamba_eagle_drop": "applied"}
    assert off["groups"] == on["groups"] and len({g.split()[1] for g in on["groups"]}) == 1  # one block
    assert off["manager_use_eagle"] is True and on["manager_use_eagle"] is True  # MTP drops the last block
    assert off["crash"] is None and "held no cached KV before this step" in (off["violation"] or ""), off
    _clean(on)
    full6 = res["full6:kv_unify,prefix_align,mamba_eagle_drop,mamba_state_seed,dflash_keep_last_block"]
    assert set(full6["install"]) == set(full6["fixes"]), full6["install"]  # each named fix was installed
    assert all(v == "applied" for v in full6["install"].values()), full6["install"]
    assert full6["scheduler_use_eagle"] is True and full6["manager_use_eagle"] is False  # no drop for DFlash
    _clean(full6)


@pytest.mark.vllm
@pytest.mark.slow
def test_0260_keeps_the_invariants_and_refuses_a_smaller_group(tmp_path):
    """0.26.0's coordinator gives the GDN group no margin: the MTP layout keeps the invariants with no
    fix; the real drafter's layout keeps them stock and with the fixes; a drafter group below the GDN
    block (the only layout where the V2 runner's seed would divide by the wrong block) does not start."""
    res = _probe("0.26.0", CASES["0.26.0"], tmp_path)
    _clean(res["mtp:none"])
    assert NO_START in (res["sliding6:none"]["start"] or ""), res["sliding6:none"]
    _clean(res["mixed:none"], min_hits=3)
    fixed = res["mixed:prefix_align,mamba_state_seed,dflash_keep_last_block"]
    assert set(fixed["install"]) == set(fixed["fixes"]), fixed["install"]  # each named fix was installed
    assert all(v == "applied" for v in fixed["install"].values()), fixed["install"]
    assert fixed["manager_use_eagle"] is False
    _clean(fixed)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_v2_runner_versions_keep_the_invariants_stock(version, tmp_path):
    """0.33.0 (V2 by default) and 0.34.0 (V2 only) with no fix: the MTP and the real drafter's layouts."""
    res = _probe(version, CASES[version], tmp_path)
    _clean(res["mtp:none"])
    _clean(res["mixed:none"], min_hits=3)
