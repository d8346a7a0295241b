"""preloop: run GitHub Actions workflows against a snapshot of your workspace."""

from typing import Any

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:
    # Resolved on first use: importlib.metadata costs ~90 ms of start-up, which
    # every `preloop` command would otherwise pay.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("preloop")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0.0.0"
    raise AttributeError(f"module 'preloop' has no attribute {name!r}")
