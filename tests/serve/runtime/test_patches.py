"""The docker engine's runtime patches against vLLM 0.23.0's real sources (unpacked wheel).

Each anchor is found exactly once; the edit applies, applies again as a no-op, and the patched
module still compiles; a changed source makes the patch fail naming its anchor. The runtime
effect of the edits needs the sm121 image and a GPU: not exercised here.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_build.serve.runtime.patches import apply as apply_mod
from hybrid_build.serve.runtime.patches.anchors import AnchorError, Edit, Patch, apply_patch, apply_to_text

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import vllm_sources  # noqa: E402

PATCHES = apply_mod.all_patches()


@pytest.fixture(scope="module")
def vllm023(tmp_path_factory) -> Path:
    src = vllm_sources.unpacked("0.23.0")
    if src is None:
        pytest.skip("vLLM 0.23.0 sources not prepared (run .ci/vllm_sources.sh)")
    return src


@pytest.fixture
def site(vllm023, tmp_path) -> Path:
    """A private site-packages with only the files the patches touch."""
    for p in PATCHES:
        dst = tmp_path / p.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(vllm023 / p.path, dst)
    return tmp_path


@pytest.mark.vllm
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_anchor_found_once_applies_and_is_idempotent(patch, vllm023, site):
    original = (vllm023 / patch.path).read_text()
    for edit in patch.edits:
        assert original.count(edit.anchor) == 1, edit.name
    assert apply_patch(patch, site) == [e.name for e in patch.edits]
    patched = (site / patch.path).read_text()
    assert patched != original and all(e.sentinel in patched for e in patch.edits)
    compile(patched, patch.path, "exec")
    assert apply_patch(patch, site) == []
    assert (site / patch.path).read_text() == patched


@pytest.mark.vllm
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_changed_source_fails_naming_the_anchor(patch, site):
    path = site / patch.path
    edit = patch.edits[0]
    path.write_text(path.read_text().replace(edit.anchor, edit.anchor.replace("(", "( ", 1).replace(" ", "  ", 1)))
    with pytest.raises(AnchorError, match=f"anchor {edit.name!r} found 0 times in .*{Path(patch.path).name}"):
        apply_patch(patch, site)


@pytest.mark.vllm
def test_apply_entry_point_checks_everything_before_writing(site, tmp_path_factory):
    kv = site / PATCHES[0].path
    before = {p.path: (site / p.path).read_text() for p in PATCHES}
    fla = next(p for p in PATCHES if p.name == "fla-smem-sm121")
    (site / fla.path).write_text(before[fla.path].replace(fla.edits[0].anchor, "        return True\n"))
    r = subprocess.run([sys.executable, "-m", "hybrid_build.serve.runtime.patches.apply", "--site-packages", str(site)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "fla-smem-threshold" in r.stderr and r.stderr.count("\n") == 1
    assert kv.read_text() == before[PATCHES[0].path], "no file may change when one anchor is missing"
    (site / fla.path).write_text(before[fla.path])
    # as in the container: the runtime folder alone, run as a script by a Python without site-packages
    # (no hybrid-build installed)
    mounted = tmp_path_factory.mktemp("opt") / "runtime"
    shutil.copytree(Path(apply_mod.__file__).parent.parent, mounted, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-I", "-S", str(mounted / "patches" / "apply.py"),
                        "--site-packages", str(site)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("applied") == len(PATCHES)
    assert all((site / target).exists() for p in PATCHES for _, target in p.copies)
    assert any(p.copies for p in PATCHES)


def test_edit_without_sentinel_is_refused():
    p = Patch("p", "x.py", (Edit("a", "x = 1\n", "x = 2\n"),))
    with pytest.raises(AnchorError, match="sentinel"):
        apply_to_text(p, "x = 1\n", "x.py")


def test_patched_module_must_compile(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n")
    p = Patch("p", "m.py", (Edit("a", "x = 1\n", "# hybrid-build patch: a\nx = (\n"),))
    with pytest.raises(AnchorError, match="does not compile"):
        apply_patch(p, tmp_path)
    assert (tmp_path / "m.py").read_text() == "x = 1\n"


UNIFY_RUN = '''
import ast, json, sys
import torch
from vllm.v1.core import kv_cache_utils as k
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
patched = open(sys.argv[1]).read()
fn = next(n for n in ast.parse(patched).body
          if isinstance(n, ast.FunctionDef) and n.name == "unify_kv_cache_spec_page_size")
if sys.argv[2] == "patched":
    exec(compile(ast.Module([fn], []), "patched", "exec"), k.__dict__)
# the 122B (block 2240, GDN page padded to the attention page) and its real drafter (8 kv x 128)
gdn = ((12288, 15), (64, 128, 128))
spec = {"attn": FullAttentionSpec(block_size=2240, num_kv_heads=2, head_size=256, dtype=torch.bfloat16),
        "gdn": MambaSpec(shapes=gdn, dtypes=(torch.bfloat16, torch.float32), block_size=2240,
                         page_size_padded=2240 * 2048),
        "draft": FullAttentionSpec(block_size=2240, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)}
try:
    out = k.unify_kv_cache_spec_page_size(spec)
    print(json.dumps({n: [s.block_size, s.page_size_bytes] for n, s in out.items()}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__}))
'''


@pytest.mark.vllm
def test_kv_unify_lets_0230_place_the_real_drafters_pages(site):
    """vLLM 0.23.0's own unify, stock and with the edit, on the 122B's pages and its drafter's."""
    kv = next(p for p in PATCHES if p.name == "kv-unify-drafter")
    stock_file = site / kv.path
    apply_patch(kv, site)
    pp = vllm_sources.cpu_pythonpath("0.23.0")
    if pp is None:
        pytest.skip("vLLM 0.23.0 CPU imports not prepared (run .ci/vllm_sources.sh)")
    import json
    import os

    got = {}
    for mode in ("stock", "patched"):
        r = vllm_sources.run_python("0.23.0", ["-c", UNIFY_RUN, str(stock_file), mode],
                                    dict(os.environ, **vllm_sources.cache_env("0.23.0"), PYTHONPATH=pp,
                                         VLLM_LOGGING_LEVEL="ERROR"), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        got[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["stock"] == {"error": "AssertionError"}
    page = 2 * 2240 * 2048
    assert got["patched"] == {"attn": [4480, page], "gdn": [2240, page], "draft": [2240, page]}
