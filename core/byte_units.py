"""How a byte count is written for people: decimal units (kB, MB, GB), as the docs and the Hub
write file and model sizes, so that a figure the tool prints matches the one a user reads there."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1234`` -> ``1.23 kB``; bytes below 1,000 as an integer."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
