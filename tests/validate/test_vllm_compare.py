"""``validate.vllm_compare`` without a GPU: the child protocol (run for real, as a child process,
against a stand-in ``vllm`` package that has the API surface the child uses), the statistics
assembled from the saved logits, and the errors a user sees.

The stand-in's "model" is a small deterministic torch network whose module tree has the names
vLLM's Qwen3.5 model has where the child looks (``language_model.model.norm``, returning a
``(hidden, residual)`` tuple, plus decoys) and a ``compute_logits`` that returns bf16 logits; its
prefill calls the final norm in several chunks, as chunked prefill does. The expected figures are
computed here from the same network, straight through ``divergence``."""
from __future__ import annotations

import importlib.util
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from hybrid_build.core.errors import ExternalToolError, UserError
from hybrid_build.validate import vllm_compare
from hybrid_build.validate.divergence import divergence_report, position_stats

VOCAB, HIDDEN = 37, 16

FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vllm: LLM(model=folder) runs folder/weights.pt; every engine appends what it
    was given (kwargs, environment) to $FAKE_VLLM_LOG."""
    import json, os
    from pathlib import Path

    import torch

    __version__ = "0.0.0-stand-in"
    CHUNK = 7  # the final norm sees a prefill in chunks of this many positions


    class Norm(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(w)

        def forward(self, x, residual=None):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
            return y, x  # vLLM's fused norm returns (out, residual)


    class Inner(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.embed = torch.nn.Parameter(w["embed"])
            self.mix = torch.nn.Parameter(w["mix"])
            self.norm = Norm(w["norm"])
            self.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.layers[0].input_layernorm = Norm(w["norm"])  # a decoy: not the final norm


    class LanguageModel(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.model = Inner(w)
            self.head = torch.nn.Parameter(w["head"])


    class Visual(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.norm = Norm(w["norm"])  # a decoy: the vision tower's


    class Model(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.language_model = LanguageModel(w)
            self.visual = Visual(w)

        def pre_norm(self, ids):
            m = self.language_model.model
            x = m.embed[ids]
            x = torch.cumsum(x, 0) / torch.arange(1, len(ids) + 1)[:, None]  # causal: a prefix mean
            return torch.tanh(x @ m.mix)

        def compute_logits(self, h):
            return (h @ self.language_model.head.T).to(torch.bfloat16)


    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw


    class _Out:
        def __init__(self):
            self.outputs = []


    class LLM:
        def __init__(self, model, **kw):
            folder = Path(model)
            spec = json.loads((folder / "fake.json").read_text())
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(json.dumps({"model": folder.name, "kw": kw, "env": {
                    k: os.environ.get(k) for k in ("VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING")}}) + "\\n")
            if spec.get("fail"):
                raise RuntimeError(spec["fail"])
            self.spec = spec
            self.model = Model(torch.load(folder / "weights.pt"))

        def generate(self, prompts, params, use_tqdm=True):
            outs = []
            with torch.no_grad():
                for p in prompts:
                    ids = torch.tensor(p["prompt_token_ids"])
                    x = self.model.pre_norm(ids)
                    for lo in range(0, len(ids), CHUNK):
                        self.model.language_model.model.norm(x[lo:lo + CHUNK])
                    if self.spec.get("extra_rows"):  # a padded forward: more positions than tokens
                        self.model.language_model.model.norm(x[:1])
                    outs.append(_Out())
            return outs

        def apply_model(self, fn):
            return [fn(self.model)]
''')


def _weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(VOCAB, HIDDEN, generator=g), "mix": torch.randn(HIDDEN, HIDDEN, generator=g) / 4,
            "norm": 1 + 0.1 * torch.randn(HIDDEN, generator=g), "head": torch.randn(VOCAB, HIDDEN, generator=g)}


def _folder(root: Path, name: str, weights: dict, **spec) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {"vocab_size": VOCAB}}))
    (d / "fake.json").write_text(json.dumps(spec))
    torch.save(weights, d / "weights.pt")
    return d


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The stand-in on the path of this process (find_spec) and of the children (PYTHONPATH); the
    GPU check passes. Returns the log of engines started."""
    pkg = tmp_path / "fakesite" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(**kw):\n    return dict(kw)\n")
    site = str(tmp_path / "fakesite")
    monkeypatch.syspath_prepend(site)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    log = tmp_path / "engines.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setattr(vllm_compare, "_require_gpu", lambda: None)
    return log


