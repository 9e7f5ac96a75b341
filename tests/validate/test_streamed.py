"""The layer-streamed forward against transformers' own module code, its statistics, and what
it catches in a built artifact.

The transformers reference is a float32 ``Qwen3_5MoeForConditionalGeneration`` built from a
checkpoint's config (the tiny source, or an artifact the tool built from it), its stored weights
dequantized here by a separate reading of each layout (GPTQ zero points taken from ``qzeros``,
not assumed; FP8 blocks by reshaping), so that neither the module math nor the dequantization of
the streamed path is shared with the reference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybrid_build.core.errors import UserError
from hybrid_build.pipeline.stages import STAGES
from hybrid_build.validate.divergence import (
    PositionStats,
    bootstrap_mean_ci,
    divergence_report,
    position_stats,
    summarize,
)

MAX_TOKENS = 256  # per text, as the transformers end-to-end check (validate/transformers_forward.py) uses
SE = "model.language_model.layers.{}.mlp.shared_expert.{}_proj"


# ------------------------------------------------------------------------------ reference


def _dequant_auto_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """W [N, K] from auto_gptq tensors: codes packed along K (low bits first), zeros packed along
    N and stored minus one (GPTQ v1), scales [groups, N]."""
    per, mask = 32 // bits, (1 << bits) - 1
    qw = qweight.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(qw >> (bits * j)) & mask for j in range(per)], dim=1).reshape(-1, qweight.shape[1])
    qz = qzeros.to(torch.int64) & 0xFFFFFFFF
    zeros = torch.stack([(qz >> (bits * j)) & mask for j in range(per)], dim=2).reshape(qzeros.shape[0], -1) + 1
    g = codes.shape[0] // scales.shape[0]
    w = (codes - zeros.repeat_interleave(g, 0)).double() * scales.double().repeat_interleave(g, 0)
    return w.t().float()


def _checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128) * scale_inv.float()[:, None, :, None]
    return blocks.reshape(n, k)


def _reference_model(folder: Path):
    """transformers' model in float32 holding ``folder``'s weights: INT4 and int8 GPTQ (bits per
    module from the quantization config), FP8 blocks and BF16, each dequantized here."""
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    config = AutoConfig.from_pretrained(folder)
    quant = config.quantization_config
    extra = quant.get("extra_config") or {}
    del config.quantization_config  # a plain float32 model; the stored weights are dequantized below
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    tensors = _checkpoint_tensors(folder)

    def weight(module: str) -> torch.Tensor:
        if module + ".qweight" in tensors:
            return _dequant_auto_gptq(tensors[module + ".qweight"], tensors[module + ".qzeros"],
                                      tensors[module + ".scales"], extra.get(module, {}).get("bits", quant["bits"]))
        if module + ".weight_scale_inv" in tensors:
            return _dequant_fp8_blocks(tensors[module + ".weight"], tensors[module + ".weight_scale_inv"])
        return tensors[module + ".weight"].float()

    state = {}
    for name, param in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            state[name] = torch.stack([torch.cat([weight(f"{base}{j}.gate_proj"), weight(f"{base}{j}.up_proj")])
                                       for j in range(param.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            state[name] = torch.stack([weight(f"{base}{j}.down_proj") for j in range(param.shape[0])])
        elif name.endswith(".weight"):
            state[name] = weight(name.removesuffix(".weight"))
        else:
            state[name] = tensors[name].float()
        assert state[name].shape == param.shape, name
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def tiny_token_ids(tiny_checkpoint) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from hybrid_build.validate.transformers_forward import bundled_texts

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    return {name: tok(text)["input_ids"][:MAX_TOKENS] for name, text in bundled_texts().items()}


# ------------------------------------------------------------------ streamed == transformers


@pytest.fixture(scope="module")
def transformers_logits(tiny_token_ids):
    """``logits(folder)``: transformers' logits per text for a checkpoint folder, computed once."""
    cache: dict[Path, dict[str, torch.Tensor]] = {}

    def logits(folder: Path) -> dict[str, torch.Tensor]:
        if folder not in cache:
            model = _reference_model(folder)
            with torch.inference_mode():
                cache[folder] = {name: model(input_ids=torch.tensor([ids])).logits[0].float()
                                 for name, ids in tiny_token_ids.items()}
        return cache[folder]

    return logits


