"""Deterministic generated trees for tests and benchmarks.

`TreeSpec` describes a tree by counts and size ranges; `make_tree` writes it
from a seeded PRNG, so the same spec always gives the same bytes. Benchmarks
use `cached_tree`, which builds a named tree once under a cache directory and
reuses it while its completion marker is present; `cached_repo` makes a
committed git repository of one, once, beside it.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MIXED_TREE", "TINY_TREE", "TreeSpec", "cached_repo", "cached_tree", "make_tree"]

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TreeSpec:
    """`files` small files of `small_min..small_max` bytes spread over `dirs`
    directories (nested up to `depth`), plus `large_files` of `large_min..large_max`."""

    name: str
    files: int
    dirs: int
    small_min: int
    small_max: int
    large_files: int = 0
    large_min: int = 0
    large_max: int = 0
    depth: int = 4
    seed: int = 20261129


# (a) ~60k files in ~3k dirs, mostly 1-8 KiB plus some 1-16 MiB files (~2 GB).
MIXED_TREE = TreeSpec("mixed", 60_000, 3_000, 1024, 8192, 200, 1 * MiB, 16 * MiB)
# (b) ~300k files of 0-512 B.
TINY_TREE = TreeSpec("tiny", 300_000, 3_000, 0, 512)


def _dir_paths(spec: TreeSpec, rng: random.Random) -> list[str]:
    paths = [""]
    for i in range(spec.dirs):
        parent = rng.choice(paths[-64:]) if len(paths) > 1 else ""
        if parent.count("/") + 1 >= spec.depth:
            parent = ""
        paths.append(f"{parent}/d{i:05d}" if parent else f"d{i:05d}")
    return paths


def make_tree(root: Path, spec: TreeSpec) -> Path:
    """Writes the tree for `spec` under `root` (created) and returns `root`."""
    rng = random.Random(spec.seed)
    root.mkdir(parents=True, exist_ok=True)
    dirs = _dir_paths(spec, rng)
    for d in dirs[1:]:
        (root / d).mkdir(parents=True, exist_ok=True)
    pool = rng.randbytes(max(spec.small_max, 1) * 4)
    for i in range(spec.files):
        d = dirs[rng.randrange(len(dirs))]
        size = rng.randint(spec.small_min, spec.small_max)
        start = rng.randrange(len(pool) - size + 1)
        name = f"f{i:06d}.txt" if i % 5 else f"f{i:06d}.bin"
        with open(os.path.join(root, d, name), "wb") as fh:
            fh.write(pool[start : start + size])
    for i in range(spec.large_files):
        d = dirs[rng.randrange(len(dirs))]
        size = rng.randint(spec.large_min, spec.large_max)
        with open(os.path.join(root, d, f"large{i:04d}.dat"), "wb") as fh:
            remaining = size
            while remaining:
                chunk = min(remaining, 4 * MiB)
                fh.write(rng.randbytes(chunk))
                remaining -= chunk
    return root


def cached_tree(spec: TreeSpec, cache_dir: Path | None = None) -> Path:
    """The tree for `spec`, built once under `cache_dir`
    (default `$PRELOOP_BENCH_TREES` or /var/tmp/preloop-bench-trees).

    Concurrent callers (several bench sessions) serialise on a flock, and a
    tree is only used once its completion marker exists, so an interrupted
    build is rebuilt rather than measured.
    """
    import fcntl

    base = cache_dir or Path(os.environ.get("PRELOOP_BENCH_TREES", "/var/tmp/preloop-bench-trees"))
    base.mkdir(parents=True, exist_ok=True)
    key = f"{spec.name}-{spec.files}-{spec.dirs}-{spec.large_files}-{spec.seed}"
    root = base / key
    marker = base / f"{key}.complete"
    with open(base / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and root.is_dir():
            return root
        if root.exists():
            shutil.rmtree(root)
        make_tree(root, spec)
        marker.write_text("complete\n")
    return root


#: The file `cached_repo` commits beside the tree, for benchmarks to edit.
MODIFIED_FILE = "bench-modified.txt"


def cached_repo(spec: TreeSpec, cache_dir: Path | None = None) -> Path:
    """A git repository (branch main) whose one commit holds `spec`'s tree and
    `MODIFIED_FILE`, built once beside `cached_tree`'s copy. Each call puts
    `MODIFIED_FILE` back as committed; other leftovers are the caller's."""
    import subprocess

    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "bench",
        "GIT_AUTHOR_EMAIL": "bench@example.com",
        "GIT_COMMITTER_NAME": "bench",
        "GIT_COMMITTER_EMAIL": "bench@example.com",
    }

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "gc.auto=0", *args], cwd=repo, check=True, env=env)

    tree = cached_tree(spec, cache_dir)
    repo = tree.with_name(tree.name + ".repo")
    ready = repo.with_name(repo.name + ".ready")
    if not ready.exists():
        if repo.exists():
            shutil.rmtree(repo)
        shutil.copytree(tree, repo)
        git("init", "-q", "-b", "main")
        (repo / MODIFIED_FILE).write_text("base\n")
        git("add", "-A")
        git("commit", "-q", "-m", "base")
        git("gc", "-q")
        ready.write_text("ready\n")
    git("checkout", "-q", "--", MODIFIED_FILE)
    return repo
