"""The model card: metadata that parses, figures taken from the validation report, license and
base model carried from the source, and the warning a forced publish carries."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import time

import pytest
import yaml

from hybrid_build.core.artifact import provenance_sha256, seal_reports
from hybrid_build.core.errors import ArtifactError
from hybrid_build.pipeline.publish import plan_publish

REPO = "my-org/tiny-hybrid"


def split_card(text: str) -> tuple[dict, str]:
    m = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert m, "the card has no YAML front matter"
    return yaml.safe_load(m.group(1)), m.group(2)


def table_rows(body: str, header_first_cell: str) -> list[list[str]]:
    """Rows of the markdown table whose header starts with ``| header_first_cell |``."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header_first_cell} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append(cells)
    return rows


def edit_provenance(artifact, change) -> None:
    """Rewrite provenance.json, then bring the validation report after it again (as a re-validation would)."""
    path = artifact / "hybrid_build" / "provenance.json"
    prov = json.loads(path.read_text())
    change(prov)
    path.write_text(json.dumps(prov, indent=2))
    report = artifact / "hybrid_build" / "validation.json"  # a re-validation records the new build
    if report.exists():
        report.write_text(json.dumps({**json.loads(report.read_text()),
                                      "provenance_sha256": provenance_sha256(artifact)}))
    later = time.time() + 2
    for name in ("validation.json", "validation.md", "validation.png"):
        p = artifact / "hybrid_build" / name
        if p.exists():
            os.utime(p, (later, later))
    try:
        seal_reports(artifact)  # as the re-validation would
    except ArtifactError:  # a provenance that no longer parses: nothing to seal into
        pass


def test_metadata_parses_and_says_what_the_artifact_is(artifact):
    plan = plan_publish(artifact, REPO)
    meta, body = split_card(plan.card_text)
    prov = json.loads((artifact / "hybrid_build" / "provenance.json").read_text())
    kinds = {c["kind"] for c in prov["converted"]}
    assert kinds == {"fp8", "int8"}
    assert {"int4", "fp8", "int8", "auto-round", "hybrid"} <= set(meta["tags"])
    # no library loads it as it is (transformers reads neither its FP8 experts nor its int8 head; vLLM
    # needs the plugin and is a Hub local app, not a library): no loading snippet that would fail
    assert "library_name" not in meta
    # the tiny source is a local folder: no Hub id to name as base model, and no license anywhere
    assert "base_model" not in meta
    assert meta["license"] == "other"
    assert "license of the source could not be determined" in body
    # the card replaces README.md and is the last file sent
    assert plan.files[-1].path == "README.md" and plan.files[-1].data == plan.card_text.encode()


def test_validation_table_holds_the_report_figures(artifact):
    report = json.loads((artifact / "hybrid_build" / "validation.json").read_text())
    _, body = split_card(plan_publish(artifact, REPO).card_text)
    rows = {r[0]: r for r in table_rows(body, "figure")}
    fp8 = [w for w in report["weights"] if w["kind"] == "fp8"]
    expected = {
        "FP8 shared experts: worst weight relative error": max(w["rel_error"] for w in fp8),
        "FP8 shared experts: lowest cosine": min(w["cosine"] for w in fp8),
        "int8 lm-head: weight relative error": next(w["rel_error"] for w in report["weights"] if w["kind"] == "int8"),
        "shared-expert MLP output: worst relative error": max(a["rel_error"] for a in report["activations"]),
        "lm-head logits: top-1 agreement": report["lm_head"]["top1_agreement"],
        "lm-head logits: KL": report["lm_head"]["kl"],
        "end to end: KL divergence from the source": report["end_to_end"]["kl"],
        "end to end: top-1 agreement": report["end_to_end"]["top1_agreement"],
        "end to end: perplexity change": report["end_to_end"]["ppl_change"],
    }
    for name, value in expected.items():
        shown = float(rows[name][1])
        # printed with 4 significant digits: the rounding error is at most half a unit in the 4th digit
        assert math.isclose(shown, value, rel_tol=5e-4), (name, shown, value)
    kl_limit = report['thresholds']['e2e_max_kl']
    assert rows["end to end: KL divergence from the source"][2] == f"e2e_max_kl {kl_limit:.4g}"
    checks = {r[0]: r[1] for r in table_rows(body, "check")}
    assert checks == {c["name"]: ("pass" if c["passed"] else "**FAIL**") for c in report["checks"]}
    assert "![relative error per layer](hybrid_build/validation.png)" in body


