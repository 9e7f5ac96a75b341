"""Time as the tool's records write it."""
from __future__ import annotations

import time


def utc_now() -> str:
    """Now, as reports and records write it: ISO 8601 UTC to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
