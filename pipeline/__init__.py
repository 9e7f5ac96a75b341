"""hybrid-build's top floor: the CLI, the build (stages, runner, manifests), publish and the model card."""
from hybrid_build.core import __version__

__all__ = ["__version__"]
