"""The output formats: one module each in this package, found by the registry here.

A format module defines ``FORMAT``, an ``OutputFormat`` (``base.py``) that says what the converted
tensors look like, the ``quantization_config``, how validate reads them back and what the card
says. Every module of this package but ``base`` is one; adding a format is adding a module. Code
outside this package asks ``get(name)`` for the object and never compares format names, nor the
head storage strings (``base.HEAD_STORED`` / ``HEAD_AT_LOAD``, the artifact's ``AT_LOAD_LABEL``):
the format answers ``stores_head`` and ``head_label_for``, this registry ``head_quantized_at_load``
and ``head_stored`` for an artifact's label.
"""
from __future__ import annotations

import importlib
import pkgutil

from hybrid_build.core.errors import UserError

from . import inc_hybrid
from .base import AT_LOAD_LABEL, OutputFormat

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


def head_quantized_at_load(label: str | None) -> bool:
    """An artifact's ``hybrid_build.lm_head`` says its head was left BF16 for the server to quantize."""
    return label == AT_LOAD_LABEL


def head_stored(label: str | None) -> bool:
    """An artifact's ``hybrid_build.lm_head`` says it stores an int8 head (in some format's layout)."""
    return any(label == f.head_label for f in REGISTRY.values())
