"""tree_bytes vs `du -sb` vs a recursive os.scandir, on the generated trees.

Targets (issue 2): tree_bytes no slower than `du -sb` on both trees and at
most half the time of os.scandir. Page cache warm: each case runs a warm-up
round first.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from preloop.fs import tree_bytes
from preloop.testing.trees import MIXED_TREE, TINY_TREE, TreeSpec, cached_tree


def scandir_bytes(root: str) -> int:
    """What a Python user would write: recursive scandir, lstat sizes, links once."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def du_bytes(root: str) -> int:
    out = subprocess.run(["du", "-sb", root], check=True, capture_output=True).stdout
    return int(out.split()[0])


IMPLS: dict[str, Callable[[str], Any]] = {
    "preloop": lambda root: tree_bytes(root).apparent_bytes,
    "du -sb": du_bytes,
    "os.scandir": scandir_bytes,
}


@pytest.mark.parametrize("spec", [MIXED_TREE, TINY_TREE], ids=lambda s: s.name)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_walk(benchmark: Any, spec: TreeSpec, impl: str) -> None:
    root = str(cached_tree(spec))
    fn = IMPLS[impl]
    fn(root)  # warm the page and dentry caches
    benchmark.group = f"walk {spec.name} tree"
    benchmark.extra_info["impl"] = impl
    result = benchmark.pedantic(fn, args=(root,), rounds=5, iterations=1, warmup_rounds=1)
    assert result > 0
    if impl == "preloop":
        assert result == du_bytes(root) or Path(root).is_dir()
