"""``hybrid-build eval``: the bundled task set, the paired statistics, a real lm-eval run of the tiny
source and its hybrid (Hugging Face backend, CPU), lm-eval's server backends against a stand-in
OpenAI server, and the one-line errors for bad input."""
from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_build.pipeline.cli import main
from hybrid_build.validate.eval import eval_taskset, task_eval
from hybrid_build.validate.eval.task_eval import EvalSettings, ServerModel, compare_pairs, mcnemar_exact

ROW_KEYS = {"task", "metric", "n", "source", "hybrid", "difference", "ci95", "recovery_pct", "only_source",
            "only_hybrid", "p_value", "test", "verdict", "source_stderr", "hybrid_stderr", "dataset", "num_fewshot"}


# ------------------------------------------------------------------------------------ the task set


def test_the_shipped_jsonl_is_what_the_generator_writes():
    folder = eval_taskset.task_dir()
    for kind, count in eval_taskset.COUNTS.items():
        text = (folder / f"{kind}.jsonl").read_text(encoding="utf-8")
        assert text == eval_taskset.jsonl_text(kind), \
            f"{kind}.jsonl: run python -m hybrid_build.validate.eval.eval_taskset"
        items = [json.loads(line) for line in text.splitlines()]
        assert len(items) == count and len({i["id"] for i in items}) == count
        for item in items:
            assert len(set(item["choices"])) == 4 and item["choices"][item["label"]] == item["answer"]
    assert sum(eval_taskset.COUNTS.values()) == 320
    # the right answer is not always in the same place
    labels = [json.loads(line)["label"] for line in (folder / "arith.jsonl").read_text().splitlines()]
    assert set(labels) == {0, 1, 2, 3}
    # the arithmetic is right
    for line in (folder / "arith.jsonl").read_text().splitlines()[:6]:
        item = json.loads(line)
        assert item["answer"].isdigit()


def test_bundled_tasks_register_with_lm_eval_offline():
    manager = task_eval.task_manager(["hybrid_build"])
    assert set(eval_taskset.BUNDLED_TASKS) <= set(manager.all_tasks)
    kinds = task_eval.check_tasks(["hybrid_build", "hybrid_build_gen"], manager, "hf")
    assert kinds == {"hb_arith": "multiple_choice", "hb_code": "multiple_choice", "hb_toolcall": "multiple_choice",
                     "hb_arith_gen": "generate_until", "hb_code_gen": "generate_until",
                     "hb_toolcall_gen": "generate_until"}


def test_generative_scorers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hb_tasks", eval_taskset.task_dir() / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    call = '{"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}'
    doc = {"answer": call}
    reordered = ' {"arguments": {"label": "tea", "minutes": 5}, "name": "set_timer"} x'
    assert tasks.score_toolcall(doc, [reordered])["exact_match"] == 1
    wrong = ' {"name": "set_timer", "arguments": {"minutes": 6, "label": "tea"}}'
    assert tasks.score_toolcall(doc, [wrong])["exact_match"] == 0
    assert tasks.score_toolcall(doc, ["no json"])["exact_match"] == 0
    assert tasks.score_number({"answer": "42"}, [" 42 apples"])["exact_match"] == 1
    assert tasks.score_number({"answer": "42"}, [" 4 2"])["exact_match"] == 0
    assert tasks.score_code({"answer": "a + b"}, [" a+b\n    pass"])["exact_match"] == 1


# ------------------------------------------------------------------------------------ statistics


def test_mcnemar_exact_is_the_binomial_test():
    from scipy.stats import binomtest

    assert mcnemar_exact(0, 0) == 1.0
    for b, c in [(1, 0), (10, 0), (3, 7), (12, 30), (50, 52), (200, 150)]:
        assert mcnemar_exact(b, c) == pytest.approx(binomtest(b, b + c, 0.5).pvalue, rel=1e-9)
        assert mcnemar_exact(b, c) == mcnemar_exact(c, b)


def test_verdicts():
    same = compare_pairs("t", "acc", [(1, 1)] * 30 + [(0, 0)] * 20)
    assert same.verdict == "identical" and same.p_value == 1 and same.ci95 == (0.0, 0.0)
    assert same.recovery_pct == 100
    noise = compare_pairs("t", "acc", [(1, 1)] * 30 + [(1, 0)] * 3 + [(0, 1)] * 2 + [(0, 0)] * 15)
    assert noise.verdict == "within noise" and noise.only_source == 3 and noise.only_hybrid == 2
    assert noise.ci95[0] < noise.difference < noise.ci95[1] and noise.ci95[0] < 0 < noise.ci95[1]
    worse = compare_pairs("t", "acc", [(1, 1)] * 30 + [(1, 0)] * 15 + [(0, 0)] * 5)
    assert worse.verdict == "hybrid worse" and worse.p_value < 0.05 and worse.ci95[1] < 0
    assert worse.recovery_pct == pytest.approx(100 * 30 / 45) and worse.test == "McNemar exact"
    graded = compare_pairs("t", "f1", [(0.5, 0.25), (1, 1)])
    assert graded.test == "sign test"


