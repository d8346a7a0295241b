"""preloop: run GitHub Actions workflows against a snapshot of your workspace."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("preloop")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
