"""Every on-disk path of the snapshot subsystem (DESIGN.md section 3), as
functions of the state directory. Nothing else in preloop spells these paths.

```
<state>/snapshots/<run_id>/                    published run repository (bare, alternates -> cache)
<state>/snapshots/.staging/<run_id>-<nonce>/   capture in progress (may hold repository.git)
<state>/snapshots/.staging/<run_id>-<nonce>.owner   owner marker: pid + process start time
<state>/snapshot-object-cache/<key>.git        shared bare object cache, gc.auto=0
<state>/snapshot-object-cache/<key>.last-head  sidecar: HEAD last synced into the cache
<state>/snapshot-object-cache/<key>.index      sidecar: persisted index (stat reuse, `add -A`)
<state>/snapshot-object-cache/<key>.lock       per-entry flock (never unlinked)
<state>/snapshot-object-cache/<key>.pin-<id>   capture pin: the entry is in use
```

Owner markers: a capture writes `<run_id>-<nonce>.owner` *before* it creates its
staging directory and removes it *last*, after the capture was accepted or
cleaned up. So a staging directory without a marker, or a marker whose process
is gone, is a crash leftover; a run repository `snapshots/<run_id>` for which an
owner marker of a dead process exists was never accepted.

Cache keys are `<slug>-<16 hex digits of SHA-256(identity)>`: the slug (letters,
digits, `_`, `-`; at most 40 characters) is for humans, the digest makes the key
unique. A key never contains a dot, so `<key>.git`, `<key>.pin-<id>` and the
sidecars parse unambiguously (`parse_cache_entry_name`).

Post-capture hook: see `preloop.snapshot.hooks` (`register_after_capture`), called
after each successful capture, outside the cache lock.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from preloop.errors import UsageError

__all__ = [
    "CACHE_DIR_NAME",
    "SNAPSHOTS_DIR_NAME",
    "STAGING_DIR_NAME",
    "STAGING_REPOSITORY_NAME",
    "CacheEntryName",
    "StagingName",
    "cache_dir",
    "cache_index_path",
    "cache_key",
    "cache_key_for_repository",
    "cache_key_for_url",
    "cache_last_head_path",
    "cache_lock_path",
    "cache_pin_path",
    "cache_pin_prefix",
    "cache_repository",
    "cache_tmp_clone_path",
    "owner_marker_path",
    "parse_cache_entry_name",
    "parse_staging_name",
    "run_repository",
    "snapshots_dir",
    "staging_dir",
    "staging_path",
    "staging_repository",
    "strip_url_credentials",
    "validate_run_id",
]

SNAPSHOTS_DIR_NAME = "snapshots"
STAGING_DIR_NAME = ".staging"
CACHE_DIR_NAME = "snapshot-object-cache"
# A capture builds its run repository here inside its staging directory and
# publishes it by rename to `snapshots/<run_id>`.
STAGING_REPOSITORY_NAME = "repository.git"
OWNER_SUFFIX = ".owner"

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_KEY = re.compile(r"[A-Za-z0-9_-]{1,40}-[0-9a-f]{16}")
_NONCE = re.compile(r"[0-9a-f]{8,32}")


def validate_run_id(run_id: str) -> str:
    """Returns `run_id` if it is usable as a directory name: letters, digits,
    `_` and `-`, starting with a letter or digit, at most 128 characters."""
    if not _RUN_ID.fullmatch(run_id):
        raise UsageError(
            f"run id {run_id!r} is not valid: use 1-128 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


# --- snapshots -------------------------------------------------------------------


def snapshots_dir(state_dir: Path) -> Path:
    """`<state>/snapshots`: published run repositories."""
    return Path(state_dir) / SNAPSHOTS_DIR_NAME


def staging_dir(state_dir: Path) -> Path:
    """`<state>/snapshots/.staging`: captures in progress and their owner markers."""
    return snapshots_dir(state_dir) / STAGING_DIR_NAME


def run_repository(state_dir: Path, run_id: str) -> Path:
    """`<state>/snapshots/<run_id>`: the published bare run repository."""
    return snapshots_dir(state_dir) / validate_run_id(run_id)


def staging_path(state_dir: Path, run_id: str, nonce: str) -> Path:
    """`<state>/snapshots/.staging/<run_id>-<nonce>`: one capture's scratch directory."""
    if not _NONCE.fullmatch(nonce):
        raise ValueError(f"staging nonce must be 8-32 lowercase hex digits, got {nonce!r}")
    return staging_dir(state_dir) / f"{validate_run_id(run_id)}-{nonce}"


def staging_repository(staging: Path) -> Path:
    """The run repository being built inside a staging directory."""
    return staging / STAGING_REPOSITORY_NAME


def owner_marker_path(staging: Path) -> Path:
    """`<staging>.owner`: the marker naming the process that owns `staging`
    (and, until the capture is accepted, `snapshots/<run_id>`)."""
    return staging.with_name(staging.name + OWNER_SUFFIX)


