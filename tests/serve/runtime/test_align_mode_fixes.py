"""The align-mode crash-family fixes (``serve/runtime/align_mode_fixes.py``) against each vLLM
version's real source, and vLLM's own Scheduler and KV-cache manager driven through multi-turn
conversations with the fixes installed (``align_probe.py``, one subprocess per case)."""
from __future__ import annotations

import json
import os
import subprocess
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
    smallest block, and the preprocess kernel reads the live accepted-token buffer (0.33.0 too)."""
    for v in EXPECTED:
        body = function_source(_root(v), ANCHORS["mamba_eagle_drop"][0])
        assert body.count("drop_eagle_block") == 1, v  # the signature only
    for v in ("0.25.1", "0.26.0"):
        assert ") // self.cache_config.block_size" in function_source(_root(v), ANCHORS["mamba_state_seed"][0])
    assert "self.num_accepted_tokens_gpu," in function_source(_root("0.33.0"), ANCHORS["align_accept_snapshot"][0])


def _probe(version: str, shape: str, fixes: str, tmp_path: Path) -> dict:
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pp, os.environ.get("PYTHONPATH", "")]),
               VLLM_LOGGING_LEVEL="ERROR")
    r = subprocess.run([sys.executable, str(HERE / "align_probe.py"), shape, fixes, str(tmp_path / "work"), str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("version, shape, fixes", [
    ("0.25.1", "full6", "kv_unify,prefix_align,mamba_eagle_drop,mamba_state_seed"),
    ("0.26.0", "mixed", "prefix_align,mamba_state_seed"),
])
def test_scheduler_keeps_every_group_on_one_hit_with_every_fix(version, shape, fixes, tmp_path):
    """The real Scheduler.__init__ with the fixes installed: DFlash keeps its last block in the manager
    and in the scheduler's GDN split, and every resumed request's hit ends at the same token in every
    group, with its GDN state at the column the V2 runner seeds, on every step."""
    res = _probe(version, shape, fixes, tmp_path)
    assert all(v == "applied" for v in res["install"].values()), res["install"]
    assert res["scheduler_use_eagle"] is True and res["manager_use_eagle"] is False  # the drop is off for DFlash
    assert res["violation"] is None, res["violation"]
    hits = [r["hit"] for r in res["requests"]]
    assert len(hits) == 10 and sum(h > 0 for h in hits) >= 6  # resumed from cached prefixes
    assert all(r["seed"] == (r["hit"] - 1) // 2240 for r in res["requests"] if r["hit"])
