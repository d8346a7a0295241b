"""`hashFiles(...)`: GitHub's algorithm over a workspace.

GitHub's docs ("hashFiles"): the patterns are relative to the workspace and
only files inside it count; each matched file gets its own SHA-256 digest, and
the result is the SHA-256 over those digests (raw bytes, in match order),
hex-encoded; no match gives ''. Globbing follows `@actions/glob`, which the
runner uses: `*` and `?` stay within a path segment, `**` spans segments,
dot-files match, a pattern that names a directory matches everything below
it, and a `!pattern` excludes what the patterns before it matched (the last
matching pattern decides). Matches are hashed in byte-wise path order so the
result does not depend on directory listing order.

Hashing uses the native SHA-256 (`preloop._native.Sha256`, hardware
accelerated where the CPU has it) when the extension provides it, else
`hashlib`; both give the same digests.
"""

from __future__ import annotations

import hashlib
import os
import re
from functools import lru_cache
from typing import Any

from preloop import _native

__all__ = ["hash_files", "match_files"]

_CHUNK = 1 << 20


@lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern[str]:
    out: list[str] = []
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                # `**/` matches zero or more whole directories; a trailing `**`
                # matches everything below.
                if pattern.startswith("**/", i):
                    out.append("(?:.*/)?")
                    i += 3
                    continue
                out.append(".*")
                i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 2)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j + 1
                continue
        else:
            out.append(re.escape(c))
        i += 1
    # Implicit descendants: a pattern naming a directory matches its contents.
    return re.compile("".join(out) + "(?:/.*)?", re.DOTALL)


def _normalise(pattern: str) -> tuple[bool, str] | None:
    p = pattern.strip()
    if not p or p.startswith("#"):
        return None
    negate = False
    while p.startswith("!"):
        negate = not negate
        p = p[1:]
    p = p.replace("\\", "/")
    while p.startswith("./"):
        p = p[2:]
    p = p.rstrip("/")
    return negate, p


def match_files(root: str, patterns: list[str]) -> list[str]:
    """Workspace-relative paths of the regular files the patterns select, sorted."""
    compiled: list[tuple[bool, re.Pattern[str]]] = []
    for raw in patterns:
        for line in raw.splitlines() or [raw]:
            norm = _normalise(line)
            if norm is None:
                continue
            negate, p = norm
            if os.path.isabs(p):
                rel = os.path.relpath(p, root)
                if rel.startswith(".."):
                    continue  # outside the workspace: GitHub ignores it
                p = rel.replace(os.sep, "/")
            compiled.append((negate, _compile(p)))
    if not compiled:
        return []
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        prefix = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        for name in filenames:
            rel = prefix + name
            included = False
            for negate, rx in compiled:
                if rx.fullmatch(rel):
                    included = not negate
            if included and os.path.isfile(os.path.join(dirpath, name)):
                found.append(rel)
    found.sort(key=lambda p: p.encode("utf-8", "surrogateescape"))
    return found


def _sha256() -> Any:
    native = getattr(_native, "Sha256", None)
    return native() if native is not None else hashlib.sha256()


def hash_files(root: str, patterns: list[str]) -> str:
    """GitHub's `hashFiles(patterns...)` over the workspace `root`."""
    files = match_files(root, patterns)
    if not files:
        return ""
    total = _sha256()
    for rel in files:
        h = _sha256()
        with open(os.path.join(root, rel), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        total.update(h.digest())
    return bytes(total.digest()).hex()
