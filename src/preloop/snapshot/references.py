"""Which shared object-cache entries the run repositories still borrow objects from.

A run repository (published `snapshots/<run_id>` or a capture in progress under
`snapshots/.staging/<run_id>-<nonce>`, whose run repository may sit one level
down in `repository.git`) shares its objects with a cache entry `<key>.git`
through `objects/info/alternates`. Evicting a referenced entry breaks every such
repository, so this scan is **fail closed**: anything that cannot be read raises
`CacheReferenceError` instead of silently yielding "no reference". Only a path
that is proven absent (ENOENT) counts as "no reference".
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from preloop.errors import PreloopError
from preloop.snapshot import layout

__all__ = [
    "CacheReferenceError",
    "CacheReferences",
    "parse_alternates",
    "snapshot_object_cache_references",
]

_ALTERNATES = os.path.join("objects", "info", "alternates")


class CacheReferenceError(PreloopError):
    """The reference scan could not prove which cache entries are unreferenced;
    eviction is aborted and nothing is removed."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(
            f"cannot read {self.path}: {reason}; the snapshot object-cache prune removed "
            "nothing (it never guesses that an entry is unused): fix the permissions or "
            "remove the broken snapshot, then run `preloop cache prune` again"
        )


@dataclass(frozen=True, slots=True)
class CacheReferences:
    """Cache keys referenced by run repositories: key -> the referring repositories,
    as paths relative to `snapshots/` (e.g. `run-1`, `.staging/run-2-0a1b2c3d/repository.git`)."""

    by_key: dict[str, tuple[str, ...]]

    def referrers(self, key: str) -> tuple[str, ...]:
        return self.by_key.get(key, ())

    def __contains__(self, key: object) -> bool:
        return key in self.by_key


_C_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
}


def _unquote_c_style(quoted: str) -> str | None:
    """Git's `unquote_c_style` for a line starting with `"`; None when malformed."""
    out: list[str] = []
    raw = bytearray()
    i = 1
    n = len(quoted)

    def flush() -> None:
        if raw:
            out.append(os.fsdecode(bytes(raw)))
            raw.clear()

    while i < n:
        ch = quoted[i]
        if ch == '"':
            flush()
            return "".join(out) if quoted[i + 1 :].strip() == "" else None
        if ch != "\\":
            flush()
            out.append(ch)
            i += 1
            continue
        i += 1
        if i >= n:
            return None
        esc = quoted[i]
        if esc in _C_ESCAPES:
            flush()
            out.append(_C_ESCAPES[esc])
            i += 1
        elif esc in "0123":
            digits = quoted[i : i + 3]
            if len(digits) != 3 or any(d not in "01234567" for d in digits):
                return None
            raw.append(int(digits, 8))  # octal escapes are raw bytes of a multi-byte name
            i += 3
        else:
            return None
    return None  # no closing quote


def parse_alternates(content: bytes, alternates_file: str | os.PathLike[str]) -> list[str]:
    """The object directories named by an `objects/info/alternates` file, as git
    reads it: one path per line, `#` comments and blank lines skipped, C-quoted
    lines unquoted, relative paths taken from the repository's `objects/`.
    A line git could not read raises `CacheReferenceError`."""
    objects_dir = os.path.dirname(os.path.dirname(os.fspath(alternates_file)))
    paths: list[str] = []
    for number, raw_line in enumerate(content.split(b"\n"), start=1):
        line = os.fsdecode(raw_line.rstrip(b"\r"))
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith('"'):
            unquoted = _unquote_c_style(line)
            if unquoted is None:
                raise CacheReferenceError(
                    alternates_file, f"line {number} is not a valid quoted path: {line!r}"
                )
            line = unquoted
        if "\0" in line:
            raise CacheReferenceError(alternates_file, f"line {number} contains a NUL byte")
        paths.append(os.path.join(objects_dir, line))
    return paths


def _real_target(path: str, alternates_file: str, number_hint: str) -> str:
    """The real path of an alternates target. A missing tail is resolved
    lexically (it cannot name an existing entry, but a symlinked parent still
    resolves); any other lookup error makes the line unreadable."""
    try:
        return os.path.realpath(path, strict=True)
    except FileNotFoundError:
        return os.path.realpath(path)
    except OSError as exc:
        raise CacheReferenceError(
            alternates_file,
            f"cannot resolve alternates target {number_hint}: {exc.strerror or exc}",
        ) from None


def _read_alternates(repo: str) -> bytes | None:
    """The repository's alternates file, or None when it is absent (ENOENT only)."""
    path = os.path.join(repo, _ALTERNATES)
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CacheReferenceError(path, exc.strerror or str(exc)) from None


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # follows a symlinked run directory; ENOENT -> False
    except OSError as exc:
        raise CacheReferenceError(entry.path, exc.strerror or str(exc)) from None


def _list_dir(path: str) -> list[os.DirEntry[str]] | None:
    """Every entry of `path`, or None when it does not exist. A listing that fails
    part-way raises: a partial listing would hide references."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise CacheReferenceError(path, "is not a directory") from None
        raise CacheReferenceError(path, exc.strerror or str(exc)) from None


def _with_nested(entry: os.DirEntry[str], rel: str) -> list[tuple[str, str]]:
    nested = layout.STAGING_REPOSITORY_NAME
    return [(entry.path, rel), (os.path.join(entry.path, nested), f"{rel}/{nested}")]


def _staging_repositories(state_dir: Path) -> list[tuple[str, str]]:
    staged = _list_dir(os.fspath(layout.staging_dir(state_dir)))
    found: list[tuple[str, str]] = []
    for child in staged or ():
        if _is_dir(child):  # owner markers are plain files
            found += _with_nested(child, f"{layout.STAGING_DIR_NAME}/{child.name}")
    return found


def _published_repositories(state_dir: Path) -> list[tuple[str, str]]:
    top = _list_dir(os.fspath(layout.snapshots_dir(state_dir)))
    found: list[tuple[str, str]] = []
    for entry in top or ():
        if entry.name != layout.STAGING_DIR_NAME and _is_dir(entry):
            found += _with_nested(entry, entry.name)
    return found


def _lazy_chain(state_dir: Path) -> Iterator[tuple[str, str]]:
    yield from _staging_repositories(state_dir)
    yield from _published_repositories(state_dir)


def snapshot_object_cache_references(state_dir: Path) -> CacheReferences:
    """Scans every run repository's alternates and maps each referenced cache
    key to its referrers. Targets are compared by real path, so a symlinked
    state directory or a relative alternates line still matches. Raises
    `CacheReferenceError` on any unreadable directory, file or line."""
    real_cache = os.path.realpath(layout.cache_dir(state_dir))
    by_key: dict[str, list[str]] = {}
    # Repositories only ever move from staging to published (publication is a
    # rename), so reading staging completely before listing the published
    # directory cannot miss one that is being published during the scan.
    for repo, rel in _lazy_chain(state_dir):
        content = _read_alternates(repo)
        if content is None:
            continue
        alternates_file = os.path.join(repo, _ALTERNATES)
        for i, target in enumerate(parse_alternates(content, alternates_file), start=1):
            real = _real_target(target, alternates_file, f"#{i} ({target})")
            inside = os.path.relpath(real, real_cache)
            if inside == os.curdir or inside.startswith(os.pardir):
                continue
            parsed = layout.parse_cache_entry_name(inside.split(os.sep, 1)[0])
            if parsed is None or parsed.kind != "git":
                continue
            referrers = by_key.setdefault(parsed.key, [])
            if rel not in referrers:
                referrers.append(rel)
    return CacheReferences({k: tuple(v) for k, v in by_key.items()})
