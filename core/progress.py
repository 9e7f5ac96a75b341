"""Progress reporting as library code sees it: a factory of bars with ``update`` and ``close``.

Library code takes a factory and never draws anything; the CLI passes one that makes tqdm bars
(``hybrid_build.pipeline.cli.progress``), tests and quiet runs use ``null_progress``.
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
