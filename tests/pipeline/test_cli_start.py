"""The CLI answers at once: building the parser, `--version` and every `--help` import none of the
heavy libraries (torch, httpx, vLLM and the rest), and every command module, imported alone, imports
none either: a command imports them in the function that runs it. Guarded by what is imported, never
by timing; how long it takes is `benchmarks/bench_cli_start.py`'s to measure."""
from __future__ import annotations

import json
import subprocess
import sys

from hybrid_build.core import formats
from hybrid_build.pipeline.cli import COMMANDS, build_parser

HEAVY = ("torch", "transformers", "safetensors", "huggingface_hub", "triton", "numpy", "tokenizers", "auto_round",
         "llmcompressor", "compressed_tensors", "lm_eval", "matplotlib", "ray", "pydantic", "yaml", "tqdm", "httpx",
         "httpcore", "vllm", "prometheus_client", "model_signing")

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


# In a fresh interpreter per module: the heavy modules that importing it brought in.
ALONE = r"""
import importlib, json, sys
HEAVY = %r
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(h for h in HEAVY if h in sys.modules)))
"""


def test_every_command_module_imports_alone_without_a_heavy_library():
    # one interpreter each: a module's heavy import must not hide behind another module's
    found = {}
    for module in COMMANDS.values():
        proc = subprocess.run([sys.executable, "-c", ALONE % (HEAVY,), module], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        found[module] = json.loads(proc.stdout)
    assert found == {m: [] for m in COMMANDS.values()}


def test_the_probe_sees_a_heavy_import():
    """The check can fail: a module that imports httpx at its top is caught."""
    proc = subprocess.run([sys.executable, "-c", ALONE % (HEAVY,), "hybrid_build.core.http_client"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "httpx" in json.loads(proc.stdout)


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