def _expected(src_w: dict, hyb_w: dict, texts: dict, site: Path) -> dict:
    """The figures straight from the stand-in's network (imported here), through ``divergence``."""
    spec = importlib.util.spec_from_file_location("fake_vllm_here", site / "vllm" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src, hyb = mod.Model(src_w), mod.Model(hyb_w)
    per_text = {}
    with torch.no_grad():
        for name, ids in texts.items():
            t = torch.tensor(ids)
            lr = src.compute_logits(src.language_model.model.norm(src.pre_norm(t))[0])
            lt = hyb.compute_logits(hyb.language_model.model.norm(hyb.pre_norm(t))[0])
            per_text[name] = position_stats(lr[:-1], lt[:-1], t[1:])
    return divergence_report(per_text)


TEXTS = {"prose": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], "code": [2, 7, 1, 8, 2, 8, 18, 28, 36]}


def test_source_then_hybrid_in_children_gives_the_divergence_of_their_logits(tmp_path, fake_vllm):
    src_w = _weights(0)
    hyb_w = {k: v + 0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(1)) for k, v in src_w.items()}
    src, hyb = _folder(tmp_path, "src", src_w), _folder(tmp_path, "hyb", hyb_w)
    ticks = []

    class Bar:
        def update(self, n=1):
            ticks.append(n)

        def close(self):
            ticks.append("closed")

    rep = vllm_compare.compare_in_vllm(src, hyb, TEXTS, kv_cache_memory_bytes=1 << 30,
                                       progress=lambda **kw: Bar())
    want = _expected(src_w, hyb_w, TEXTS, tmp_path / "fakesite")
    assert set(rep) == {"overall", "texts", "vllm"} and set(rep["texts"]) == set(TEXTS)
    for got, exp in [(rep["overall"], want["overall"])] + [(rep["texts"][n], want["texts"][n]) for n in TEXTS]:
        assert got["tokens"] == exp["tokens"]
        for k in ("mean_kl", "p99_kl", "max_kl", "same_top1", "ppl_ref", "ppl_test", "ppl_ratio", "rms_delta_p"):
            assert got[k] == pytest.approx(exp[k], rel=1e-9, abs=1e-15), k
    assert rep["overall"]["tokens"] == sum(len(v) - 1 for v in TEXTS.values())
    assert rep["overall"]["mean_kl"] > 1e-4  # the perturbation shows: the test can tell the models apart
    assert rep["vllm"]["source"]["vllm_version"] == "0.0.0-stand-in" and rep["vllm"]["hybrid"]["dtype"] == "bfloat16"
    engines = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert [e["model"] for e in engines] == ["src", "hyb"]  # source first, each in its own child
    for e in engines:
        assert e["env"] == {"VLLM_PLUGINS": "hybrid_build", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        kw = e["kw"]
        assert kw["enforce_eager"] is True and kw["enable_prefix_caching"] is False and kw["max_num_seqs"] == 1
        assert kw["max_model_len"] > max(len(v) for v in TEXTS.values())
        assert kw["kv_cache_memory_bytes"] == 1 << 30 and kw["gpu_memory_utilization"] == 0.5
    assert ticks[-1] == "closed" and sum(ticks[:-1]) == 2 * (2 + len(TEXTS)) + len(TEXTS)  # the bar's total


def test_the_same_model_twice_gives_no_divergence(tmp_path, fake_vllm):
    w = _weights(3)
    rep = vllm_compare.compare_in_vllm(_folder(tmp_path, "a", w), _folder(tmp_path, "b", w), TEXTS)
    o = rep["overall"]
    assert o["mean_kl"] == 0.0 and o["max_kl"] == 0.0 and o["same_top1"] == 1.0 and o["ppl_ratio"] == 1.0


def test_a_failing_engine_is_one_sentence_naming_the_model(tmp_path, fake_vllm):
    w = _weights(0)
    src = _folder(tmp_path, "src", w)
    hyb = _folder(tmp_path, "hyb", w, fail="CUDA out of memory. Tried to allocate 2.00 GiB\n(more lines)")
    with pytest.raises(ExternalToolError, match=r"vLLM could not run the hybrid \(hyb\): RuntimeError: CUDA out of "
                                                r"memory\. Tried to allocate 2\.00 GiB \(more lines\)") as e:
        vllm_compare.compare_in_vllm(src, hyb, TEXTS)
    assert "\n" not in str(e.value)


def test_positions_that_do_not_match_the_text_are_refused(tmp_path, fake_vllm):
    w = _weights(0)
    src, hyb = _folder(tmp_path, "src", w, extra_rows=True), _folder(tmp_path, "hyb", w)
    with pytest.raises(ExternalToolError, match=r"the source .*final norm saw 17 positions for a text of 16 tokens"):
        vllm_compare.compare_in_vllm(src, hyb, {"prose": TEXTS["prose"]})


def test_without_vllm_the_error_says_so(tmp_path, monkeypatch):
    w = _weights(0)
    src, hyb = _folder(tmp_path, "src", w), _folder(tmp_path, "hyb", w)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ExternalToolError, match="vLLM is not installed"):
        vllm_compare.compare_in_vllm(src, hyb, TEXTS)


