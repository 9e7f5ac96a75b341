"""What a name read from an artifact may be: a relative POSIX path below the folder. A provenance,
an index, a report or a signature is data from wherever the folder came from; each name in it is
checked here before anything is opened, hashed, uploaded or linked by it (``core.artifact.artifact_path``
then resolves it and checks that it stays inside)."""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def name_problem(rel: object) -> str | None:
    """Why ``rel``, a name read from an artifact (a provenance, index, report or signature entry), is
    not a relative POSIX path below the folder, or None when it is: no empty or ``.``/``..``
    component, no leading ``/``, no backslash, no control character. What a download names is
    checked here before anything is opened, hashed, uploaded or linked by that name."""
    if not isinstance(rel, str) or not rel:
        return "an empty name"
    if _CONTROL.search(rel):
        return f"{rel!r} holds a control character"
    if "\\" in rel:
        return f"{rel!r} holds a backslash"
    if rel.startswith("/"):
        return f"{rel!r} is an absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return f"{rel!r} climbs out through '..'"
    if "" in parts or "." in parts:
        return f"{rel!r} has an empty or '.' component"
    return None
