"""hybrid-build's ground floor: errors, checkpoint reading, safetensors I/O, tensor classes, the
source's identity, manifests and the artifact folder's contract. Every other folder may import it;
it imports only ``calibration`` (pure tensor transforms)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hybrid-build")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
