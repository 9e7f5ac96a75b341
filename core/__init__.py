"""hybrid-build's ground floor: errors, checkpoint reading, safetensors I/O, reading tensors back
and dequantizing them (``weights``), tensor classes, the source's identity, manifests, the
artifact folder's contract, the output formats (``formats/``) and what every command shares (CLI
support, progress, signals, secrets). Every other folder may import it; it imports only
``calibration`` (pure tensor transforms).

``__version__`` is read from the installed metadata on first use: importlib.metadata costs more
than the rest of ``hybrid-build --help``."""
import functools

__all__ = ["__version__"]


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybrid-build")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
