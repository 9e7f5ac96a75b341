"""The output-format registry: what it lists, how a recipe names a format, and that a format is
one module: a new one reaches the schema, the CLI and the plan without editing them, and no code
outside ``core/formats`` compares format names."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import tomllib

from hybrid_build.core import formats
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import RecipeError, UserError
from hybrid_build.core.formats.base import OutputFormat, parts_bytes
from hybrid_build.core.formats.inc_hybrid import IncHybrid
from hybrid_build.pipeline.cli import build_parser, main
from hybrid_build.recipes.conversion import plan_conversion
from hybrid_build.recipes.schema import load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parents[2]
FORMATS_DIR = ROOT / "core" / "formats"
# a string equal to a format name that is not one: the source checkpoint's quant_method, read as input
NOT_A_FORMAT = {("core/checkpoint.py", "compressed-tensors")}


class _FakeFormat(IncHybrid):
    """A third format for the tests: inc-hybrid's layout with the head stored at 16 bytes a row more."""

    name = "fake-fmt"
    description = "a test format"

    def head_bytes(self, n: int, k: int, storage: str) -> int:
        return super().head_bytes(n, k, storage) + 16 * n


@pytest.fixture
def fake_format(monkeypatch) -> OutputFormat:
    fake = _FakeFormat()
    monkeypatch.setitem(formats.REGISTRY, fake.name, fake)
    return fake


def test_registry_lists_exactly_the_format_modules():
    modules = sorted(p.stem for p in FORMATS_DIR.glob("*.py") if p.stem not in ("__init__", "base"))
    found = {}
    for stem in modules:
        fmt = __import__(f"hybrid_build.core.formats.{stem}", fromlist=["FORMAT"]).FORMAT
        assert isinstance(fmt, OutputFormat) and fmt.description and "\n" not in fmt.description, stem
        found[fmt.name] = fmt
    assert len(found) == len(modules)  # one name per module
    assert formats.REGISTRY == found
    assert formats.names()[0] == formats.DEFAULT and set(formats.names()) == {"inc-hybrid", "compressed-tensors"}


def test_unknown_format_is_one_line_listing_the_valid_ones():
    with pytest.raises(RecipeError) as e:
        parse_recipe({"name": "x", "output": {"format": "gguf"}}, "x.yaml")
    assert str(e.value) == "x.yaml: field 'output.format': must be one of 'inc-hybrid' or 'compressed-tensors'"
    with pytest.raises(UserError) as e:
        formats.get("gguf")
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in formats.names())


def test_unknown_format_on_the_command_line_exits_2(tiny_checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "o"), "--format", "gguf", "--dry-run"])
    assert e.value.code == 2
    assert "'inc-hybrid', 'compressed-tensors'" in capsys.readouterr().err


