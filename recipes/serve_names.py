"""The plain names and defaults of serving (the shipped recipes' profile names, the docker image,
the smoke test, the drafter's source placeholder): what `serve --help` shows, readable without
pydantic or a YAML parser. ``profiles`` holds the models that validate a recipe's profiles and
re-exports these."""
from __future__ import annotations

import re
from pathlib import Path

DOCKER_IMAGE = "ghcr.io/aeon-7/aeon-vllm-ultimate:2026-06-18-v0.23.0-dflashfix"
# `serve`'s smoke test: this question, and what a trained model's answer contains (a recipe's
# serve.smoke_expect overrides it; null for random weights)
SMOKE_PROMPT = "What is the capital of France? Answer in one word."
SMOKE_EXPECT = "Paris"
# in a drafter's ``model``: the source checkpoint's folder (the demo's drafter is ``{source}-dflash``)
SOURCE_PLACEHOLDER = "{source}"


def shipped_profile_names() -> list[str]:
    """The serve profiles the shipped recipes define, first seen first, read from the recipes' text
    (the keys one level under ``profiles:``) so that ``serve --help`` stays instant; the recipe a
    command resolves is what checks ``--profile``."""
    names: list[str] = []
    for path in sorted(Path(__file__).parent.glob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            top = re.match(r"( *)profiles:", line)
            if not top:
                continue
            inner = None
            for below in lines[i + 1:]:
                key = re.match(r"( *)([A-Za-z0-9_.-]+):", below)
                if not below.strip() or below.lstrip().startswith("#"):
                    continue
                indent = len(below) - len(below.lstrip())
                if indent <= len(top[1]):
                    break
                inner = indent if inner is None else inner
                if key and indent == inner and key[2] not in names:
                    names.append(key[2])
    return names