def test_without_a_gpu_the_error_says_so(tmp_path, monkeypatch, fake_vllm):
    monkeypatch.undo()  # the fixture's GPU pass-through off; the stand-in stays importable
    monkeypatch.syspath_prepend(str(tmp_path / "fakesite"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w = _weights(0)
    with pytest.raises(ExternalToolError, match="needs a CUDA GPU, and torch sees none"):
        vllm_compare.compare_in_vllm(_folder(tmp_path, "src", w), _folder(tmp_path, "hyb", w), TEXTS)


@pytest.mark.parametrize("texts, message", [
    ({}, "no texts to run"),
    ({"short": [5]}, "has 1 token"),
    ({"big": [1, VOCAB]}, f"outside the model's vocabulary of {VOCAB}"),
])
def test_bad_token_ids_are_a_user_error_before_any_engine_starts(tmp_path, fake_vllm, texts, message):
    w = _weights(0)
    with pytest.raises(UserError, match=message):
        vllm_compare.compare_in_vllm(_folder(tmp_path, "src", w), _folder(tmp_path, "hyb", w), texts)
    assert not fake_vllm.exists()


def test_folding_saved_logits_in_blocks_equals_the_whole(tmp_path):
    g = torch.Generator().manual_seed(5)
    ids = {"a": torch.randint(0, 50, (11,), generator=g).tolist(),
           "b": torch.randint(0, 50, (4,), generator=g).tolist()}
    (tmp_path / "s").mkdir()
    (tmp_path / "h").mkdir()
    want = {}
    for name, t in ids.items():
        ref = (3 * torch.randn(len(t), 50, generator=g)).to(torch.bfloat16)
        test = (ref.float() + 0.3 * torch.randn(len(t), 50, generator=g)).to(torch.bfloat16)
        torch.save(ref, tmp_path / "s" / f"{name}.pt")
        torch.save(test, tmp_path / "h" / f"{name}.pt")
        want[name] = position_stats(ref[:-1], test[:-1], torch.tensor(t[1:]))
    files = {n: f"{n}.pt" for n in ids}
    got = vllm_compare.fold_saved_logits(tmp_path / "s", tmp_path / "h", ids, files, position_block=3, vocab_chunk=7)
    for name in ids:
        for f in ("kl", "nll_ref", "nll_test", "delta_p", "delta_p_top"):
            torch.testing.assert_close(getattr(got[name], f), getattr(want[name], f), rtol=1e-10, atol=1e-12)
        assert torch.equal(got[name].same_top1, want[name].same_top1)
    torch.save(torch.zeros(3, 50), tmp_path / "h" / "a.pt")  # a child that saved the wrong rows
    with pytest.raises(ExternalToolError, match=r"shape \(11, 50\) \(source\) and \(3, 50\) \(hybrid\)"):
        vllm_compare.fold_saved_logits(tmp_path / "s", tmp_path / "h", ids, files)
