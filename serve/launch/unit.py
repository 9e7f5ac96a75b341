"""``serve --print-unit``: a systemd unit that runs the user's own ``serve`` command line under a
service manager. serve exits 1 on every engine fault (vLLM's exit 0 after ``EngineDeadError``
included, ``watch``), so ``Restart=on-failure`` restarts it; exit 2 (bad input) never gets better
by restarting. ``RestartSec`` leaves a GB10 the ~60 s it takes to give an engine's memory back.
``KillMode=mixed``: the stop signal goes to serve alone, which stops vLLM's process group itself
(SIGTERM, SIGKILL after ``--stop-grace``); whatever is left after ``TimeoutStopSec`` is killed."""
from __future__ import annotations

import os
import shlex
import shutil
import sys

RESTART_SEC = 90  # ~60 s observed for a GB10's memory to come back after a kill, and a margin
TEARDOWN_S = 30  # serve's own teardown besides the engine's grace: the serve record, Ray nodes


def _systemd_word(word: str) -> str:
    """One ExecStart word: quoted for systemd's own splitting, ``%`` and ``$`` kept literal."""
    word = word.replace("%", "%%").replace("$", "$$")
    return shlex.quote(word) if word else "''"


def serve_argv(argv: list[str]) -> list[str]:
    """The command line the unit runs: this one without ``--print-unit``."""
    return [a for a in argv if a != "--print-unit"]


def render_unit(argv: list[str], stop_grace: float, description: str) -> str:
    exe = shutil.which("hybrid-build") or sys.executable
    head = [exe] if exe != sys.executable else [exe, "-m", "hybrid_build.pipeline.cli"]
    exec_start = " ".join(_systemd_word(w) for w in head + serve_argv(argv))
    return "\n".join([
        "[Unit]",
        f"Description={description}",
        "After=network-online.target",
        "Wants=network-online.target",
        "# five failed starts in 30 min: stop trying (a fault that keeps coming back needs a person)",
        "StartLimitIntervalSec=1800",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=simple",
        f"WorkingDirectory={os.getcwd()}",
        f"Environment={_systemd_word('PATH=' + os.environ.get('PATH', ''))}",
        "Environment=PYTHONUNBUFFERED=1",
        f"ExecStart={exec_start}",
        "# serve exits 1 on any engine fault (exit, stall, low memory), 2 on bad input (not restarted)",
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "# a GB10 gives an engine's memory back over ~60 s: a restart sooner runs out of memory again",
        f"RestartSec={RESTART_SEC}",
        "# SIGTERM to serve alone; serve stops vLLM (SIGTERM, SIGKILL after --stop-grace) and exits",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={int(stop_grace + TEARDOWN_S)}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])
