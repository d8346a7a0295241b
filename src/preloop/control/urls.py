"""Store URLs as users type them: checked before anything is created.

`check_store_url(url, origin)` accepts `postgresql://...` / `postgres://...`
and `sqlite:///path` whose directory exists (or is the state directory).
Anything else (`postgres//x`, a `sqlite:///missing/dir/x.db`, a bare path)
is a `UsageError` naming the URL, where it came from (`--store` or
`PRELOOP_STORE_URL`) and what to write, so a typo never creates files.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from preloop.errors import UsageError

__all__ = ["check_store_url"]

_SCHEMES = ("postgresql://", "postgres://", "sqlite:///")


def check_store_url(url: str, origin: str, state_dir: Path | None = None) -> str:
    """`url` unchanged when it is a usable store URL (see the module docstring).
    A database directly in `state_dir` is fine before that directory exists:
    preloop creates its state directory itself."""
    if url.startswith(("postgresql://", "postgres://")):
        if len(url.split("://", 1)[1].strip("/")) == 0:
            raise UsageError(f"{origin} {url!r}: the PostgreSQL URL names no server")
        return url
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite://") :])
        if path.is_dir():
            raise UsageError(f"{origin} {url!r}: {path} is a directory, not a database file")
        own = state_dir is not None and _same(path.parent, Path(state_dir).absolute())
        if not path.parent.is_dir() and not own:
            raise UsageError(
                f"{origin} {url!r}: directory {path.parent} does not exist (create it first)"
            )
        return url
    hint = f" (did you mean {near}?)" if (near := _corrected(url)) else ""
    raise UsageError(
        f"{origin} {url!r} is not a store URL: use postgresql://USER@HOST/DB or "
        f"sqlite:///PATH{hint}"
    )


def _corrected(url: str) -> str | None:
    """The URL a typo most likely meant: the nearest scheme with its own
    separator, then the rest (`postgres//x` -> `postgres://x`), or None."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)[:/]*(.*)", url, re.DOTALL)
    if m is None:
        return None
    names = {scheme.split(":", 1)[0]: scheme for scheme in _SCHEMES}
    near = difflib.get_close_matches(m.group(1).lower(), list(names), n=1)
    if not near:
        return None
    return names[near[0]] + m.group(2).lstrip("/")


def _same(a: Path, b: Path) -> bool:
    # `sqlite:////abs` leaves `//abs`, which POSIX paths keep apart from `/abs`.
    return "/" + str(a).lstrip("/") == "/" + str(b).lstrip("/")