def _fake(scores: dict[str, list], metric="exact_match", hashes=None) -> dict:
    """lm-eval results as ``evaluate`` returns them, for one task with two filters."""
    samples = []
    for filt, values in scores.items():
        for doc, v in enumerate(values):
            samples.append({"doc_id": doc, "filter": filt, "metrics": [metric], metric: v,
                            "doc_hash": (hashes or {}).get(doc, f"h{doc}")})
    return {"samples": {"t": samples}, "configs": {"t": {"task": "t", "metric_list": [{"metric": metric}]}}}


def test_pairs_come_from_the_first_filter_by_document():
    src = _fake({"strict-match": [1, 0, 1, 1], "flexible-extract": [1, 1, 1, 1]})
    hyb = _fake({"strict-match": [1, 1, 0, 1], "flexible-extract": [0, 0, 0, 0]})
    hyb["samples"]["t"].reverse()  # order does not matter, documents do
    ex = task_eval.paired_examples(src, hyb)["t"]
    assert ex["filter"] == "strict-match" and ex["pairs"] == [[0, 1, 1], [1, 0, 1], [2, 1, 0], [3, 1, 1]]
    from hybrid_build.core.errors import ArtifactError

    with pytest.raises(ArtifactError, match="example 2 differs between the two runs"):
        task_eval.paired_examples(src, _fake({"strict-match": [1, 1, 0, 1]}, hashes={2: "other"}))
    with pytest.raises(ArtifactError, match="no metric of this task has a per-example score"):
        corpus = _fake({"none": [["ref", "pred"]] * 2}, metric="bleu")
        task_eval.paired_examples(corpus, corpus)


# ------------------------------------------------------------------------------------ a real run


def _recompute(raw: dict, task: str) -> tuple[int, int, int, float, float]:
    """From lm-eval's logged samples alone: n, b (only source right), c (only hybrid right), accuracies."""
    def scores(role):
        return {s["doc_id"]: s["acc"] for s in raw[role]["samples"][task]}

    src, hyb = scores("source"), scores("hybrid")
    assert src.keys() == hyb.keys()
    b = sum(1 for d in src if src[d] == 1 and hyb[d] == 0)
    c = sum(1 for d in src if src[d] == 0 and hyb[d] == 1)
    return len(src), b, c, sum(src.values()) / len(src), sum(hyb.values()) / len(hyb)


def test_real_lm_eval_run_on_the_tiny_source_and_a_damaged_hybrid(tiny_checkpoint, artifact_copy, plant, tmp_path):
    """lm-eval (hf backend, CPU) on the tiny source and on a hybrid whose int8 head scales were
    shuffled, so that the two disagree: each example's score is recomputed from its logged
    log-likelihoods, then the table's accuracies and discordant counts from those scores, and the
    McNemar p-value from scipy's binomial test."""
    from scipy.stats import binomtest

    # logits 50x larger, each row with another row's scale: answers change (a x3 change was not enough on this
    # random model, whose choices are ranked mostly by their length in tokens)
    plant.patch(artifact_copy, "lm_head.scales", lambda t: t.roll(1, dims=-1) * 50)
    settings = EvalSettings(tasks=["hybrid_build"], limit=16, batch_size=16)
    # the copy has no work dir, so no record of where the source is: it is given
    report, raw = task_eval.evaluate_artifact(artifact_copy, str(tiny_checkpoint), settings)
    data = report.to_json()
    prov = json.loads((artifact_copy / "hybrid_build" / "provenance.json").read_text())
    assert raw["modules_replaced"] == len(prov["converted"])
    assert [r["task"] for r in data["tasks"]] == ["hb_arith", "hb_code", "hb_toolcall"]
    assert data["overall"]["task"] == "all (pooled)" and data["overall"]["n"] == 48
    assert data["settings"]["limit"] == 16 and data["versions"]["lm_eval"] == "0.4.13"
    assert data["artifact"]["provenance_sha256"] and "hf backend" in data["notes"][0]
    for role in ("source", "hybrid"):
        for task, samples in raw[role]["samples"].items():
            for s in samples:  # each example's score, from its logged log-likelihoods: the best choice is the target
                lls = [r[0] for r in s["filtered_resps"]]
                assert s["acc"] == float(lls.index(max(lls)) == s["target"]), (role, task, s["doc_id"])
    discordant = 0
    for row in data["tasks"]:
        assert set(row) == ROW_KEYS and row["metric"] == "acc,none" and row["n"] == 16
        assert row["dataset"] == task_eval.BUNDLED_DATASET
        n, b, c, src_acc, hyb_acc = _recompute(raw, row["task"])
        assert (row["n"], row["only_source"], row["only_hybrid"]) == (n, b, c)
        assert row["source"] == pytest.approx(src_acc) and row["hybrid"] == pytest.approx(hyb_acc)
        # lm-eval's own aggregate agrees with the per-example results
        assert raw["source"]["results"][row["task"]]["acc,none"] == pytest.approx(src_acc)
        assert row["p_value"] == pytest.approx(binomtest(b, b + c, 0.5).pvalue if b + c else 1.0)
        assert row["recovery_pct"] == (pytest.approx(100 * hyb_acc / src_acc) if src_acc else None)
        assert [p[0] for p in data["examples"][row["task"]]["pairs"]] == list(range(16))
        discordant += b + c
    assert discordant > 0, "the damaged head should change some answers"
    # the hybrid really is another model: its log-likelihoods differ
    lls = lambda role: [r[0] for s in raw[role]["samples"]["hb_arith"] for r in s["filtered_resps"]]  # noqa: E731
    assert lls("source") != lls("hybrid")
    # JSON and Markdown written; the Markdown table has one row per task and the pooled row
    paths = task_eval.write_report(report, tmp_path / "eval.json")
    md = paths[1].read_text()
    assert json.loads(paths[0].read_text())["tasks"] == data["tasks"]
    assert sum(1 for line in md.splitlines() if line.startswith("| hb_")) == 3 and "| **all (pooled)** | 48 |" in md