@dataclass(frozen=True, slots=True)
class StagingName:
    """A parsed name in `snapshots/.staging`: `<run_id>-<nonce>[.owner]`."""

    run_id: str
    nonce: str
    is_owner_marker: bool

    @property
    def staging_name(self) -> str:
        return f"{self.run_id}-{self.nonce}"


def parse_staging_name(name: str) -> StagingName | None:
    """Parses an entry name of `snapshots/.staging`; None for foreign names."""
    is_marker = name.endswith(OWNER_SUFFIX)
    base = name[: -len(OWNER_SUFFIX)] if is_marker else name
    run_id, sep, nonce = base.rpartition("-")
    if not sep or not _RUN_ID.fullmatch(run_id) or not _NONCE.fullmatch(nonce):
        return None
    return StagingName(run_id, nonce, is_marker)


# --- object cache ----------------------------------------------------------------


def cache_dir(state_dir: Path) -> Path:
    """`<state>/snapshot-object-cache`."""
    return Path(state_dir) / CACHE_DIR_NAME


def _check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise ValueError(f"not a snapshot cache key: {key!r}")
    return key


def cache_repository(state_dir: Path, key: str) -> Path:
    """`<key>.git`: the shared bare object cache of one source."""
    return cache_dir(state_dir) / f"{_check_key(key)}.git"


def cache_last_head_path(state_dir: Path, key: str) -> Path:
    """`<key>.last-head`: the source HEAD last synced into the cache."""
    return cache_dir(state_dir) / f"{_check_key(key)}.last-head"


def cache_index_path(state_dir: Path, key: str) -> Path:
    """`<key>.index`: the persisted index reused by the next capture."""
    return cache_dir(state_dir) / f"{_check_key(key)}.index"


def cache_lock_path(state_dir: Path, key: str) -> Path:
    """`<key>.lock`: the per-entry flock file; it is never unlinked, so every
    process locks the same inode."""
    return cache_dir(state_dir) / f"{_check_key(key)}.lock"


def cache_pin_prefix(key: str) -> str:
    """`<key>.pin-`: every pin file of `key` starts with this name."""
    return f"{_check_key(key)}.pin-"


def cache_pin_path(state_dir: Path, key: str, pin_id: str) -> Path:
    """`<key>.pin-<id>`: one capture's pin on the entry."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", pin_id):
        raise ValueError(f"pin id must be 1-64 letters, digits, '_' or '-', got {pin_id!r}")
    return cache_dir(state_dir) / f"{cache_pin_prefix(key)}{pin_id}"


@dataclass(frozen=True, slots=True)
class CacheEntryName:
    """A parsed name in the cache directory: `key` and what the file is
    (`git`, `last-head`, `index`, `lock`, `pin`, or `tmp` for a clone in progress),
    plus the pin id for pins."""

    key: str
    kind: str
    pin_id: str | None = None


def parse_cache_entry_name(name: str) -> CacheEntryName | None:
    """Parses a name in `snapshot-object-cache/`; None for foreign names."""
    key, dot, rest = name.partition(".")
    if not dot or not _KEY.fullmatch(key):
        return None
    if rest in ("git", "last-head", "index", "lock"):
        return CacheEntryName(key, rest)
    if rest.startswith("pin-") and len(rest) > 4:
        return CacheEntryName(key, "pin", rest[4:])
    if rest.startswith("tmp-"):
        return CacheEntryName(key, "tmp")
    return None


def cache_tmp_clone_path(state_dir: Path, key: str, nonce: str) -> Path:
    """`<key>.tmp-<nonce>`: a first clone in progress, renamed to `<key>.git` when done."""
    return cache_dir(state_dir) / f"{_check_key(key)}.tmp-{nonce}"


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")[:40].strip("-")
    return slug or "repo"


def cache_key(identity: str, hint: str) -> str:
    """The cache key for a source identified by `identity`; `hint` gives the
    human-readable slug (e.g. the repository's directory name)."""
    digest = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{_slug(hint)}-{digest}"


def cache_key_for_repository(git_common_dir: Path) -> str:
    """The key of a local repository: its common git directory's real path, so
    every worktree of one repository shares one cache entry."""
    real = os.path.realpath(git_common_dir)
    top = Path(real)
    name = top.parent.name if top.name == ".git" else top.name.removesuffix(".git")
    return cache_key(f"path:{real}", name)


def strip_url_credentials(url: str) -> str:
    """`url` without user name and password (`https://user:tok@host/x` ->
    `https://host/x`). scp-like `user@host:path` keeps its user: it is not a secret."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def cache_key_for_url(url: str) -> str:
    """The key of a remote: its URL without credentials and trailing `/` or `.git`."""
    clean = strip_url_credentials(url).rstrip("/")
    base = clean.removesuffix(".git")
    name = re.split(r"[/:]", base)[-1] if base else "remote"
    return cache_key(f"url:{base}", name)