def test_a_new_format_module_reaches_schema_cli_and_plan(fake_format, tiny_checkpoint, tmp_path, capsys):
    """Registering a format (what a new module does) is all it takes: the recipe accepts it, `run
    --format` offers it, and the plan's bytes are the format's."""
    recipe = parse_recipe({"name": "x", "output": {"format": "fake-fmt"}}, "x.yaml")
    assert recipe.output.fmt is fake_format
    with pytest.raises(RecipeError, match="'inc-hybrid', 'compressed-tensors' or 'fake-fmt'"):
        parse_recipe({"name": "x", "output": {"format": "gguf"}}, "x.yaml")
    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]
    assert "fake-fmt" in next(a for a in run_parser._actions if a.dest == "format").choices

    assert main(["run", str(tiny_checkpoint), "-o", str(tmp_path / "o"), "--recipe", "tiny", "--format", "fake-fmt",
                 "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "fake-fmt"
    head = next(c for c in data["conversion"]["conversions"] if c["kind"] == "int8")
    n, k = head["shape"]
    assert head["bytes_after"] == parts_bytes(fake_format.head_parts(n, k)) + 16 * n


def test_a_head_a_format_cannot_store_names_the_formats_that_can(tiny_checkpoint):
    recipe = load_recipe("tiny")
    ckpt = Checkpoint.read_folder(tiny_checkpoint)
    n, k = ckpt.tensors["lm_head.weight"].shape
    for fmt in formats.REGISTRY.values():
        assert fmt.head_problem(n, k) is None, fmt.name  # the demo's head fits every format
    assert formats.get("inc-hybrid").head_problem(n - 2, k)
    assert formats.get("compressed-tensors").head_problem(n - 2, k) is None
    assert plan_conversion(ckpt, recipe).of_kind("int8")


def _package_files() -> list[tuple[str, Path]]:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = []
    for folder in dirs.values():
        for path in sorted((ROOT / folder).glob("*.py")):
            out.append((str(path.relative_to(ROOT)), path))
    return out


def test_no_code_outside_the_registry_names_a_format():
    """A string literal equal to a format name outside ``core/formats`` means code that decides by
    the name instead of asking the format object."""
    names = set(formats.names())
    found = []
    for rel, path in _package_files():
        if rel.startswith("core/formats/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names and (rel, node.value) not in NOT_A_FORMAT:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found


# Code that runs inside vLLM's process cannot import core/ and spells the plugin's switch itself;
# the recipe schema's Literal is the storage's user-facing spelling (pinned to the registry below).
HEAD_WORDS_ALLOWED = {"recipes/schema.py", "serve/runtime/plugin.py", "serve/runtime/fixes.py"}
# a tensor's dtype class (core/tensor_classes.py), not the recipe's head storage
NOT_HEAD_STORAGE = {("serve/speed/bandwidth.py", "first.storage == 'bf16'")}


def test_head_storage_is_asked_of_the_format():
    """The head storage words ("gptq-int8", "quantize-at-load", and "bf16" compared with the
    recipe's head) appear only in the registry: elsewhere code asks the format (``stores_head``,
    ``head_label_for``) or the registry (``head_quantized_at_load``, ``head_stored``)."""
    from hybrid_build.core.formats import base

    found = []
    for rel, path in _package_files():
        if rel.startswith(("core/formats/", "serve/runtime/patches/")) or rel in HEAD_WORDS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in (base.HEAD_STORED, base.AT_LOAD_LABEL):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Constant) and s.value == base.HEAD_AT_LOAD for s in sides) and \
                        any("lm_head" in ast.unparse(s) or "storage" in ast.unparse(s) for s in sides) and \
                        (rel, ast.unparse(node)) not in NOT_HEAD_STORAGE:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found


def test_head_storage_answers_agree_with_the_schema_and_labels():
    from typing import get_args

    from hybrid_build.core.formats import base
    from hybrid_build.recipes.schema import HeadSpec

    assert set(get_args(HeadSpec.model_fields["storage"].annotation)) == {base.HEAD_STORED, base.HEAD_AT_LOAD}
    for fmt in formats.REGISTRY.values():
        assert fmt.stores_head(base.HEAD_STORED) and not fmt.stores_head(base.HEAD_AT_LOAD)
        assert fmt.head_label_for(base.HEAD_STORED) == fmt.head_label and formats.head_stored(fmt.head_label)
        assert fmt.head_label_for(base.HEAD_AT_LOAD) == base.AT_LOAD_LABEL
        assert formats.head_quantized_at_load(base.AT_LOAD_LABEL) and not formats.head_stored(base.AT_LOAD_LABEL)
        assert not formats.head_quantized_at_load(fmt.head_label)
        assert fmt.head_bytes(248, 16, base.HEAD_AT_LOAD) == 248 * 16 * 2
        assert fmt.head_bytes(248, 16) == parts_bytes(fmt.head_parts(248, 16))
    assert not formats.head_stored("unchanged") and not formats.head_quantized_at_load(None)
