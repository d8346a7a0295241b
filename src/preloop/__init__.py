"""preloop: run GitHub Actions workflows against a snapshot of your workspace."""

__all__ = ["__version__", "version"]


def version() -> str:
    """The installed package's version, read without importing importlib.metadata
    (~60 ms of start-up) when the build wrote `preloop/_version.py`."""
    import importlib

    try:
        return str(importlib.import_module("preloop._version").__version__)
    except ImportError:  # a source tree run without a build: the installed metadata
        pass
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("preloop")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0"


def __getattr__(name: str) -> str:
    # Resolved on first use (typing is not imported here either: every `preloop`
    # command pays for what this module imports).
    if name == "__version__":
        return version()
    raise AttributeError(f"module 'preloop' has no attribute {name!r}")
