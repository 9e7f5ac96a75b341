"""What a stop signal does: SIGINT, SIGTERM and SIGHUP alike raise ``Interrupted`` in the main
thread (``stop_on_signals``: the CLI sets it for every command), and ``stop_signals_held`` holds
them back while a child process starts, until the child is listed for the teardown. Commands and
library code (``serve.multinode``) alike import it."""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


def _restore(before: dict) -> None:
    for s, handler in before.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


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
    return lambda: _restore(before)


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold a stop signal's Python handler back until the block ends, then give the first one that
    came to the handler that was there. Start a child and list it for the teardown inside the
    block: a signal that interrupted ``Popen`` after its fork, or came before the child is listed,
    would leave a child no teardown knows of (seen: a stand-in vLLM that outlived a SIGTERM). Only
    the main thread has handlers: off it the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    before = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        _restore(before)
        if got:
            signal.raise_signal(got[0])  # now, to the handler that was there
