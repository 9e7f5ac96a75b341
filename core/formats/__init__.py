"""The output formats: one module each in this package, found by the registry here.

A format module defines ``FORMAT``, an ``OutputFormat`` (``base.py``) that says what the converted
tensors look like, the ``quantization_config``, how validate reads them back and what the card
says. Every module of this package but ``base`` is one; adding a format is adding a module. Code
outside this package asks ``get(name)`` for the object and never compares format names.
"""
from __future__ import annotations

import importlib
import pkgutil

from hybrid_build.core.errors import UserError

from . import inc_hybrid
from .base import OutputFormat

DEFAULT: str = inc_hybrid.FORMAT.name


def _discover() -> dict[str, OutputFormat]:
    found = [importlib.import_module(f"{__name__}.{m.name}").FORMAT
             for m in pkgutil.iter_modules(__path__) if m.name != "base"]
    found.sort(key=lambda f: f.name != DEFAULT)  # the default first, then in module order
    return {f.name: f for f in found}


REGISTRY: dict[str, OutputFormat] = _discover()


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> OutputFormat:
    """The format called ``name``; an unknown name is a one-line ``UserError`` listing the valid ones."""
    fmt = REGISTRY.get(name)
    if fmt is None:
        raise UserError(f"unknown output format {name!r} (valid: {', '.join(REGISTRY)})")
    return fmt


def choices_help() -> str:
    """One line per format for ``--help``: ``name: description``."""
    return "; ".join(f"{f.name}: {f.description}" for f in REGISTRY.values())
