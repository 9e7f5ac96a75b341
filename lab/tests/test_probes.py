"""The probes and the unshipped Gluon kernel still load and compile with the Triton installed.

Not part of CI (``tests/`` is what CI runs: what ships); run by hand before a GPU call that uses
them: ``python -m pytest lab/tests -q``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from hybrid_build.serve.runtime import int8_gemv as g  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "lab" / "probes"


def test_probe_script_compares_the_two_tables():
    """probe_lmhead_sched.py (GPU only) imports what it needs from the bench script, and its
    before / after pair is each layout's B <= 16 table entry on that layout."""
    spec = importlib.util.spec_from_file_location("probe_lmhead_sched", PROBES / "probe_lmhead_sched.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    v = probe.variants()
    assert v["control"] == ("rows", g._H200_ROWS_TABLE[16], "full")
    assert v["tiled"] == ("tiled", g._H200_TABLE[16], "full")
    assert {stage for _, _, stage in v.values()} <= {"full", "no_store"}
    if not torch.cuda.is_available():  # without a GPU: one line and exit 2, nothing timed
        assert probe.main(["--out", "/dev/null"]) == 2


@pytest.mark.parametrize("script", ["probe_lmhead_wide.py", "probe_gluon_mma.py", "probe_head_power.py",
                                    "bench_gluon.py"])
def test_probe_without_gpu_says_so(script):
    """Each probe loads its helpers and, without a CUDA GPU, says so in one line and exits 2."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would run")
    proc = subprocess.run([sys.executable, str(PROBES / script), "--out", os.devnull], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().endswith("needs a CUDA GPU")


def test_gluon_candidate_compiles_for_the_h200():
    """gluon_i16_ws.py (the warp-specialized candidate for B = 33-64, checked and timed on the GPU
    by bench_gluon.py) keeps compiling for sm_90 with the Triton installed: int8 wgmma, TMA loads on
    mbarriers, a loader partition with its registers handed back (setmaxnreg.dec), within the H200's
    shared memory; its best variant (two consumer warp groups, 4 stages: 208 KiB). In a child:
    Triton fixed in interpreter mode at import cannot compile."""
    code = ("import sys; sys.path.insert(0, 'lab/probes'); import gluon_i16_ws as m, json; "
            "k = m.compile_for(90, stages=4, halves=2); "
            "p = k.asm['ptx']; print(json.dumps({'kib': k.metadata.shared / 1024, "
            "'wgmma_s8': 'wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8' in p, "
            "'tma': 'cp.async.bulk.tensor' in p, 'expect_tx': 'expect_tx' in p, 'dec': 'setmaxnreg.dec' in p}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["wgmma_s8"] and got["tma"] and got["expect_tx"] and got["dec"], got
    assert 0 < got["kib"] <= 227
