"""What every command shares: help formatting with examples, ``--json`` output, progress bars and
the one-line wording of a filesystem error (what a stop signal does: ``stop_signals``). Commands
import these; library code does not."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


class ExampleFormatter(argparse.RawDescriptionHelpFormatter):
    pass


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