def _check_against_transformers(folder: Path, tiny_token_ids, reference: dict[str, torch.Tensor], device: str) -> None:
    from hybrid_build.validate.streamed import streamed_logits

    assert len(tiny_token_ids) == 3 and sum(map(len, tiny_token_ids.values())) > 300
    steps = []
    got = streamed_logits(folder, tiny_token_ids, device=device, vocab_chunk=256,
                          progress=lambda done, total, what: steps.append((done, total)))
    assert steps == [(i, 4) for i in range(1, 5)]  # one call per decoder layer
    for name, ids in tiny_token_ids.items():
        ref, out = reference[name], got[name]
        assert out.shape == ref.shape == (len(ids), 1024)
        rel = float((out - ref).norm() / ref.norm())
        # float32 throughout on both sides: what remains is summation order (~6e-7 measured); a
        # wrong norm form, rotary width, router normalisation or decay moves it above 0.1
        assert rel <= 1e-4, (name, rel)
        assert torch.equal(out.argmax(-1), ref.argmax(-1)), name
        print(f"\n{folder.name} {name} on {device}: {len(ids)} tokens, relative logits error {rel:.2e}")


def test_streamed_logits_match_transformers(tiny_checkpoint, tiny_token_ids, transformers_logits):
    _check_against_transformers(tiny_checkpoint, tiny_token_ids, transformers_logits(tiny_checkpoint), "cpu")


def test_streamed_logits_of_the_artifact_match_transformers(built_artifact, tiny_token_ids, transformers_logits):
    """The hybrid's own storage: FP8 block shared experts and the GPTQ int8 lm-head."""
    ref = transformers_logits(built_artifact)
    _check_against_transformers(built_artifact, tiny_token_ids, ref, "cpu")


