"""Real snapshot object-cache entries and run repositories for tests and benchmarks.

Entries are real bare repositories (`git init --bare`) holding real blobs, laid
out as `preloop.snapshot.layout` says; run repositories borrow from them through
`objects/info/alternates`, as a capture would write it.
"""

from __future__ import annotations

import os
import random
import subprocess
import zlib
from pathlib import Path

from preloop.snapshot import layout

__all__ = [
    "add_blob",
    "make_cache_entry",
    "make_run_repository",
    "set_last_use",
]

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "preloop-test",
    "GIT_AUTHOR_EMAIL": "test@preloop.invalid",
    "GIT_COMMITTER_NAME": "preloop-test",
    "GIT_COMMITTER_EMAIL": "test@preloop.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}


def _git(*args: str | os.PathLike[str], stdin: bytes | None = None) -> str:
    done = subprocess.run(
        ["git", *(os.fspath(a) for a in args)],
        input=stdin,
        capture_output=True,
        check=True,
        env={**os.environ, **_GIT_ENV},
    )
    return done.stdout.decode().strip()


def add_blob(repo: Path, size: int, seed: int) -> str:
    """Writes a blob of `size` incompressible bytes into `repo`; its id."""
    data = random.Random(seed).randbytes(size)
    return _git("-C", repo, "hash-object", "-w", "--stdin", stdin=data)


def make_cache_entry(
    state_dir: Path,
    name: str,
    *,
    payload: int = 0,
    index: int = 0,
    last_head: bool = True,
    last_use: float | None = None,
) -> str:
    """Creates the cache entry `name`: a bare `<key>.git` with a commit (on
    `refs/heads/main`) whose tree holds one blob of `payload` random bytes, a
    `.last-head` sidecar naming that commit and, if `index` > 0, an `.index`
    sidecar of that many bytes. Returns the key."""
    key = layout.cache_key(f"test:{name}", name)
    repo = layout.cache_repository(state_dir, key)
    repo.parent.mkdir(parents=True, exist_ok=True)
    _git("init", "-q", "--bare", repo)
    blob = add_blob(repo, payload, zlib.crc32(name.encode()))
    tree = _git("-C", repo, "mktree", stdin=f"100644 blob {blob}\tpayload-{name}\n".encode())
    commit = _git("-C", repo, "commit-tree", tree, "-m", f"entry {name}")
    _git("-C", repo, "update-ref", "refs/heads/main", commit)
    if last_head:
        layout.cache_last_head_path(state_dir, key).write_text(commit + "\n")
    if index:
        layout.cache_index_path(state_dir, key).write_bytes(random.Random(name).randbytes(index))
    if last_use is not None:
        set_last_use(state_dir, key, last_use)
    return key


def set_last_use(state_dir: Path, key: str, when: float) -> None:
    """Sets every last-use marker of the entry (see `preloop.snapshot.prune`) to `when`."""
    repo = layout.cache_repository(state_dir, key)
    for path in (
        repo,
        layout.cache_last_head_path(state_dir, key),
        layout.cache_index_path(state_dir, key),
    ):
        if os.path.lexists(path):
            os.utime(path, (when, when), follow_symlinks=False)


def make_run_repository(
    repo: Path, cache_repo: Path, *, relative: bool = False, quoted: bool = False
) -> str:
    """A bare run repository at `repo` borrowing `cache_repo`'s objects through
    `objects/info/alternates` (written relative to `objects/` or C-quoted when
    asked), with `refs/heads/snapshot` at the cache's `main`. Returns that commit."""
    repo.parent.mkdir(parents=True, exist_ok=True)
    _git("init", "-q", "--bare", repo)
    target = os.path.realpath(cache_repo / "objects")
    line = os.path.relpath(target, repo / "objects") if relative else target
    if quoted:
        line = '"' + line.replace("\\", "\\\\").replace('"', '\\"') + '"'
    (repo / "objects" / "info" / "alternates").write_text(line + "\n")
    commit = _git("-C", cache_repo, "rev-parse", "refs/heads/main")
    _git("-C", repo, "update-ref", "refs/heads/snapshot", commit)
    return commit
