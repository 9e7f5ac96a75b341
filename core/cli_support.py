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

from .limits import MAX_ACCEPT, MAX_COUNT, MAX_GB, MAX_SECONDS, MAX_SEED, MAX_STREAMS, MAX_TOKENS


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


def _number(kind: type, lo: float | None, hi: float | None, lo_open: bool) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'a whole number' if kind is int else 'a number'}: {text!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        below = lo is not None and (value <= lo if lo_open else value < lo)
        above = hi is not None and value > hi
        if below or above:
            def show(v: float) -> str:
                return f"{int(v):,}" if float(v).is_integer() else f"{v:g}"

            if lo is not None and hi is not None:
                want = f"between {show(lo)} and {show(hi)}" if not lo_open else \
                    f"more than {show(lo)} and at most {show(hi)}"
            elif lo is not None:
                want = f"more than {show(lo)}" if lo_open else f"at least {show(lo)}"
            else:
                want = f"at most {show(hi)}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in [lo, hi], refused in argparse's one line otherwise."""
    return _number(int, lo, hi, False)


def float_range(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [lo, hi] (``lo_open``: above lo)."""
    return _number(float, lo, hi, lo_open)


# The numeric options' types, bounded by what the numbers mean (``core/limits``): a value outside is
# argparse's one line, exit 2, before anything starts (dry runs included). Where the bound depends on
# the input (a model's max context, a drafter's block) the command checks that too, once it is known.
PORT = int_range(1, 65535)
POSITIVE_INT = int_range(1, MAX_COUNT)
COUNT = int_range(0, MAX_COUNT)
SECONDS = float_range(0, MAX_SECONDS, lo_open=True)
NON_NEGATIVE_SECONDS = float_range(0, MAX_SECONDS)
POSITIVE = float_range(0, 1e9, lo_open=True)
NON_NEGATIVE = float_range(0, 1e9)
SHARE = float_range(0, 1)
STREAMS = int_range(1, MAX_STREAMS)
ACCEPTANCE = float_range(1, MAX_ACCEPT)
VERIFY_POSITIONS = int_range(1, MAX_ACCEPT)
TOKENS = int_range(1, MAX_TOKENS)
SEED = int_range(0, MAX_SEED)
GB = float_range(0, MAX_GB)
GBPS = float_range(0, MAX_GB, lo_open=True)


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
