"""The CLI answers at once: building the parser, `--version` and every `--help` import none of the
heavy libraries (torch and the rest). Guarded by what is imported, never by timing; how long
it takes is `benchmarks/bench_cli_start.py`'s to measure."""
from __future__ import annotations

import json
import subprocess
import sys

from hybrid_build.core import formats
from hybrid_build.pipeline.cli import COMMANDS, build_parser

HEAVY = ("torch", "transformers", "safetensors", "huggingface_hub", "triton", "numpy", "tokenizers", "auto_round",
         "llmcompressor", "compressed_tensors", "lm_eval", "matplotlib", "ray", "pydantic", "yaml", "tqdm")

# In a fresh interpreter: after each step, the heavy modules that step brought in.
PROBE = r"""
import contextlib, io, json, sys
HEAVY = %r
from hybrid_build.pipeline.cli import COMMANDS, build_parser, main

def heavy():
    return sorted(h for h in HEAVY if h in sys.modules)

found = {}
build_parser()
found["build_parser()"] = heavy()
for argv in [["--version"], ["--help"]] + [[name, "--help"] for name in COMMANDS]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    found[" ".join(argv)] = [heavy(), out.getvalue()]
print(json.dumps(found))
"""


def _probe() -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_version_and_every_help_import_no_heavy_library():
    found = _probe()
    assert found.pop("build_parser()") == []
    assert set(found) == {"--version", "--help", *(f"{n} --help" for n in COMMANDS)}
    for argv, (heavy, out) in found.items():
        assert heavy == [], f"`hybrid-build {argv}` imported {', '.join(heavy)}"
        assert out.strip(), f"`hybrid-build {argv}` printed nothing"
    from hybrid_build.core import __version__

    assert found["--version"][1].strip() == f"hybrid-build {__version__}"


def test_run_help_names_every_registered_format():
    """`run --format`'s help names the formats without importing them: it must keep up with the registry."""
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    help_text = next(a for a in run._actions if a.dest == "format").help
    for name in formats.names():
        assert name in help_text, name


def test_serve_help_names_every_shipped_profile():
    """`serve --profile`'s help lists the shipped recipes' profiles from their text (no YAML parser at
    --help): the same names, in the same order, as the recipes loaded for real."""
    from hybrid_build.recipes.schema import RECIPE_DIR, load_recipe

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = next(a for a in serve._actions if a.dest == "profile").help
    names: list[str] = []
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        names += [n for n in load_recipe(str(path)).serve.profiles if n not in names]
    assert names and f"shipped recipes: {', '.join(names)};" in help_text
