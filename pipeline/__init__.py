"""hybrid-build's top floor: the CLI, the build (stages, runner, manifests), publish and the model card."""

__all__ = ["__version__"]


def __getattr__(name: str):
    if name == "__version__":  # read on first use (``hybrid_build.core``)
        from hybrid_build.core import __version__

        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