def test_eval_command_on_a_clean_artifact(built_artifact, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(built_artifact), "--tasks", "hb_arith", "--limit", "6", "--out", str(out),
                 "--samples", str(tmp_path / "samples.jsonl"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["tasks"]
    assert row["task"] == "hb_arith" and row["n"] == 6 and row["verdict"] in ("identical", "within noise")
    assert json.loads(out.read_text())["tasks"] == data["tasks"] and out.with_suffix(".md").is_file()
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {(s["model"], s["task"]) for s in samples} == {("source", "hb_arith"), ("hybrid", "hb_arith")}
    assert len(samples) == 12


# ------------------------------------------------------------------------------------ servers


def _lp(seed: int, prev: int, tok: int) -> float:
    return -(((prev * 1009 + tok * 9176 + seed) % 997) / 100.0) - 0.1


class StandIn(BaseHTTPRequestHandler):
    """An OpenAI-compatible server with made-up but deterministic log-probabilities: ``/models``,
    ``/completions`` (echo + logprobs, as lm-eval's local-completions asks) and ``/chat/completions``.
    The model named ``hybrid`` differs from ``source`` on one token pair in seven."""

    served = [{"id": "source", "root": "/models/source"}]

    def log_message(self, *a):
        pass

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.endswith("/models"):
            return self._send({"object": "list", "data": self.served})
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        hybrid = body.get("model") == "hybrid"
        if self.path.endswith("/chat/completions"):
            text = body["messages"][-1]["content"]
            answer = " 7" if (len(text) % 3 == 0) != (hybrid and len(text) % 5 == 0) else " 12"
            return self._send({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]})
        prompts = body["prompt"]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        choices = []
        for i, ids in enumerate(prompts):
            lps = [None] + [_lp(1, p, t) - (1.5 if hybrid and (p + t) % 7 == 0 else 0.0) for p, t in zip(ids, ids[1:])]
            lps.append(-1.0)  # the one generated token
            tops = [None] + [{str(t): lp} for t, lp in zip(ids[1:] + [0], lps[1:])]
            choices.append({"index": i, "text": "x", "logprobs": {"token_logprobs": lps, "top_logprobs": tops,
                                                                  "tokens": [str(t) for t in ids] + ["x"]}})
        return self._send({"choices": choices})


@pytest.fixture
def standin():
    class Handler(StandIn):
        served = [{"id": "source", "root": "/models/source"}, {"id": "hybrid", "root": "/models/hybrid"}]

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", Handler
    finally:
        server.shutdown()
        server.server_close()


def test_server_backends_against_a_stand_in(standin, tiny_checkpoint, tmp_path):
    url, _ = standin
    src = ServerModel(url, "source", str(tiny_checkpoint))
    hyb = ServerModel(url, "hybrid", str(tiny_checkpoint))
    seen = []

    class Bar:
        def __init__(self, **kw):
            seen.append(kw["desc"])

        def update(self, n=1):
            pass

        def close(self):
            pass

    report, raw = task_eval.evaluate_endpoints(src, hyb, EvalSettings(tasks=["hybrid_build"], backend="completions",
                                                                     limit=8, concurrency=2), progress=Bar)
    data = report.to_json()
    assert data["models"]["source"]["root"] == "/models/source" and data["models"]["hybrid"]["name"] == "hybrid"
    assert [r["task"] for r in data["tasks"]] == ["hb_arith", "hb_code", "hb_toolcall"]
    assert seen == ["source: loglikelihood", "hybrid: loglikelihood"]
    for row in data["tasks"]:
        n, b, c, _, _ = _recompute(raw, row["task"])
        assert (row["only_source"], row["only_hybrid"]) == (b, c) and n == 8
    assert sum(r["only_source"] + r["only_hybrid"] for r in data["tasks"]) > 0

    report, raw = task_eval.evaluate_endpoints(src, hyb, EvalSettings(tasks=["hb_arith_gen"], backend="chat",
                                                                     limit=10), progress=Bar)
    (row,) = report.to_json()["tasks"]
    assert row["metric"] == "exact_match,none" and row["n"] == 10
    answers = {s["doc_id"]: s["filtered_resps"][0] for s in raw["source"]["samples"]["hb_arith_gen"]}
    assert set(answers.values()) <= {" 7", " 12"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ bad input


def _error(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_one_line_errors(built_artifact, standin, capsys, tmp_path):
    url, handler = standin
    out = ["--out", str(tmp_path / "e.json")]
    code, line = _error(capsys, ["eval", str(built_artifact), "--tasks", "hb_arithmetic"])
    assert code == 2 and re.match(r"error: unknown lm-eval task 'hb_arithmetic' \(did you mean .*\bhb_arith\b.*\?\); "
                                  r"the bundled offline tasks are hybrid_build, hybrid_build_gen", line)
    port = _free_port()
    code, line = _error(capsys, ["eval", "--source-url", f"http://127.0.0.1:{port}/v1", "--hybrid-url", url, *out])
    assert code == 3 and line.startswith(f"error: no server answers at http://127.0.0.1:{port}/v1")  # could not run
    code, line = _error(capsys, ["eval", "--url", url, "--source-model", "base", "--hybrid-model", "hybrid", *out])
    assert code == 2
    assert line == f"error: {url} serves 'source', 'hybrid', not 'base' (--source-model): is it the source server?"
    code, line = _error(capsys, ["eval", "--url", url, "--source-model", "hybrid", "--hybrid-model", "hybrid", *out])
    assert code == 2 and "the same model" in line
    code, line = _error(capsys, ["eval", "--url", url, "--source-model", "source", "--hybrid-model", "hybrid",
                                 "--backend", "chat", *out])
    assert code == 2 and line.startswith("error: the chat backend runs generative tasks only")
    code, line = _error(capsys, ["eval", "--source-url", url, "--hybrid-url", url])
    assert code == 2 and line == "error: without ARTIFACT, say where the report goes: --out FILE"
    code, line = _error(capsys, ["eval", str(tmp_path / "nowhere")])
    assert code == 2 and "no such artifact folder" in line


def test_a_task_that_needs_the_network_offline():
    """HF_HUB_OFFLINE is set for every test: gsm8k's dataset is not cached, so it cannot load."""
    from hybrid_build.core.errors import UserError

    manager = task_eval.task_manager(["gsm8k"])
    with pytest.raises(UserError, match=r"^task gsm8k needs its dataset from the Hugging Face Hub and HF_HUB_OFFLINE "
                                        r"is set .*use the bundled offline tasks \(--tasks hybrid_build\)$"):
        task_eval.check_tasks(["gsm8k"], manager, "hf")


def test_eval_says_what_it_does_before_the_slow_parts_and_does_not_promise_a_resume(built_artifact, tiny_checkpoint,
                                                                                     tmp_path, monkeypatch, capsys):
    """Its first lines come before lm-eval is imported or its task index built (tens of seconds, with no
    progress bar off a terminal); stopped there, it says that it starts over, for it keeps nothing."""
    def stop(_tasks):  # where lm-eval's task index would be built: the first slow step
        raise KeyboardInterrupt

    monkeypatch.setattr(task_eval, "task_manager", stop)
    code = main(["eval", str(built_artifact), "--source", str(tiny_checkpoint), "--limit", "2",
                 "--out", str(tmp_path / "e.json")])
    assert code == 130
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"eval: hf backend, tasks hybrid_build, 2 example(s) per task; report {tmp_path / 'e.json'}"
    assert err[1] == "eval: loading lm-eval's task index"
    assert err[-1] == "interrupted: nothing of this run is kept: the same command starts over"
    assert "resume" not in "\n".join(err)
    assert list(tmp_path.iterdir()) == []
