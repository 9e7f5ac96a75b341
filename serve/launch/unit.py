"""``serve --print-unit``: a systemd unit that runs the user's own ``serve`` command line under a
service manager. serve exits 1 on every engine fault (vLLM's exit 0 after ``EngineDeadError``
included, ``watch``), so ``Restart=on-failure`` restarts it; exit 2 (bad input) never gets better
by restarting. ``RestartSec`` leaves a GB10 the ~60 s it takes to give an engine's memory back.
``KillMode=mixed``: the stop signal goes to serve alone, which stops vLLM's process group itself
(SIGTERM, SIGKILL after ``--stop-grace``); whatever is left after ``TimeoutStopSec`` is killed.

The unit holds only what was meant: a newline or any other control character in an argument, the
working folder or PATH is refused (a newline would end the line, and what follows it would be a
directive of its own); everything else is written by systemd's own rules (systemd.syntax(7),
systemd.service(7) "Command lines", systemd.unit(7) "Specifiers"): each ExecStart word in double
quotes with backslashes and ``"`` escaped, ``%`` doubled everywhere (specifiers), ``$`` doubled in
ExecStart (variable expansion; Environment= expands none)."""
from __future__ import annotations

import os
import shutil
import sys

from hybrid_build.core.errors import UserError

RESTART_SEC = 90  # ~60 s observed for a GB10's memory to come back after a kill, and a margin
TEARDOWN_S = 30  # serve's own teardown besides the engine's grace: the serve record, Ray nodes


def _refuse_controls(text: str, what: str) -> str:
    """``text``, or a UserError naming ``what`` when it holds a control character (C0, DEL, C1)."""
    bad = next((c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:
        raise UserError(f"--print-unit: {what} {text!r} holds a control character ({bad!r}); a unit file cannot "
                        "hold it as meant (a newline would start a directive of its own)")
    return text


def _quoted(text: str) -> str:
    """A double-quoted systemd word: backslashes and quotes escaped (C-style escapes are unquoted)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_word(word: str, what: str) -> str:
    """One ExecStart word: quoted, ``%`` (specifiers) and ``$`` (variable expansion) kept literal."""
    return _quoted(_refuse_controls(word, what)).replace("%", "%%").replace("$", "$$")


def env_assignment(name: str, value: str) -> str:
    """An Environment= value: quoted, ``%`` kept literal (Environment= expands no ``$``)."""
    return _quoted(f"{name}={_refuse_controls(value, '$' + name)}").replace("%", "%%")


def plain_value(text: str, what: str) -> str:
    """A setting systemd takes whole (WorkingDirectory=, Description=): ``%`` kept literal; no
    control character, and no whitespace at either end (systemd strips it)."""
    _refuse_controls(text, what)
    if text != text.strip():
        raise UserError(f"--print-unit: {what} {text!r} begins or ends with whitespace, which systemd strips")
    return text.replace("%", "%%")


def serve_argv(argv: list[str]) -> list[str]:
    """The command line the unit runs: this one without ``--print-unit``."""
    return [a for a in argv if a != "--print-unit"]


def render_unit(argv: list[str], stop_grace: float, description: str) -> str:
    exe = shutil.which("hybrid-build") or sys.executable
    head = [exe] if exe != sys.executable else [exe, "-m", "hybrid_build.pipeline.cli"]
    exec_start = " ".join(exec_word(w, "the argument") for w in head + serve_argv(argv))
    return "\n".join([
        "[Unit]",
        f"Description={plain_value(description.strip(), 'the description')}",
        "After=network-online.target",
        "Wants=network-online.target",
        "# five failed starts in 30 min: stop trying (a fault that keeps coming back needs a person)",
        "StartLimitIntervalSec=1800",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=simple",
        f"WorkingDirectory={plain_value(os.getcwd(), 'the working folder')}",
        f"Environment={env_assignment('PATH', os.environ.get('PATH', ''))}",
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
