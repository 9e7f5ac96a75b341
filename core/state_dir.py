"""The user's state folder: where hybrid-build keeps what belongs to this machine and this user
(serve's logs, a generated API key), never the current folder and never an artifact that could be
published. ``$HYBRID_BUILD_STATE_DIR`` names it outright; else ``$XDG_STATE_HOME/hybrid-build`` (an
absolute one only, as the XDG spec says); else ``~/.local/state/hybrid-build``."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "HYBRID_BUILD_STATE_DIR"
FOLDER = "hybrid-build"  # under $XDG_STATE_HOME


def state_dir() -> Path:
    """The folder (not created here)."""
    given = os.environ.get(ENV, "")
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "state"
    return base / FOLDER
