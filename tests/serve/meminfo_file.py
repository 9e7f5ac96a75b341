"""A /proc/meminfo the serve tests control (the watch and the start budget read it)."""
from __future__ import annotations

import os
from pathlib import Path


def write_meminfo(path: Path, available_gb: float, total_gb: float) -> None:
    """A /proc/meminfo with these figures (GB; the file's kB are KiB), written whole (rename)."""
    tmp = path.with_name(path.name + ".tmp")
    kib = lambda gb: int(gb * 1e9 / 1024)  # noqa: E731
    tmp.write_text(f"MemTotal:       {kib(total_gb)} kB\nMemFree:        {kib(available_gb / 2)} kB\n"
                   f"MemAvailable:   {kib(available_gb)} kB\n")
    os.replace(tmp, path)
