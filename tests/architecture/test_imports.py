"""The shape of the house: every module imports, no import cycles, folders in layers, arrows
that point one way.

The graph counts every ``import`` statement among ``hybrid_build`` modules, at module level or
inside a function: a lazy import still makes the two modules depend on each other. The top-level
folders are layers (``LAYERS``, ground first); a module imports only from its own folder or a
folder below it. Within the folders: commands (``pipeline/commands``, ``*command.py``, ``cli``) ->
the library (build, runner) -> stages -> shared machinery -> pure transforms in ``calibration``.
Only commands, and modules run as their own process, parse arguments.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = {"vllm"}
# the top-level folders, ground first: each may import itself and the folders before it (pipeline
# is imported by the vLLM plugin inside vLLM's process only)
LAYERS = ("calibration", "core", "recipes", "validate", "serve", "pipeline")
# serve's sub-packages, one per process they run in, ground first: ``runtime`` runs inside vLLM and
# imports nothing else of hybrid_build (the docker engine mounts that folder alone)
SERVE_LAYERS = ("runtime", "speed", "bench", "launch")
# validate's sub-packages above its own modules (the artifact's checks, the reference): a server
# checked (verify), then task accuracy (eval)
VALIDATE_LAYERS = ("verify", "eval")
RUNTIME = "hybrid_build.serve.runtime"


def _modules() -> dict[str, Path]:
    """Installed module name -> file, from pyproject's package-dir mapping."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for pkg, folder in dirs.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The hybrid_build modules ``name`` imports (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text())
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_module_imports():
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:
                failed[name] = repr(e)
    assert not failed


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles() == []


def test_the_cycle_finder_finds_a_planted_cycle(monkeypatch):
    """The check above can fail: two modules that import each other are reported."""
    a, b = "hybrid_build.pipeline.build", "hybrid_build.pipeline.runner"
    monkeypatch.setitem(GRAPH, a, GRAPH[a] | {b})
    monkeypatch.setitem(GRAPH, b, GRAPH[b] | {a})
    assert [a, b] in _cycles()


def _is_command(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return ".commands." in name or leaf in ("cli", "cli_support") or leaf.endswith("command")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_arrows_point_one_way(name):
    deps = GRAPH[name]
    if name.startswith("hybrid_build.calibration"):
        assert not {d for d in deps if not d.startswith("hybrid_build.calibration")}, "calibration is pure transforms"
    if ".pipeline.stages." in name:
        assert not {d for d in deps if d.endswith((".runner", ".build")) or _is_command(d)}, \
            "a stage never imports the runner, the build entry or a command"
    if not _is_command(name):
        assert not {d for d in deps if _is_command(d)}, "library code does not import commands"
        if not _is_entry_point(MODULES[name]):
            assert "argparse" not in _stdlib_imports(MODULES[name]), "only commands parse arguments"


def _is_entry_point(path: Path) -> bool:
    """A module run as its own process (``python -m ...``: the end-to-end child, the patch applier
    in the container) parses its own arguments."""
    return 'if __name__ == "__main__":' in path.read_text()


def _stdlib_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def _layer(name: str) -> tuple[int, int]:
    """(folder, sub-package within serve); the serve package's own __init__ is below its sub-packages."""
    parts = name.split(".")
    sub = SERVE_LAYERS.index(parts[2]) + 1 if parts[1] == "serve" and len(parts) > 2 else 0
    if parts[1] == "validate" and len(parts) > 3:
        sub = VALIDATE_LAYERS.index(parts[2]) + 1
    return LAYERS.index(parts[1]), sub


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps if _layer(b) > _layer(a))


def test_every_folder_is_a_layer():
    assert {name.split(".")[1] for name in MODULES} == set(LAYERS)
    assert {name.split(".")[2] for name in MODULES if name.startswith("hybrid_build.serve.")} == set(SERVE_LAYERS)
    assert {name.split(".")[2] for name in MODULES
            if name.startswith("hybrid_build.validate.") and name.count(".") > 2} == set(VALIDATE_LAYERS)


def _hybrid_build_imports(path: Path) -> set[str]:
    """Every absolute ``hybrid_build`` import a file makes, listed or not in MODULES."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "hybrid_build")
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] == "hybrid_build":
            out.add(node.module)
    return out


def _outside_runtime(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    found = [(a, b) for a, deps in graph.items() if a.startswith(RUNTIME) for b in deps if not b.startswith(RUNTIME)]
    found += [(a, b) for a in graph if a.startswith(RUNTIME) for b in _hybrid_build_imports(MODULES[a])]
    return sorted(found)


def test_the_runtime_package_imports_nothing_else_of_hybrid_build():
    """What runs inside vLLM (and, in the docker image, from its folder alone) reaches only itself,
    through relative imports: the folder works wherever it is mounted."""
    assert [n for n in MODULES if n.startswith(RUNTIME)], "the runtime package has modules"
    assert _outside_runtime(GRAPH) == []


def test_an_import_out_of_the_runtime_package_is_caught(monkeypatch):
    a = f"{RUNTIME}.plugin"
    monkeypatch.setitem(GRAPH, a, GRAPH[a] | {"hybrid_build.core.errors"})
    assert (a, "hybrid_build.core.errors") in _outside_runtime(GRAPH)


def test_folders_import_downward_only():
    assert _upward(GRAPH) == []


def test_an_upward_import_between_folders_is_caught(monkeypatch):
    """Caught as an upward edge whether or not it also closes a cycle."""
    for a, b in [("hybrid_build.core.checkpoint", "hybrid_build.pipeline.runner"),
                 ("hybrid_build.recipes.schema", "hybrid_build.serve.launch.engine"),
                 ("hybrid_build.validate.checks", "hybrid_build.serve.runtime.plugin"),
                 ("hybrid_build.serve.runtime.fixes", "hybrid_build.serve.launch.engine"),
                 ("hybrid_build.validate.report", "hybrid_build.validate.verify.verify"),
                 ("hybrid_build.validate.verify.verify", "hybrid_build.validate.eval.task_eval")]:
        monkeypatch.setitem(GRAPH, a, GRAPH[a] | {b})
        assert (a, b) in _upward(GRAPH)
        monkeypatch.undo()


def test_a_command_module_that_does_not_import_is_an_error_naming_it(monkeypatch, capsys):
    from hybrid_build.pipeline import cli

    monkeypatch.setitem(cli.COMMANDS, "frobnicate", "hybrid_build.pipeline.commands.frobnicate")
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`frobnicate`" in err[0] and "hybrid_build.pipeline.commands.frobnicate" in err[0]