def test_sizes_and_conversion_bytes_match_the_files(artifact):
    plan = plan_publish(artifact, REPO)
    _, body = split_card(plan.card_text)
    prov = json.loads((artifact / "hybrid_build" / "provenance.json").read_text())
    sizes = {r[0]: int(r[1].replace(",", "")) for r in table_rows(body, "what")}
    assert sizes["source weights (safetensors)"] == sum(f["bytes"] for n, f in prov["source"]["files"].items()
                                                        if n.endswith(".safetensors"))
    assert sizes["hybrid weights (safetensors)"] == sum(p.stat().st_size for p in artifact.glob("*.safetensors"))
    conv = {r[0]: r for r in table_rows(body, "kind")}
    n_fp8 = sum(1 for c in prov["converted"] if c["kind"] == "fp8")
    params = sum(c["shape"][0] * c["shape"][1] for c in prov["converted"] if c["kind"] == "fp8")
    assert int(conv["fp8"][1]) == n_fp8 and int(conv["fp8"][2].replace(",", "")) == params
    # FP8 is one byte per weight plus one float32 scale per 128x128 block: ratio to BF16 just above 1/2
    stored = int(conv["fp8"][4].replace(",", ""))
    blocks = sum(math.ceil(c["shape"][0] / 128) * math.ceil(c["shape"][1] / 128)
                 for c in prov["converted"] if c["kind"] == "fp8")
    assert stored == params + 4 * blocks


def test_hub_source_becomes_base_model_and_its_card_license_is_carried(artifact):
    source_card = "---\nlicense: apache-2.0\npipeline_tag: image-text-to-text\n---\n# the source\n"
    (artifact / "README.md").write_text(source_card)

    def change(prov):
        prov["source"].update(kind="hub", id="Intel/Qwen3.5-122B-A10B-int4-AutoRound", revision="0123abcd")
        prov["files"]["README.md"] = {"bytes": len(source_card.encode()),
                                      "sha256": hashlib.sha256(source_card.encode()).hexdigest()}

    edit_provenance(artifact, change)
    plan = plan_publish(artifact, REPO)
    meta, body = split_card(plan.card_text)
    assert meta["base_model"] == "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
    assert meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0"
    assert "`apache-2.0`, carried over from the source model card" in body
    # linked at the revision it was built from
    assert "[Intel/Qwen3.5-122B-A10B-int4-AutoRound](https://huggingface.co/Intel/Qwen3.5-122B-A10B-int4-AutoRound" \
           "/tree/0123abcd) (revision `0123abcd`)" in body
    # the source's README is not sent: the generated card takes its place
    assert [f.path for f in plan.files].count("README.md") == 1
    assert any("replaced by the generated card" in n for n in plan.notes)


def test_serving_section_uses_the_recipe_profile(artifact):
    _, body = split_card(plan_publish(artifact, REPO).card_text)
    assert "`hybrid-build serve . --profile dense --drafter` with a DFlash drafter for the source model" in body
    prov = json.loads((artifact / "hybrid_build" / "provenance.json").read_text())
    dense = prov["recipe"]["serve"]["profiles"]["dense"]
    vllm_line = next(line for line in body.splitlines() if line.startswith("vllm serve"))
    assert f"--max-model-len {dense['max_model_len']}" in vllm_line
    assert f"--max-num-seqs {dense['max_num_seqs']}" in vllm_line


