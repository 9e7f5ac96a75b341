"""Loader and scorer of hybrid-build's bundled lm-eval tasks (referenced from the YAML beside it).

lm-eval imports this file by path (``!function tasks.NAME``). The items are the JSONL files in
this folder, written by ``python -m hybrid_build.validate.eval.eval_taskset``; nothing is downloaded.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(kind: str):
    import datasets

    rows = [json.loads(line) for line in (HERE / f"{kind}.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_arith(**_kw):
    return _load("arith")


def load_code(**_kw):
    return _load("code")


def load_toolcall(**_kw):
    return _load("toolcall")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def score_number(doc: dict, results: list[str]) -> dict:
    """1 when the first integer of the answer is the right one."""
    m = re.search(r"-?\d+", results[0])
    return {"exact_match": float(bool(m) and m.group(0) == doc["answer"])}


def score_code(doc: dict, results: list[str]) -> dict:
    """1 when the first line of the answer is the right expression (spaces aside)."""
    norm = lambda s: re.sub(r"\s+", "", s)  # noqa: E731
    return {"exact_match": float(norm(_first_line(results[0])) == norm(doc["answer"]))}


def score_toolcall(doc: dict, results: list[str]) -> dict:
    """1 when the first JSON object of the answer equals the right call (as JSON, not as text)."""
    text = results[0].strip()
    start = text.find("{")
    try:
        call, _ = json.JSONDecoder().raw_decode(text[start:]) if start >= 0 else (None, 0)
    except ValueError:
        call = None
    return {"exact_match": float(call == json.loads(doc["answer"]))}
