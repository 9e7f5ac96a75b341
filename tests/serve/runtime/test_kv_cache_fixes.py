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
import subprocess
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
    ("0.25.1", {"kv_unify": ["apply"], "prefix_align": ["apply", "apply", "apply"]}),
    # 0.26.0 pads GDN pages itself; its scheduler still drops the last block for DFlash
    ("0.26.0", {"kv_unify": ["upstream"], "prefix_align": ["apply", "apply", "apply"]}),
    # 0.33 plans the KV cache in kv_cache_planning (GDN pages padded) and only drops for EAGLE
    ("0.33.0", {"kv_unify": ["upstream"], "prefix_align": ["differs", "upstream", "upstream"]}),
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


def _probe(version: str, shape: str, fixes: str, tmp_path: Path) -> dict:
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    out = tmp_path / f"{version}-{shape}-{fixes}.json"
    env = dict(os.environ, PYTHONPATH=pp, VLLM_LOGGING_LEVEL="ERROR")
    r = subprocess.run([sys.executable, str(HERE / "kv_probe.py"), shape, fixes, str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_stock_0251_stops_at_the_page_assert_with_the_real_drafter(tmp_path):
    res = _probe("0.25.1", "full6", "none", tmp_path)
    assert res["block_size"] == BLOCK and res["mamba_page_bytes"] == 4562944
    assert res["error"].startswith("AssertionError")


def _blocks(res: dict) -> set[int]:
    return {g["block_size"] for g in res["groups"]}


@pytest.mark.vllm
@pytest.mark.parametrize("version, shape, fixes", [("0.25.1", "full6", "kv_unify"), ("0.26.0", "mixed", "none")])
def test_without_prefix_align_a_warm_prefix_falls_back_to_an_earlier_chunk(version, shape, fixes, tmp_path):
    """The layout 0.26.0 measured on the H200 (warm 0.83 / 0.80 / 1.38 s vs cold 0.90 / 2.54 / 5.34 s
    at 8k / 32k / 64k): the target's attention at two GDN blocks, every group dropping its last block."""
    res = _probe(version, shape, fixes, tmp_path)
    assert _blocks(res) == {BLOCK, 2 * BLOCK} and res["scheduler_block_size"] == 2 * BLOCK
    assert res["manager_use_eagle"] is True
    assert {k: v["warm_hit"] for k, v in res["hits"].items()} == {"8192": 0, "32768": 26880, "65536": 53760}


@pytest.mark.vllm
@pytest.mark.parametrize("version, shape, fixes", [("0.25.1", "full6", "kv_unify,prefix_align"),
                                                    ("0.26.0", "mixed", "prefix_align"),
                                                    ("0.26.0", "full6", "prefix_align")])
def test_prefix_align_hits_up_to_the_last_block_boundary(version, shape, fixes, tmp_path):
    res = _probe(version, shape, fixes, tmp_path)
    assert res["install"]["prefix_align"] == "applied"
    assert _blocks(res) == {BLOCK} and len({g["page"] for g in res["groups"]}) == 1
    assert res["scheduler_block_size"] == res["hash_block_size"] == res["cache_block_size"] == BLOCK
    assert res["manager_use_eagle"] is False
    for ctx, h in res["hits"].items():
        assert h["cold_hit"] == 0
        assert h["warm_hit"] == h["prompt"] // BLOCK * BLOCK, ctx  # everything but the partial last block
    assert res["hits"]["65536"]["recomputed"] == 608


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
