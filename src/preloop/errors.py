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


__all__ += ["CoordinationError", "FingerprintRootError", "TreeChangedWhileHashing"]


class FingerprintRootError(PreloopError):
    """A fingerprint root is missing, or lies inside another root; nothing was hashed."""

    exit_code = 2

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class TreeChangedWhileHashing(PreloopError):
    """A file changed between the lstat before and the lstat after it was hashed.

    `before` and `after` hold the compared fields (type, dev, ino, size, mode,
    mtime_ns, ctime_ns); `after` is None when the entry disappeared.
    """

    def __init__(
        self, path: str, before: dict[str, int | str], after: dict[str, int | str] | None
    ) -> None:
        def show(values: dict[str, int | str] | None) -> str:
            if values is None:
                return "gone"
            return " ".join(f"{k}={v}" for k, v in values.items())

        super().__init__(
            f"{path} changed while it was being fingerprinted "
            f"(before: {show(before)}; after: {show(after)}); "
            "fingerprint again once nothing writes to it"
        )
        self.path = path
        self.before = before
        self.after = after


class CoordinationError(PreloopError):
    """The host coordination directory or one of its slot files cannot be used.

    Raised instead of bypassing the host cap: the message names the path and the
    sharing mode it needs.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path