@pytest.mark.gpu
def test_streamed_logits_on_cuda_match_transformers(tiny_checkpoint, tiny_token_ids, transformers_logits):
    """Dequantization and every layer on the GPU; the reference stays transformers on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_against_transformers(tiny_checkpoint, tiny_token_ids, transformers_logits(tiny_checkpoint), "cuda")


def test_streamed_forward_of_each_format_agrees(tiny_checkpoint, built_artifact, tiny_token_ids, tmp_path):
    """The inc-hybrid and compressed-tensors forms of one build hold the same codes (a bit-exact
    repack): their hidden states must be identical and their statistics against the source (each
    head read in vocabulary chunks: GPTQ columns, pack-quantized rows) equal up to the heads'
    scale dtype; the INT4 modules shared with the source must be dequantized once, not per
    checkpoint."""
    from hybrid_build.pipeline.build import prepare
    from hybrid_build.pipeline.runner import run_build
    from hybrid_build.recipes.conversion import plan_conversion
    from hybrid_build.validate.streamed import compare_streamed, streamed_hidden_states

    ct = tmp_path / "ct"
    ctx = prepare(tiny_checkpoint, ct, "tiny")
    ctx.recipe.output.format = "compressed-tensors"
    ctx.plan = plan_conversion(ctx.source, ctx.recipe)
    run_build(ctx, stages=[s for s in STAGES if s != "validate"])
    ids = {k: v[:64] for k, v in tiny_token_ids.items()}
    fwd = streamed_hidden_states([tiny_checkpoint, built_artifact, ct], ids, device="cpu")
    for name in ids:
        assert torch.equal(fwd.hidden[1][name], fwd.hidden[2][name]), name
        assert not torch.equal(fwd.hidden[0][name], fwd.hidden[1][name])  # FP8 shared experts moved them
    # per layer: 8 experts x 3 + attention projections + router are shared by all three;
    # shared experts (3) and their gate differ between source and hybrid only
    assert fwd.modules_shared > 2 * fwd.modules_dequantized / 3
    inc_vs_src, ct_vs_src = (compare_streamed(tiny_checkpoint, art, ids, device="cpu", vocab_chunk=256, resamples=50)
                             for art in (built_artifact, ct))
    for name in ids:
        assert torch.equal(inc_vs_src.hidden_artifact[name], ct_vs_src.hidden_artifact[name])
    # the heads hold the same int8 codes, but GPTQ stores their scales in float16 and
    # compressed-tensors in float32: ~5e-4 relative per row, ~3e-5 relative on the mean KL
    a, b = inc_vs_src.report["overall"], ct_vs_src.report["overall"]
    assert a["mean_kl"] > 0 and abs(a["mean_kl"] / b["mean_kl"] - 1) < 1e-3
    assert abs(a["same_top1"] - b["same_top1"]) <= 1 / a["tokens"]


# ---------------------------------------------------------------- source vs artifact, defects


def test_planted_shared_expert_scale_moves_end_to_end_kl(tiny_checkpoint, built_artifact, artifact_copy, plant,
                                                         tiny_token_ids):
    from hybrid_build.validate.streamed import compare_streamed

    clean = compare_streamed(tiny_checkpoint, built_artifact, tiny_token_ids, device="cpu", position_block=100,
                             vocab_chunk=256, resamples=200)
    # one block scale of layer 1's shared-expert down_proj x4 (the defect the weight check catches)
    module = SE.format(1, "down")
    plant.patch(artifact_copy, module + ".weight_scale_inv",
                lambda s: s.index_put_((torch.tensor(1), torch.tensor(0)), s[1, 0] * 4))
    bad = compare_streamed(tiny_checkpoint, artifact_copy, tiny_token_ids, device="cpu", position_block=100,
                           vocab_chunk=256, resamples=200)
    c, b = clean.report["overall"], bad.report["overall"]
    print(f"\nclean: KL {c['mean_kl']:.3g} {c['mean_kl_ci95']}, top-1 {c['same_top1']:.3f}, ppl ratio "
          f"{c['ppl_ratio']:.4f}\nplanted: KL {b['mean_kl']:.3g} {b['mean_kl_ci95']}, top-1 {b['same_top1']:.3f}, "
          f"ppl ratio {b['ppl_ratio']:.4f}")
    assert c["tokens"] == b["tokens"] == sum(len(v) - 1 for v in tiny_token_ids.values())
    assert set(clean.report["texts"]) == set(tiny_token_ids)
    assert 0 < c["mean_kl"] < 5e-3  # FP8 + int8 head on the tiny model: ~6e-4 (tests/validate/conftest.py)
    # measurably: the planted run's whole 95% interval lies above the clean run's
    assert b["mean_kl_ci95"][0] > c["mean_kl_ci95"][1]
    assert b["mean_kl"] > 2 * c["mean_kl"]
    # the hidden states the lm-head check will take: final-norm, one per position
    assert clean.hidden_source.keys() == tiny_token_ids.keys()
    for name, ids in tiny_token_ids.items():
        assert clean.hidden_source[name].shape == (len(ids), 256)


def test_source_against_itself_is_exactly_zero(tiny_checkpoint, tiny_token_ids):
    from hybrid_build.validate.streamed import compare_streamed

    ids = {k: v[:40] for k, v in tiny_token_ids.items()}
    r = compare_streamed(tiny_checkpoint, tiny_checkpoint, ids, device="cpu", position_block=32, resamples=50)
    o = r.report["overall"]
    assert o["mean_kl"] == 0.0 and o["max_kl"] == 0.0 and o["same_top1"] == 1.0 and o["ppl_ratio"] == 1.0
    assert o["rms_delta_p"] == 0.0 and o["tokens"] == 3 * 39


def test_zero_token_text_is_a_clear_error(tiny_checkpoint, built_artifact):
    from hybrid_build.validate.streamed import compare_streamed, streamed_hidden_states

    with pytest.raises(UserError, match=r"^text 'empty' has 0 token\(s\): the forward needs at least 2 per text$"):
        compare_streamed(tiny_checkpoint, built_artifact, {"prose": [5, 6, 7], "empty": []}, device="cpu")
    with pytest.raises(UserError, match="text 'empty' has 0 token"):
        streamed_hidden_states([tiny_checkpoint], {"empty": torch.tensor([], dtype=torch.long)}, device="cpu")
    with pytest.raises(UserError, match="outside the model's vocabulary of 1024"):
        streamed_hidden_states([tiny_checkpoint], {"t": [1, 1024]}, device="cpu")


# ----------------------------------------------------------------------------- statistics


def _logits(p: list[list[float]]) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log().float()


def test_identical_distributions_have_zero_kl_and_full_agreement():
    logits = torch.randn(37, 500)
    targets = torch.randint(500, (37,))
    s = position_stats(logits, logits.clone(), targets, vocab_chunk=7)
    assert len(s) == 37 and torch.equal(s.kl, torch.zeros(37, dtype=torch.float64))
    r = summarize(s, resamples=100)
    assert r.mean_kl == r.p999_kl == r.max_kl == 0.0
    assert r.same_top1 == 1.0 and r.rms_delta_p == 0.0 and r.ppl_ratio == 1.0
    assert r.mean_kl_ci95 == (0.0, 0.0) and r.same_top1_ci95 == (1.0, 1.0)


def test_known_small_case():
    ref = _logits([[0.5, 0.5], [0.9, 0.1]])
    test = _logits([[0.25, 0.75], [0.9, 0.1]])
    s = position_stats(ref, test, torch.tensor([1, 0]))
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert s.kl[0].item() == pytest.approx(kl0, rel=1e-6) and s.kl[1].item() == pytest.approx(0.0, abs=1e-7)
    # top-1: position 0 ties 0.5/0.5 (argmax takes token 0) vs token 1 under test
    assert s.same_top1.tolist() == [False, True]
    assert s.nll_ref.tolist() == pytest.approx([math.log(2), -math.log(0.9)], rel=1e-6)
    assert s.nll_test.tolist() == pytest.approx([-math.log(0.75), -math.log(0.9)], rel=1e-6)
    assert s.delta_p.tolist() == pytest.approx([0.25, 0.0], abs=1e-6)  # observed token
    assert s.delta_p_top.tolist() == pytest.approx([-0.25, 0.0], abs=1e-6)  # reference's top token
    r = summarize(s, resamples=200)
    assert r.mean_kl == pytest.approx(kl0 / 2, rel=1e-6) and r.median_kl == pytest.approx(kl0 / 2, rel=1e-6)
    assert r.same_top1 == 0.5 and r.rms_delta_p == pytest.approx(0.25 / math.sqrt(2), rel=1e-5)
    ppl_ref = math.exp((math.log(2) - math.log(0.9)) / 2)
    ppl_test = math.exp((-math.log(0.75) - math.log(0.9)) / 2)
    assert r.ppl_ref == pytest.approx(ppl_ref, rel=1e-6) and r.ppl_ratio == pytest.approx(ppl_test / ppl_ref, rel=1e-6)


def test_streamed_vocabulary_chunks_equal_the_direct_formulas():
    """The online accumulation (any chunking of the vocabulary) against log-softmax over whole rows."""
    torch.manual_seed(1)
    ref = torch.randn(300, 500) * 3
    test = ref + 0.3 * torch.randn(300, 500) + 5.0  # a constant offset changes no probability
    targets = torch.randint(500, (300,))
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    kl = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)
    top = lp.argmax(-1)
    t = targets[:, None]
    for chunk in (1, 7, 128, 500):
        s = position_stats(ref, test, targets, vocab_chunk=chunk)
        assert torch.allclose(s.kl, kl, rtol=1e-9, atol=1e-13), chunk
        assert torch.equal(s.same_top1, top == lq.argmax(-1))
        assert torch.allclose(s.nll_ref, -lp.gather(-1, t)[:, 0], rtol=1e-12)
        assert torch.allclose(s.nll_test, -lq.gather(-1, t)[:, 0], rtol=1e-12)
        assert torch.allclose(s.delta_p, lq.gather(-1, t).exp()[:, 0] - lp.gather(-1, t).exp()[:, 0], atol=1e-14)
        assert torch.allclose(s.delta_p_top, lq.gather(-1, top[:, None]).exp()[:, 0] - lp.max(-1).values.exp(),
                              atol=1e-14)
    assert 0.5 < float(s.same_top1.double().mean()) < 1.0  # the check above saw both outcomes


def test_ties_keep_the_first_maximum_across_chunks():
    ref = torch.tensor([[1.0, 3.0, 0.0, 3.0]])
    test = torch.tensor([[1.0, 2.0, 0.0, 3.0]])
    for chunk in (1, 2, 3, 4):
        s = position_stats(ref, test, torch.tensor([0]), vocab_chunk=chunk)
        assert s.same_top1.tolist() == [False], chunk  # reference argmax is 1 (first of the tie), test's is 3


def test_percentiles_of_the_summary():
    torch.manual_seed(1)
    ref, test = torch.randn(300, 64), torch.randn(300, 64)
    s = position_stats(ref, test, torch.zeros(300, dtype=torch.long))
    r = summarize(s, resamples=100)
    sorted_kl = s.kl.sort().values
    assert sorted_kl[296] <= r.p99_kl <= sorted_kl[297]  # 0.99 * 299 = 296.01
    assert r.p99_kl <= r.p999_kl <= r.max_kl == sorted_kl[-1]
    assert r.median_kl == pytest.approx(float((sorted_kl[149] + sorted_kl[150]) / 2))


def test_bootstrap_interval_contains_the_mean_and_is_seeded():
    x = torch.distributions.Exponential(1000.0).sample((2000,)).double()
    lo, hi = bootstrap_mean_ci(x, resamples=1000, seed=3)
    assert lo < float(x.mean()) < hi
    # the standard error of a mean of 2000 Exp draws is mean / sqrt(2000): the 95% interval spans ~4 of them
    width = (hi - lo) / (float(x.mean()) / math.sqrt(2000))
    assert 3.0 < width < 5.0, width
    assert bootstrap_mean_ci(x, resamples=1000, seed=3) == (lo, hi)
    assert bootstrap_mean_ci(x, resamples=1000, seed=4) != (lo, hi)


def test_report_has_overall_and_each_text():
    torch.manual_seed(2)
    per = {}
    for name, n in (("prose", 50), ("code", 30)):
        ref = torch.randn(n, 40)
        per[name] = position_stats(ref, ref + 0.1 * torch.randn(n, 40), torch.randint(40, (n,)))
    rep = divergence_report(per, resamples=100)
    assert set(rep["texts"]) == {"prose", "code"} and rep["overall"]["tokens"] == 80
    both = PositionStats.cat([per["prose"], per["code"]])
    assert rep["overall"]["mean_kl"] == pytest.approx(float(both.kl.mean()))
    for entry in [rep["overall"], *rep["texts"].values()]:
        lo, hi = entry["mean_kl_ci95"]
        assert lo <= entry["mean_kl"] <= hi
        json.dumps(entry)
