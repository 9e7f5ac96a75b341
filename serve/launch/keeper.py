"""The engine's keeper: a small process that ends the engine's process group when ``serve`` ends,
however it ends (SIGKILL and the kernel's OOM killer included), so that no engine outlives its
serve, holding the port, the GPU and the memory.

``serve`` starts it beside each engine (``launcher.start``) with the read end of a pipe as its
stdin; ``serve`` alone holds the write end. The kernel closes that end when ``serve`` exits, by any
means: the keeper reads end-of-file, then SIGTERMs the engine's group and SIGKILLs whatever is left
of it after the grace. When ``serve`` stops the engine itself it writes one byte first: the keeper
then leaves without a signal. The engine's leader also gets ``PR_SET_PDEATHSIG`` (SIGTERM when
``serve`` dies), which covers the instant before the keeper runs; only the keeper reaches the rest
of the group (vLLM's engine core and workers, a process stuck in a CUDA call).

Run by path (``python -I keeper.py PGID GRACE``): it imports the standard library alone, so it
starts in milliseconds and does not depend on the environment serve was started in."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STAND_DOWN = b"x"  # serve stopped the engine itself
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> object | None:
    """A ``preexec_fn`` that asks the kernel for SIGTERM when the parent (serve) dies, or None where
    there is no ``prctl`` (not Linux). Resolved here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # serve died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def end_group(pgid: int, grace: float, poll: float = 0.05) -> None:
    """SIGTERM to the group, SIGKILL to whatever of it is left after ``grace`` seconds."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(poll)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start(pgid: int, grace: float) -> tuple[subprocess.Popen, int]:
    """Start a keeper for the group ``pgid``; returns it and the pipe's write end (serve keeps it
    open while it lives; ``stand_down`` closes it)."""
    r, w = os.pipe()  # neither end is inherited by other children (O_CLOEXEC)
    try:
        keeper = subprocess.Popen([sys.executable, "-I", str(Path(__file__).resolve()), str(pgid), f"{grace:g}"],
                                  stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)  # a terminal's Ctrl-C is serve's to handle
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return keeper, w


def stand_down(keeper: subprocess.Popen, w: int) -> None:
    """serve stopped the engine itself: the keeper leaves without a signal."""
    try:
        os.write(w, STAND_DOWN)
    except OSError:
        pass
    os.close(w)
    try:
        keeper.wait(10)
    except subprocess.TimeoutExpired:
        keeper.kill()
        keeper.wait()


def main(argv: list[str]) -> int:
    pgid, grace = int(argv[0]), float(argv[1])
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: (end_group(pgid, grace), os._exit(0)))
    while True:
        try:
            got = os.read(0, 1)
        except InterruptedError:
            continue
        if got == STAND_DOWN:
            return 0
        if not got:  # end of file: serve is gone
            end_group(pgid, grace)
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
