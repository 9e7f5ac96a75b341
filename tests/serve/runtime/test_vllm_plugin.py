"""The vLLM plugin against the real vLLM sources of each supported version, on CPU.

vLLM's quantization package is imported in a subprocess (``vllm_probe.py``, one per version for all
its layer resolutions) with the unpacked wheel and a few pure-Python dependencies on PYTHONPATH
(``vllm_sources.py`` prepares them; the tests skip when they are not prepared). What is exercised:
the real ``INCConfig.from_config``, ``apply_vllm_mapper`` with the Qwen3.5 VL model's own prefixes,
its ``packed_modules_mapping``, ``get_quant_method`` and INC's scheme factory, for every linear and
MoE layer of the artifact. Also run: vLLM's Marlin MoE weight preparation (its CUDA repack stubbed)
with and without the plugin's fix, and the int8 head methods on vLLM's base classes. Not exercised:
loading a whole model and any kernel (no GPU, and the Qwen3.5 model module itself cannot be
imported on CPU because of torchvision's compiled ops).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hybrid_build.serve.runtime import plugin as vllm_plugin

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import vllm_sources  # noqa: E402


def _run_probe(script: str, version: str, out: Path, *args: str, timeout: int = 300, disable: str = "") -> dict:
    """Run ``script ARGS... OUT`` in a subprocess with vLLM ``version``'s sources importable, with
    ``disable`` as HYBRID_BUILD_DISABLE_FIXES; its JSON."""
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    env = dict(os.environ, **vllm_sources.cache_env(version), PYTHONPATH=pp, VLLM_LOGGING_LEVEL="ERROR",
               HYBRID_BUILD_DISABLE_FIXES=disable)
    env.pop(vllm_plugin.ENV_LM_HEAD, None)
    r = vllm_sources.run_python(version, [str(HERE / script), *args, str(out)], env, timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def resolved(tiny_artifact, tiny_checkpoint, tmp_path_factory):
    """``resolved(version, mode, which="artifact", disable="")``: the artifact's or the source
    checkpoint's layers through vLLM ``version``'s real INC config (``{"config_class", "layers"}``),
    ``mode`` stock or plugin; or, for ``mode`` marlin or head, what ``marlin_probe.py`` /
    ``head_probe.py`` report. One ``vllm_probe.py`` process per version and ``disable`` runs them all
    (stock first, then the plugin's ``register()``), kept for the module's tests."""
    paths = {"artifact": tiny_artifact, "checkpoint": tiny_checkpoint}
    runs: dict[tuple[str, str], dict] = {}

    def get(version: str, mode: str, which: str = "artifact", disable: str = "") -> dict:
        if (version, disable) not in runs:
            jobs = [f"{m}:{p}" for m in ("stock", "plugin") for p in paths.values()] + ["marlin", "head"]
            out = tmp_path_factory.mktemp("vllm-probe") / f"{version}.json"
            runs[(version, disable)] = _run_probe("vllm_probe.py", version, out, *jobs, disable=disable,
                                                  timeout=900)["runs"]
        return runs[(version, disable)][mode if mode in ("marlin", "head") else f"{mode}:{paths[which]}"]

    return get


def _expected(layer: str, info: dict) -> str:
    if layer.endswith("lm_head"):
        return "int8"
    if ".shared_expert." in layer:
        return "fp8"
    if layer.endswith("in_proj_ba"):
        return "bf16"
    return "int4"


def _observed(info: dict) -> str:
    if info["method"] in ("Fp8LinearMethod",) or info.get("scheme") == "INCFp8LinearScheme":
        assert info.get("fp8_block") == [128, 128]
        return "fp8"
    if info["method"] == "UnquantizedLinearMethod":
        return "bf16"
    if info.get("scheme") == "INCWNA16LinearScheme" or info["method"] == "INCWna16Scheme":
        return {4: "int4", 8: "int8"}[info["bits"]] + ("" if info["bits"] == 4 and info["group_size"] == 128
                                                       or info["bits"] == 8 and info["group_size"] == -1 else "?")
    return info["method"]


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.33.0", "0.34.0"])
def test_every_layer_resolves_to_its_scheme(version, tiny_artifact, resolved):
    result = resolved(version, "plugin")
    assert result["config_class"] == "HybridINCConfig"
    layers = result["layers"]
    n_layers = json.loads((tiny_artifact / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert sum(k.endswith("shared_expert.gate_up_proj") for k in layers) == n_layers
    assert sum(k.endswith("mlp.experts") for k in layers) == n_layers
    assert "language_model.lm_head" in layers
    wrong = {k: (_expected(k, v), _observed(v)) for k, v in layers.items() if _expected(k, v) != _observed(v)}
    assert not wrong, wrong


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.33.0", "0.34.0"])
def test_stock_vllm_misreads_the_fp8_shared_experts(version, resolved):
    """Without the plugin the same layers come out as 8-bit integer GPTQ: the plugin is needed."""
    layers = resolved(version, "stock")["layers"]
    shared = [v for k, v in layers.items() if ".shared_expert." in k]
    assert shared and all(_observed(v) != "fp8" for v in shared)


@pytest.mark.vllm
def test_what_the_card_says_stock_vllm_does_is_what_its_code_does(resolved):
    """The model card's serving note (``inc_hybrid.serving_note``) states, for vLLM 0.25.1 and 0.33.0,
    how stock INC resolves the FP8 shared experts and the int8 head: the real INCConfig of each
    version, on the artifact's quantization_config, resolves them so."""
    from hybrid_build.core.formats import inc_hybrid

    note = inc_hybrid.FORMAT.serving_note(int8_head=True)
    assert "In vLLM 0.25.1 and 0.33.0" in note
    assert "resolve to 8-bit integer GPTQ layers with group size 128" in note
    assert "0.25.1 resolves it as an unquantized layer, 0.33.0 as an 8-bit integer GPTQ layer" in note
    head = {"0.25.1": "UnquantizedLinearMethod", "0.33.0": "INCWNA16LinearScheme"}
    for version in ("0.25.1", "0.33.0"):
        layers = resolved(version, "stock")["layers"]
        shared = [v for k, v in layers.items() if ".shared_expert." in k]
        assert shared and all((v.get("scheme"), v.get("bits"), v.get("group_size")) == ("INCWNA16LinearScheme", 8, 128)
                              for v in shared), (version, shared)
        lm = layers["language_model.lm_head"]
        assert head[version] in (lm.get("scheme"), lm["method"]), (version, lm)
        assert lm.get("bits", 8) == 8


@pytest.mark.vllm
def test_switched_off_fp8_dispatch_leaves_the_shared_experts_to_stock_inc(resolved):
    """HYBRID_BUILD_DISABLE_FIXES=inc_fp8_dispatch through the real INCConfig of 0.33.0: the shared
    experts resolve as stock vLLM resolves them, the int8 head (another fix) as with the plugin."""
    off = resolved("0.33.0", "plugin", disable="inc_fp8_dispatch")
    stock = resolved("0.33.0", "stock")["layers"]
    assert off["config_class"] == "HybridINCConfig"
    layers = off["layers"]
    shared = {k: v for k, v in layers.items() if ".shared_expert." in k}
    assert shared and all(_observed(v) != "fp8" for v in shared.values())
    assert shared == {k: stock[k] for k in shared}
    assert _observed(layers["language_model.lm_head"]) == "int8"


@pytest.mark.vllm
def test_plugin_is_inert_on_the_source_checkpoint(resolved):
    stock = resolved("0.33.0", "stock", "checkpoint")["layers"]
    plugin = resolved("0.33.0", "plugin", "checkpoint")
    assert plugin["config_class"] == "HybridINCConfig" and plugin["layers"] == stock


# ---- pure-Python parts of the plugin (no vLLM needed)
FP8 = {"bits": 8, "data_type": "fp", "weight_block_size": [128, 128]}
PACKED = {"gate_up_proj": ["gate_proj", "up_proj"], "qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def test_fused_layer_is_fp8_only_when_every_part_is():
    p = "m.layers.0.mlp.shared_expert."
    extra = {p + "gate_proj": FP8, p + "up_proj": FP8}
    assert vllm_plugin.layer_fp8_block(extra, p + "gate_up_proj", PACKED) == (128, 128)
    assert vllm_plugin.layer_fp8_block(extra, "m.layers.0.self_attn.qkv_proj", PACKED) is None
    with pytest.raises(ValueError, match="mixes FP8"):
        vllm_plugin.layer_fp8_block({p + "gate_proj": FP8}, p + "gate_up_proj", PACKED)


def test_bare_lm_head_key_matches_the_nested_head():
    extra = {"lm_head": {"bits": 8, "group_size": -1, "sym": True, "data_type": "int"}}
    assert vllm_plugin.exact_entry(extra, "language_model.lm_head") is extra["lm_head"]
    assert vllm_plugin.exact_entry(extra, "language_model.not_lm_head") is None


def test_declares_hybrid(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENV_LM_HEAD, raising=False)
    assert vllm_plugin.declares_hybrid({"extra_config": {"a.b": FP8}})
    assert not vllm_plugin.declares_hybrid({"extra_config": {"a.b": {"bits": 16, "data_type": "float"}}})
    monkeypatch.setenv(vllm_plugin.ENV_LM_HEAD, "quantize-at-load")
    assert vllm_plugin.declares_hybrid({})


@pytest.mark.parametrize("n,k", [(1024, 256), (20000, 64)])  # 20000 rows cross the unpacking slices
def test_stored_gptq_head_unpacks_to_the_int8_rows_it_was_packed_from(n, k):
    import torch

    from hybrid_build.calibration.gptq import pack_int8_gptq
    from hybrid_build.calibration.int8_rows import quantize_int8_rows

    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    q, scale = quantize_int8_rows(w)
    qweight = pack_int8_gptq(q)
    rows, s = vllm_plugin.gptq_int8_rows(qweight, scale.to(torch.bfloat16).reshape(1, -1))
    assert rows.dtype == torch.int8 and rows.shape == (n, k)
    assert torch.equal(rows, q)
    assert torch.equal(s, scale.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="one group"):
        vllm_plugin.gptq_int8_rows(qweight, torch.ones(2, n))


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.33.0", "0.34.0"])
def test_int8_head_methods_run_on_vllms_base_classes(version, resolved):
    """Both int8 head paths through vLLM's own method classes, in a bf16, an fp16 and a float32
    engine: the head quantized at load, and the stored GPTQ head unpacked for the Triton GEMV.
    Logits come back in the engine's dtype. Bounds (derived in head_probe.py, per logit, float64):
    against the same int8 math, fp32 accumulation of exact products (gamma(K + 2) with
    u = 2^-23) plus the output rounding: fp16 (10-bit mantissa) 2^-11 relative + 2^-25 absolute,
    bf16 one ulp 2^-7 (the interpreter truncates); against the float head, plus the int8 rounding
    s_n (1/2 + 2^-16) sum_k |x_k| and the stored scale's rounding |s_n - s'_n| sum_k |x_k q_nk|.
    And, as a statistic, per-row int8 of a Gaussian head stays under the 0.01 the issue sets."""
    import torch

    from hybrid_build.serve.runtime.int8_gemv import kernel_available

    result = resolved(version, "head")
    # tiled once at load where the kernel runs (here: the Triton interpreter, which the probe inherits)
    layout = "tiled" if kernel_available(torch.device("cpu")) else "rows"
    assert sorted(result) == sorted(f"{m}/{d}" for m in ("at_load", "triton_head")
                                    for d in ("bfloat16", "float16", "float32"))
    for key, res in result.items():
        dtype = key.split("/")[1]
        assert res["base"], key
        # the float copy is released (at load); no GPTQ tensors left behind (Triton head)
        assert res["params"] == ["weight_int8", "weight_scale_row"], key
        assert res["codes_equal"] and res["weight_layout"] == layout, key
        assert res["out_dtype"] == dtype and res["finite"], key
        assert res["max_err_over_bound_int8"] <= 1.0, (key, res)
        assert res["max_err_over_bound_float"] <= 1.0, (key, res)
        assert res["bound_int8_over_max_logit"] < 0.02, (key, res)
        assert res["rel_vs_float_head"] < 0.01, (key, res)
    # fp16 keeps 3 more mantissa bits than bf16 through the same int8 math
    for method in ("at_load", "triton_head"):
        assert result[f"{method}/float16"]["rel_vs_int8_math"] < 2.0**-10
        assert result[f"{method}/float16"]["rel_vs_int8_math"] < result[f"{method}/bfloat16"]["rel_vs_int8_math"]


def _marlin_layout(shape: list[int], perms: dict) -> list[float]:
    """The scale layout Marlin's MoE kernel reads for [experts, groups, n] scales holding their own
    flat index: the grouped permutation when there is more than one group, else the channel-wise one
    (the rule vLLM's own w2 call encodes; measured on the H200 for w13, lab/gpu_runs.md)."""
    import torch

    experts, groups, n = shape
    perm = perms["grouped"] if groups > 1 else perms["single"]
    s = torch.arange(experts * groups * n, dtype=torch.float32).reshape(experts, groups * n)
    return s.reshape(experts, -1, len(perm))[:, :, perm].flatten().tolist()


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.33.0", "0.34.0"])
def test_marlin_moe_scale_fix_on_vllms_real_weight_prep(version, resolved):
    """vLLM's real Marlin MoE weight prep, on CPU: with experts of 128 and group 128 (hidden 256) the
    stock code gives the gate/up scales the channel-wise layout although they hold two groups; the
    plugin's fix gives every tensor the layout the kernel reads and leaves the shape stock vLLM got
    right (experts of 256) unchanged."""
    res = resolved(version, "marlin")
    assert res["installed"]
    stock, fixed, perms = res["stock"], res["fixed"], res["perms"]
    bug = stock["128"]
    assert bug["w13"] != _marlin_layout(bug["w13_shape"], perms)  # the upstream bug this fix exists for
    assert bug["w2"] == _marlin_layout(bug["w2_shape"], perms)
    for inter in ("128", "256"):
        for w in ("w13", "w2"):
            assert fixed[inter][w] == _marlin_layout(fixed[inter][f"{w}_shape"], perms), (inter, w)
    assert fixed["256"] == stock["256"]


@pytest.mark.vllm
def test_marlin_moe_scale_fix_switched_off_is_not_installed(tmp_path):
    """HYBRID_BUILD_DISABLE_FIXES=marlin_moe_scale: register() leaves vLLM 0.25.1's real
    ``marlin_moe_permute_scales`` as it is, so the bug's layout comes back."""
    res = _run_probe("marlin_probe.py", "0.25.1", tmp_path / "marlin.json", disable="marlin_moe_scale")
    assert not res["installed"]
    assert res["fixed"] == res["stock"]
    bug = res["fixed"]["128"]
    assert bug["w13"] != _marlin_layout(bug["w13_shape"], res["perms"])
