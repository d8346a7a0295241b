"""One exception hierarchy. Every message names the path, run or job it is about.

`PreloopError` and its subclasses are user-facing: the CLI prints `str(error)`
as one line and exits with `exit_code`, never a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "PreloopError", "UsageError"]


class PreloopError(Exception):
    """Base of every error preloop reports to a user."""

    exit_code: int = 1


class UsageError(PreloopError):
    """The command line or its arguments are wrong; nothing was done."""

    exit_code = 2


class ConfigError(PreloopError):
    """A `PRELOOP_*` environment variable holds a value that cannot be used."""

    exit_code = 2