@pytest.mark.parametrize("state", ["failed", "missing"])
def test_forced_card_says_validation_did_not_pass(artifact, state):
    vpath = artifact / "hybrid_build" / "validation.json"
    if state == "missing":
        for name in ("validation.json", "validation.md", "validation.png"):
            (artifact / "hybrid_build" / name).unlink()
        seal_reports(artifact)
    else:
        report = json.loads(vpath.read_text())
        report["passed"] = False
        report["failures"] = ["model.language_model.layers.1.mlp.shared_expert.up_proj: rel_error 0.3 > 0.045"]
        vpath.write_text(json.dumps(report))
    seal_reports(artifact)  # as the run that wrote it would
    plan = plan_publish(artifact, REPO, force=True)
    assert plan.forced and plan.validation.state == state
    _, body = split_card(plan.card_text)
    first = body.split("\n## ")[0]
    assert "**Warning:** published with `--force`" in first
    if state == "failed":
        assert "rel_error 0.3 > 0.045" in body and "Validation **FAILED**" in body
    else:
        assert "published without being validated" in body
        assert not any(f.path.startswith("hybrid_build/validation.") for f in plan.files)


def test_local_source_is_named_by_folder_and_content_never_by_path(artifact, tiny_checkpoint):
    plan = plan_publish(artifact, REPO)
    _, body = split_card(plan.card_text)
    prov = json.loads((artifact / "hybrid_build" / "provenance.json").read_text())
    src = prov["source"]
    assert src["kind"] == "local" and src["id"] == tiny_checkpoint.name
    fingerprint = src["fingerprint"]
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    assert f"A hybrid of a local checkpoint (`{tiny_checkpoint.name}`, content sha256 `{fingerprint[:16]}`)" in body
    assert f"- source: a local checkpoint, folder `{tiny_checkpoint.name}`, content sha256 `{fingerprint}`" in body
    # the build machine's folders stay on the build machine
    assert str(tiny_checkpoint.parent) not in plan.card_text and str(artifact) not in plan.card_text
    assert "`src`" not in body and "`?`" not in body


def test_card_does_not_tell_readers_to_pip_install_hybrid_build(artifact):
    _, body = split_card(plan_publish(artifact, REPO).card_text)
    assert "pip install hybrid-build" not in body
    assert "not on PyPI" in body


def _publish_drafter(artifact, drafter: str, revision: str | None = None) -> None:
    """The recipe copy's dense drafter set to ``drafter`` (at ``revision``), in the recipe file and the
    provenance alike (as a build with that recipe would have recorded it)."""
    recipe_path = artifact / "hybrid_build" / "recipe.yaml"
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["serve"]["profiles"]["dense"]["speculative"].update(model=drafter, revision=revision)
    text = yaml.safe_dump(recipe, sort_keys=False)
    recipe_path.write_text(text)

    def change(prov):
        prov["recipe"]["serve"]["profiles"]["dense"]["speculative"].update(model=drafter, revision=revision)
        prov["files"]["hybrid_build/recipe.yaml"] = {"bytes": len(text.encode()),
                                                     "sha256": hashlib.sha256(text.encode()).hexdigest()}

    edit_provenance(artifact, change)


