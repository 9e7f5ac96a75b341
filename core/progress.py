"""Progress reporting as library code sees it: a factory of bars with ``update`` and ``close``.

A factory is called with tqdm's keywords (``total``, ``desc``, ``unit``, ...) and returns a bar.
Library code takes a factory and never draws anything; the CLI passes one that makes tqdm bars
(``core.cli_support.progress``), tests and quiet runs use ``null_progress``. ``close_bar`` closes
a bar of either kind (a factory may return any object with ``update``).
"""
from __future__ import annotations

from collections.abc import Callable

ProgressFactory = Callable[..., object]


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def null_progress(**_kw) -> _NullBar:
    return _NullBar()


def close_bar(bar) -> None:
    close = getattr(bar, "close", None)
    if close:
        close()
