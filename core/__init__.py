"""hybrid-build's ground floor: errors, checkpoint reading, safetensors I/O, reading tensors back
and dequantizing them (``weights``), tensor classes, the source's identity, manifests, the
artifact folder's contract, the output formats (``formats/``) and what every command shares (CLI
support, progress, signals, secrets). Every other folder may import it; it imports only
``calibration`` (pure tensor transforms)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hybrid-build")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
