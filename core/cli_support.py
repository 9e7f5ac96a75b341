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


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def describe_os_error(e: OSError) -> str:
    """One line for a filesystem failure: the path, then the cause in words."""
    cause = e.strerror or str(e)
    path = e.filename if e.filename is not None else getattr(e, "path", None)
    return f"{path}: {cause}" if path else cause


def progress(quiet: bool, **kw):
    """A tqdm bar the CLI owns; disabled with --quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(disable=quiet or None, **kw)
