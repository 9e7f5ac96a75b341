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


@dataclass
class ServeRecord:
    path: Path | None
    data: dict = field(default_factory=dict)

    @classmethod
    def open(cls, artifact: str, profile: str, log_path: Path, restart_limit: int) -> ServeRecord:
        folder = Path(artifact).expanduser()
        path = folder / SERVE_RECORD.format(profile=profile) if (folder / WORK_DIR).is_dir() else None
        rec = cls(path, {"profile": profile, "serve_pid": os.getpid(), "started_at": time.time(),
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
                    f.write(f"hybrid-build serve: {event.line()}\n")
            except OSError:
                pass

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


def read_records(artifact: Path) -> list[dict]:
    """Every profile's serve record in an artifact's work folder."""
    out = []
    for p in sorted((artifact / WORK_DIR).glob(Path(SERVE_RECORD).name.format(profile="*"))):
        try:
            out.append(read_json(p, p.name, SMALL_JSON))
        except (OSError, InputRefused):
            continue
    return out
