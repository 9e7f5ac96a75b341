"""hybrid-build's pipeline: CLI, checkpoint reading, safetensors I/O, stages, manifests, publish."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hybrid-build")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
