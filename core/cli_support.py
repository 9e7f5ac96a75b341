"""What every command shares: help formatting with examples, ``--json`` output, progress bars,
the one-line wording of a filesystem error, and what a stop signal does. Commands import these;
library code does not."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

# what a terminal (Ctrl-C), a daemon manager or `docker stop` (SIGTERM) and a closed terminal or
# ssh session (SIGHUP) send: each stops a command the same way
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread as Ctrl-C is, so that every ``finally`` that stops
    a child process runs whichever signal came."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt_exit_code(e: BaseException) -> int:
    """128 + the signal's number, as a shell reports it (130 for Ctrl-C)."""
    return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)


def _raise_interrupted(signum: int, _frame) -> None:
    for s in STOP_SIGNALS:  # the teardown that follows is bounded; a second signal must not cut it short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def stop_on_signals() -> Callable[[], None]:
    """Make SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` in the main thread, also where the
    process started with SIGINT ignored (a job started in the background by a shell script, where
    Python would never raise KeyboardInterrupt). Returns the function that restores the handlers
    found; off the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, _raise_interrupted)

    def restore() -> None:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    return restore


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
