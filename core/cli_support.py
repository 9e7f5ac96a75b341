"""What every command shares: help formatting with examples, ``--json`` output, progress bars and
the one-line wording of a filesystem error (what a stop signal does: ``stop_signals``). Commands
import these; library code does not."""
from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any


class ExampleFormatter(argparse.RawDescriptionHelpFormatter):
    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.choices, LazyChoices):  # argparse lists them for %(choices)s: not read for help
            action = copy.copy(action)
            action.choices = None
        return super()._expand_help(action)


class LazyChoices:
    """``choices`` for argparse read from a registry on first use: the registry's import (the output
    formats import torch) happens when a value is checked, never when the parser is built or ``--help``
    printed. Give the argument a ``metavar``: argparse would list the choices in the usage line."""

    def __init__(self, read: Callable[[], list[str]]) -> None:
        self._read = read

    def __contains__(self, value: object) -> bool:
        return value in self._read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


# exit code -> the outcome ``--json`` names on a path that ends in an error (0: a command's own object)
OUTCOMES = {1: "failed", 2: "bad input", 3: "could not run"}
_json_written = False  # whether this command printed its JSON object (``main`` prints one on failure if not)


def emit_json(data: Any) -> None:
    global _json_written
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    _json_written = True


def json_written(reset: bool = False) -> bool:
    """Whether ``emit_json`` ran since the last reset (``main`` resets it as a command starts)."""
    global _json_written
    was = _json_written
    if reset:
        _json_written = False
    return was


def emit_failure_json(code: int, message: str) -> None:
    """The object ``--json`` prints on a path that ends in an error: the outcome, the exit code, the line."""
    outcome = OUTCOMES.get(code, "interrupted" if code > 128 else "failed")
    emit_json({"outcome": outcome, "exit_code": code, "error": message})


def describe_os_error(e: OSError) -> str:
    """One line for a filesystem failure: the path, then the cause in words."""
    cause = e.strerror or str(e)
    path = e.filename if e.filename is not None else getattr(e, "path", None)
    return f"{path}: {cause}" if path else cause


def progress(quiet: bool, **kw):
    """A tqdm bar the CLI owns; disabled with --quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(disable=quiet or None, **kw)