def test_the_cards_commands_run_as_printed_in_a_copy_of_the_repository(artifact, tiny_checkpoint, capsys,
                                                                       monkeypatch):
    """The card's `hybrid-build serve` line, pasted in the artifact's folder (a copy of the repository;
    with --dry-run: no GPU here), plans the launch of that folder with its drafter; `vllm serve .` names
    the same folder and settings. The tiny recipe's own drafter was a folder on the build machine: the
    card says so in words and prints no command with a name to fill in."""
    from hybrid_build.pipeline.cli import main

    _, body = split_card(plan_publish(artifact, REPO).card_text)
    assert not [ln for ln in body.splitlines() if ln.startswith("hybrid-build serve")]
    _publish_drafter(artifact, "z-lab/some-drafter", revision="abc1234")
    _, body = split_card(plan_publish(artifact, REPO).card_text)
    line = next(ln for ln in body.splitlines() if ln.startswith("hybrid-build serve"))
    assert line == "hybrid-build serve . --profile dense"
    monkeypatch.chdir(artifact)
    # a copy of the repository that no trusted key signed is served after a passing local validate
    assert main(["validate", ".", "--source", str(tiny_checkpoint), "--no-e2e", "-q"]) == 0
    capsys.readouterr()
    assert main(shlex.split(line)[1:] + ["--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["argv"][:3] == ["vllm", "serve", str(artifact.resolve())]
    assert '"model":"z-lab/some-drafter"' in " ".join(plan["argv"])
    vllm_line = next(ln for ln in body.splitlines() if ln.startswith("vllm serve"))
    served = plan["argv"][plan["argv"].index("--served-model-name") + 1]
    assert shlex.split(vllm_line)[:5] == ["vllm", "serve", ".", "--served-model-name", served]
    assert '"model":"z-lab/some-drafter"' in vllm_line
    # the drafter commit the recipe pins, in serve's command and the card's plain one alike
    assert '"revision":"abc1234"' in " ".join(plan["argv"]) and '"revision":"abc1234"' in vllm_line


def test_a_local_drafter_is_not_put_into_the_plain_vllm_command(artifact):
    # the tiny recipe's drafter is `{source}-dflash`, a folder on the build machine
    _, body = split_card(plan_publish(artifact, REPO).card_text)
    vllm_line = next(line for line in body.splitlines() if line.startswith("vllm serve"))
    assert "--speculative-config" not in vllm_line and "{source}" not in vllm_line
    assert "a DFlash drafter that was a folder on the build machine and is not in this repository" in body
    # and what plain vLLM lacks for a drafter: no warm-prefix claim
    assert "no warm-prefix time to first token is claimed for plain vLLM" in body


@pytest.mark.parametrize("old_id", [".hybrid-build/demo-source", "/home/someone/models/tiny-int4"])
def test_provenance_without_kind_or_content_hashes(artifact, old_id):
    """Provenance written before content fingerprints: no kind, sizes only, and an id that may be a
    path; the card names the folder, not the path, and claims no content hash."""
    def change(prov):
        src = prov["source"]
        prov["source"] = {"id": old_id, "revision": None, "fingerprint": "ab" * 32,
                          "files": {f: {"bytes": i["bytes"]} for f, i in src["files"].items()}}

    edit_provenance(artifact, change)
    meta, body = split_card(plan_publish(artifact, REPO).card_text)
    name = old_id.rsplit("/", 1)[-1]
    assert "base_model" not in meta
    assert f"A hybrid of a local checkpoint (`{name}`), built" in body
    assert f"folder `{name}`, fingerprint `{'ab' * 32}` (of its headers and sizes)" in body
    assert old_id not in body and "content sha256" not in body


# ------------------------------------------------------------------------------------ eval and bench


def write_eval_report(artifact, pairs=None):
    """An eval report as `hybrid-build eval` writes it, for this build (no lm-eval run: its figures are
    made up, the statistics are the real ones)."""
    from hybrid_build.validate.eval.task_eval import (
        BUNDLED_DATASET,
        HF_NOTE,
        AccuracyReport,
        EvalSettings,
        artifact_identity,
        compare_pairs,
        default_report_path,
        write_report,
    )

    pairs = pairs or [(1, 1)] * 50 + [(1, 0)] * 6 + [(0, 1)] * 2 + [(0, 0)] * 42
    row = compare_pairs("hb_arith", "acc,none", pairs)
    row.dataset, row.num_fewshot = BUNDLED_DATASET, 0
    report = AccuracyReport(EvalSettings(limit=100).to_json(), {"source": {"name": "src"}, "hybrid": {"name": "hyb"}},
                            [row], row, {}, {"hybrid_build": "0.1.0", "lm_eval": "0.4.13"},
                            artifact_identity(artifact), [HF_NOTE])
    write_report(report, default_report_path(artifact))
    return row


def model_index(meta) -> dict[str, dict[str, dict]]:
    """dataset name -> metric type -> metric entry, from the card's model-index."""
    out: dict = {}
    for res in meta["model-index"][0]["results"]:
        for m in res["metrics"]:
            out.setdefault(res["dataset"]["name"], {})[m["type"]] = {**m, "dataset_type": res["dataset"]["type"]}
    return out


def test_eval_report_goes_into_the_metadata_and_the_text(artifact):
    from huggingface_hub import ModelCard

    row = write_eval_report(artifact)
    plan = plan_publish(artifact, REPO)
    meta, body = split_card(plan.card_text)
    idx = model_index(meta)
    acc, rec = idx["hb_arith"]["acc"], idx["hb_arith"]["recovery"]
    assert acc["value"] == 0.52 and acc["dataset_type"] == "hybrid-build/bundled-eval-tasks"
    assert rec["value"] == pytest.approx(100 * 52 / 56, abs=0.01)
    assert acc["config"] == "hybrid-build 0.1.0 eval, lm-eval 0.4.13, backend hf, limit 100"
    assert acc["args"]["source"] == 0.56 and acc["args"]["verdict"] == row.verdict == "within noise"
    assert acc["args"]["p_value"] == pytest.approx(row.p_value) and acc["args"]["num_fewshot"] == 0
    # huggingface_hub reads its own model-index back
    parsed = ModelCard(plan.card_text).data.eval_results
    assert {(r.dataset_name, r.metric_type) for r in parsed} >= {("hb_arith", "acc"), ("hb_arith", "recovery")}
    # the text: the table with the settings it was made with
    rows = {r[0]: r for r in table_rows(body, "task")}
    assert rows["hb_arith"][1:6] == ["100", "56.0", "52.0", "-4.0 [-9.5, +1.5]", "92.9%"]
    assert rows["hb_arith"][6:] == ["6 / 2", "0.289", "within noise"]
    assert "## Task accuracy" in body and "lm-eval 0.4.13, backend `hf`, tasks hybrid_build, limit 100 per task" in body
    # the report is published with the artifact
    assert {"hybrid_build/eval.json", "hybrid_build/eval.md"} <= {f.path for f in plan.files}


def test_an_eval_report_of_an_earlier_build_is_named_not_shown(artifact):
    write_eval_report(artifact)

    def change(prov):
        prov["created"] = "2026-01-01T00:00:00Z"

    edit_provenance(artifact, change)
    meta, body = split_card(plan_publish(artifact, REPO).card_text)
    assert "hb_arith" not in model_index(meta)
    assert "its figures are not shown: it was made for an earlier build of this folder (provenance differs)" in body
    assert "| hb_arith |" not in body


def test_validation_and_bench_figures_in_the_metadata(artifact):
    report = json.loads((artifact / "hybrid_build" / "validation.json").read_text())
    bench = {"kind": "hybrid-build bench", "schema_version": 2, "model": "qwen", "runs": 5, "max_tokens": 256,
             "temperature": 0, "speculative": True,
             "results": [{"workload": "prose", "decode_tok_s": 101.54, "e2e_tok_s": 95.0, "ttft_s": 0.051,
                          "acceptance": {"mean_acceptance_length": 3.21}},
                         {"workload": "code", "decode_tok_s": 150.0, "e2e_tok_s": 140.0, "ttft_s": 0.04,
                          "acceptance": None}]}
    (artifact / "hybrid_build" / "bench.json").write_text(json.dumps(bench))
    seal_reports(artifact)  # as `bench --out` does
    plan = plan_publish(artifact, REPO)
    meta, body = split_card(plan.card_text)
    idx = model_index(meta)
    e2e = report["end_to_end"]
    texts = idx["teacher-forced texts (hybrid-build validate)"]
    assert texts["kl_divergence"]["value"] == pytest.approx(e2e["kl"], rel=1e-5)
    assert texts["top1_agreement"]["value"] == pytest.approx(e2e["top1_agreement"], rel=1e-5)
    assert texts["kl_divergence"]["config"].startswith("hybrid-build 0.1.0 validate, engine ")
    assert idx["prose (hybrid-build bench)"]["decode_tokens_per_second"]["value"] == 101.54
    assert idx["code (hybrid-build bench)"]["decode_tokens_per_second"]["args"]["runs"] == 5
    rows = {r[0]: r for r in table_rows(body, "workload")}
    assert rows["prose"] == ["prose", "101.5", "95.0", "0.051", "3.21"] and rows["code"][4] == "-"
    assert "hybrid_build/bench.json" in {f.path for f in plan.files}
    assert "## Task accuracy" not in body  # no eval report, no section


def test_the_card_links_the_source_address_the_package_declares(monkeypatch):
    """A Project-URL in the package metadata is the card's install link; without one the card says
    that no address is declared rather than pointing nowhere."""
    import importlib.metadata as md

    from hybrid_build.pipeline import modelcard

    real = md.metadata

    class Meta:
        def __init__(self, urls):
            self.urls = urls

        def get_all(self, key):
            return self.urls if key == "Project-URL" else None

    monkeypatch.setattr(md, "metadata", lambda name: Meta(["Source, https://example.org/hybrid-build"]))
    assert "https://example.org/hybrid-build" in modelcard._install_hint()
    monkeypatch.setattr(md, "metadata", lambda name: Meta([]))
    assert "declares no address" in modelcard._install_hint()
    monkeypatch.setattr(md, "metadata", real)


# ------------------------------------------------------------------------------------ a card that is true


def test_every_number_on_the_card_is_recomputed_from_the_files(artifact):
    """Each figure of the conversion and size tables, recomputed here from the provenance, the
    safetensors headers and the files themselves: the size row's percentage is the table's own rows."""
    from safetensors import safe_open

    plan = plan_publish(artifact, REPO)
    _, body = split_card(plan.card_text)
    prov = json.loads((artifact / "hybrid_build" / "provenance.json").read_text())
    index = json.loads((artifact / "model.safetensors.index.json").read_text())["weight_map"]
    for row in table_rows(body, "kind"):
        kind, modules, params, bf16, stored, ratio = row
        convs = [c for c in prov["converted"] if c["kind"] == kind]
        want_params = sum(c["shape"][0] * c["shape"][1] for c in convs)
        want_stored = 0
        for c in convs:
            for name in c["tensors"]:
                with safe_open(artifact / index[name], "pt") as f:
                    t = f.get_slice(name)
                    want_stored += math.prod(t.get_shape()) * {"F8_E4M3": 1, "F32": 4, "I32": 4, "F16": 2, "BF16": 2,
                                                               "I8": 1, "U8": 1}[t.get_dtype()]
        assert int(modules) == len(convs) and int(params.replace(",", "")) == want_params
        assert int(bf16.replace(",", "")) == 2 * want_params and int(stored.replace(",", "")) == want_stored
        assert ratio == f"{want_stored / (2 * want_params):.3f}"
    worst = {k: max(c["metrics"]["rel_error"] for c in prov["converted"] if c["kind"] == k) for k in ("fp8", "int8")}
    assert f"Worst relative weight error at conversion: fp8 {worst['fp8']:.4g}, int8 {worst['int8']:.4g}." in body
    t = prov["tensors"]
    assert f"Tensors: {t['total']} in all, {t['copied']} copied unchanged from the source." in body

    sizes = {r[0]: int(r[1].replace(",", "")) for r in table_rows(body, "what")}
    source = sum(f["bytes"] for n, f in prov["source"]["files"].items() if n.endswith(".safetensors"))
    hybrid = sum(p.stat().st_size for p in artifact.glob("*.safetensors"))
    published = sum((artifact / f.path).stat().st_size for f in plan.files if f.path != "README.md")
    assert sizes == {"source weights (safetensors)": source, "hybrid weights (safetensors)": hybrid,
                     "all published files (this card aside)": published}
    assert f"Weights change by {(hybrid - source) / source:+.2%} on disk." in body
    reference = sum((artifact / "hybrid_build" / n).stat().st_size for n in ("reference.json", "reference.safetensors"))
    assert f"`hybrid_build/reference.safetensors` and `hybrid_build/reference.json` ({reference / 1e6:.2g} MB)" in body


# what a template left unfilled looks like: a {field}, a name to replace, a made-up repository, a value
# that was missing when the card was rendered
UNRESOLVED = re.compile(r"\{[A-Za-z_][\w.-]*\}|YOUR_|\blocal/|\bORG/NAME\b|<[A-Z][A-Z_]*>|\bTODO\b|FIXME|`\?`|`None`|"
                        r"\bnan\b|%\(|\$\{")


def _card_variants(artifact):
    """The card of the artifact as it is, then with an eval and a bench report, a Hub source, a recipe
    that is not shipped, a Hub drafter, and forced without a validation report."""
    yield "as built", plan_publish(artifact, REPO).card_text
    write_eval_report(artifact)
    (artifact / "hybrid_build" / "bench.json").write_text(json.dumps(
        {"kind": "hybrid-build bench", "schema_version": 2, "runs": 3, "max_tokens": 64, "temperature": 0,
         "results": [{"workload": "prose", "decode_tok_s": 10.0, "e2e_tok_s": 9.0, "ttft_s": 0.1}]}))
    seal_reports(artifact)
    yield "with eval and bench", plan_publish(artifact, REPO).card_text

    def hub_source(prov):
        prov["source"].update(kind="hub", id="Intel/Qwen3.5-122B-A10B-int4-AutoRound", revision="0123abcd")
        prov["recipe"]["name"] = "my-own"

    edit_provenance(artifact, hub_source)
    yield "a Hub source, an own recipe", plan_publish(artifact, REPO).card_text
    _publish_drafter(artifact, "z-lab/some-drafter")
    yield "a Hub drafter", plan_publish(artifact, REPO).card_text
    for name in ("validation.json", "validation.md", "validation.png"):
        (artifact / "hybrid_build" / name).unlink()
    seal_reports(artifact)
    yield "forced, unvalidated", plan_publish(artifact, REPO, force=True).card_text


def test_no_unresolved_template_field_reaches_the_card(artifact):
    for what, text in _card_variants(artifact):
        found = sorted({m.group(0) for m in UNRESOLVED.finditer(text)})
        assert not found, (what, found)
        assert REPO not in text, what  # the card is the artifact's, wherever it is published


def test_every_link_works_on_the_hub(artifact):
    """A link is a web address, or a file of the repository (relative to its root, where README.md
    is): the picture is linked only when it is uploaded with the card."""
    for what, text in _card_variants(artifact):
        plan_files = None
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("https://"):
                continue
            if plan_files is None:
                plan_files = {f.path for f in plan_publish(artifact, REPO, force=True).files}
            assert target in plan_files, (what, target)
    assert "validation.png" not in text  # the last variant has no picture to upload, and links none


def test_the_folders_card_is_what_publish_uploads(artifact, hub, no_sleep, monkeypatch):
    """The card `run` leaves in the folder (``write_card``) is byte for byte the README.md that
    `publish` uploads through the Hub client; a report added later (eval) changes both alike, and
    publish keeps its card in the folder."""
    from hybrid_build.pipeline import publish as publish_lib
    from hybrid_build.pipeline.cli import main
    from hybrid_build.pipeline.commands import publish as publish_command

    policy, _ = no_sleep
    monkeypatch.setattr(publish_command, "make_api", lambda: hub)
    monkeypatch.setattr(publish_command, "make_retry", lambda: policy)
    folder_card = publish_lib.write_card(artifact).read_bytes()
    assert main(["publish", str(artifact), "--repo-id", REPO]) == 0
    assert hub.files(REPO)["README.md"] == folder_card
    write_eval_report(artifact)
    assert main(["publish", str(artifact), "--repo-id", "other-org/another-name"]) == 0
    uploaded = hub.files("other-org/another-name")["README.md"]
    assert uploaded != folder_card and b"## Task accuracy" in uploaded
    assert (artifact / "hybrid_build" / "card.md").read_bytes() == uploaded
    assert publish_lib.write_card(artifact).read_bytes() == uploaded  # the same, wherever it goes


def test_the_provenance_is_one_typed_model_written_as_it_reads(artifact):
    """The record stage writes the model's text: reading the file into ``Provenance`` and writing it
    again gives the same bytes; the build's time is on the card as the provenance records it."""
    from hybrid_build.core.artifact import read_provenance
    from hybrid_build.core.provenance import Provenance

    path = artifact / "hybrid_build" / "provenance.json"
    prov = read_provenance(artifact)
    assert isinstance(prov, Provenance) and prov.to_text() == path.read_text()
    assert time.strptime(prov.created, "%Y-%m-%dT%H:%M:%SZ")
    assert prov.files and all(f.sha256 for f in prov.files.values())
    body = split_card(plan_publish(artifact, REPO).card_text)[1]
    assert f"- built: {prov.created}\n" in body


def test_a_provenance_that_does_not_fit_the_model_is_one_line(artifact, capsys):
    from hybrid_build.core.errors import ArtifactError
    from hybrid_build.pipeline.cli import main

    def change(prov):
        prov["files"]["config.json"]["bytes"] = "many"

    edit_provenance(artifact, change)
    with pytest.raises(ArtifactError, match=r"provenance.json: files.config.json.bytes: .*rebuild the artifact$"):
        plan_publish(artifact, REPO)
    assert main(["status", str(artifact)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "files.config.json.bytes" in err[0]


def test_the_build_time_follows_source_date_epoch():
    from hybrid_build.core.provenance import build_time

    assert build_time({"SOURCE_DATE_EPOCH": "1700000000"}) == "2023-11-14T22:13:20Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", build_time({}))


def test_the_card_states_the_pool_and_streams_that_fit_as_serve_prints_them(artifact, tiny_checkpoint, capsys,
                                                                            monkeypatch):
    """The card's memory table (the dense profile on a GB10 and an H200, vLLM 0.26.0's planning) holds
    the figures `hybrid-build serve --dry-run` prints for the same profile and hardware: one memory
    model, from the artifact's headers. A drafter that is not published is left out and said to be."""
    from hybrid_build.pipeline.cli import main
    from hybrid_build.pipeline.modelcard import CARD_ENGINE
    from hybrid_build.serve.launch import memory

    _, body = split_card(plan_publish(artifact, REPO).card_text)
    assert "0 speculative tokens; without the drafter, which is not in this repository" in body
    drafter = "z-lab/Qwen3.5-122B-A10B-DFlash"
    _publish_drafter(artifact, drafter)
    # the provenance was edited: a build this machine never made, so serve takes it after a passing local validate
    assert main(["validate", str(artifact), "--source", str(tiny_checkpoint), "--no-e2e", "-q"]) == 0
    capsys.readouterr()
    _, body = split_card(plan_publish(artifact, REPO).card_text)
    rows = {r[0]: r[1:] for r in table_rows(body, "hardware")}
    assert set(rows) == {"NVIDIA DGX Spark (GB10, LPDDR5X)", "NVIDIA H200 (HBM3e)"}
    assert f"as vLLM {CARD_ENGINE} plans it" in body and "4 speculative tokens)" in body
    monkeypatch.setattr(memory, "installed_vllm", lambda: CARD_ENGINE)
    for hw, label in (("gb10", "NVIDIA DGX Spark (GB10, LPDDR5X)"), ("h200", "NVIDIA H200 (HBM3e)")):
        assert main(["serve", str(artifact), "--profile", "dense", "--hardware", hw, "--drafter", drafter,
                     "--dry-run", "--json"]) == 0
        m = json.loads(capsys.readouterr().out)["memory"]
        assert m["engine_basis"] == f"vLLM {CARD_ENGINE}'s planning"
        (fit,) = m["fit"]
        want = [f"{m['pool_tokens']:,}", f"{m['max_context_tokens']:,}",
                f"{fit['whole']:,}" + (f" (the next gets {fit['next_tokens']:,})" if fit["next_tokens"] else "")]
        assert rows[label] == want, (hw, rows[label], want)
    # a bigger device holds a bigger pool: the rows are not one figure printed twice
    assert int(rows["NVIDIA H200 (HBM3e)"][0].replace(",", "")) > int(
        rows["NVIDIA DGX Spark (GB10, LPDDR5X)"][0].replace(",", ""))
