"""What a running ``serve`` has been through, for ``status``: its events (faults, restarts, READY)
with their times, in the artifact's work folder (``core.artifact.SERVE_RECORD``, one file per
profile; never published), rewritten whole at each event (temp file, rename). Each event is also
one line in the serve log, beside vLLM's own lines. A Hub id has no folder here: the log alone."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.artifact import SERVE_RECORD, WORK_DIR
from hybrid_build.core.bounded_read import SMALL_JSON, InputRefused, read_json

KEEP = 100  # the last events kept in the record (the log keeps them all)
SERVE_MARK = "hybrid-build serve: "  # the start of serve's own lines in the serve log
TAIL_BYTES = 1 << 20  # what is read of a log's end to find the engine's last lines


@dataclass
class ServeRecord:
    path: Path | None
    data: dict = field(default_factory=dict)

    @classmethod
    def open(cls, artifact: str, profile: str, log_path: Path, restart_limit: int) -> ServeRecord:
        folder = Path(artifact).expanduser()
        path = folder / SERVE_RECORD.format(profile=profile) if (folder / WORK_DIR).is_dir() else None
        from .listener import start_ticks

        rec = cls(path, {"profile": profile, "serve_pid": os.getpid(), "serve_start": start_ticks(os.getpid()),
                         "started_at": time.time(),
                         "log": str(log_path), "restart_limit": restart_limit, "restarts": 0, "state": "starting",
                         "engine_pid": None, "events": []})
        rec._write()
        return rec

    def add(self, event, log_path: Path | None = None) -> None:
        self.data["events"] = (self.data["events"] + [event.to_json()])[-KEEP:]
        if event.kind == "restart" and event.detail.startswith("engine started again"):
            self.data["restarts"] += 1
        if event.kind in ("exit", "stall", "memory", "node"):
            self.data["state"] = "fault"
            self.data["last_fault"] = event.to_json()
        self._write()
        if log_path is not None:
            try:
                with open(log_path, "a") as f:
                    f.write(f"{SERVE_MARK}{event.line()}\n")
            except OSError:
                pass

    def engine(self, pid: int) -> None:
        """The engine serve just started: its pid and start time, so that ``status`` can tell an engine
        that outlived its serve from another process that got the pid later."""
        from .listener import start_ticks

        self.data.update(engine_pid=pid, engine_start=start_ticks(pid))
        self._write()

    def ready(self, engine_pid: int) -> None:
        self.data.update(state="ready", engine_pid=engine_pid, ready_at=time.time())
        self._write()

    def close(self) -> None:
        self.data.update(state="stopped", stopped_at=time.time())
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.data, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass  # the record is for status; serving goes on without it


def engine_lines(log_path: Path | None, start: int = 0) -> list[str]:
    """The engine's own lines in the serve log from byte ``start`` on (its last ``TAIL_BYTES``): serve's
    event lines, which share the file, left out."""
    if log_path is None:
        return []
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start, size - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if not ln.startswith(SERVE_MARK)]


def alive(pid: int | None, start: int | None) -> bool:
    """Whether the process ``pid`` that started at ``start`` (clock ticks; None: not recorded) runs."""
    from .listener import start_ticks

    if not pid:
        return False
    if Path("/proc/self/stat").exists():
        now = start_ticks(int(pid))
        return now is not None and (start is None or now == start)
    try:
        os.kill(int(pid), 0)  # no /proc here: the pid alone
    except (OSError, ValueError):
        return False
    return True


def read_records(artifact: Path) -> list[dict]:
    """Every profile's serve record in an artifact's work folder."""
    out = []
    for p in sorted((artifact / WORK_DIR).glob(Path(SERVE_RECORD).name.format(profile="*"))):
        try:
            out.append(read_json(p, p.name, SMALL_JSON))
        except (OSError, InputRefused):
            continue
    return out
