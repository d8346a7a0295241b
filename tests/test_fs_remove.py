"""`remove_tree`: the native bottom-up unlinkat walk prune eviction uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from preloop.fs import remove_tree, tree_bytes
from preloop.testing.trees import TreeSpec, make_tree


def test_removes_a_generated_tree_and_counts_what_du_counted(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "t", TreeSpec("small", 2_000, 60, 0, 3000))
    before = tree_bytes(root)
    freed, error = remove_tree(root)
    assert error is None
    assert freed == before.allocated_bytes
    assert not root.exists()


def test_hard_links_count_once_and_symlinks_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"k" * 10_000)
    root = tmp_path / "t"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"x" * 50_000)
    os.link(root / "a" / "f", root / "a" / "b" / "again")
    (root / "a" / "to-outside").symlink_to(outside)
    (root / "a" / "b" / "to-kept").symlink_to(outside / "kept")
    before = tree_bytes(root)
    freed, error = remove_tree(root)
    assert error is None
    assert freed == before.allocated_bytes
    assert not root.exists()
    assert (outside / "kept").read_bytes() == b"k" * 10_000


def test_deep_tree_beyond_the_descriptor_cap(tmp_path: Path) -> None:
    root = tmp_path / "deep"
    path = root
    for i in range(300):
        path = path / "d"
        if i % 50 == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / "side").write_text("branch")
    path.mkdir(parents=True, exist_ok=True)
    (path / "leaf").write_text("bottom")
    before = tree_bytes(root)
    freed, error = remove_tree(root)
    assert error is None
    assert freed == before.allocated_bytes
    assert not root.exists()


def test_missing_path_and_single_file(tmp_path: Path) -> None:
    assert remove_tree(tmp_path / "missing") == (0, None)
    f = tmp_path / "f"
    f.write_bytes(b"y" * 9000)
    blocks = f.stat().st_blocks * 512
    assert remove_tree(f) == (blocks, None)
    assert not f.exists()


def test_a_root_symlink_is_removed_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "f").write_text("kept")
    link = tmp_path / "link"
    link.symlink_to(target)
    _, error = remove_tree(link)
    assert error is None
    assert not link.is_symlink()
    assert (target / "f").read_text() == "kept"


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_an_unremovable_entry_is_named_and_the_rest_is_removed(public_tmp: Path) -> None:
    root = public_tmp / "t"
    (root / "locked").mkdir(parents=True)
    (root / "locked" / "stuck").write_text("cannot go")
    (root / "free").mkdir()
    (root / "free" / "f").write_bytes(b"z" * 20_000)
    (root / "g").write_text("goes")
    for path in (root, root / "free"):
        path.chmod(0o777)
    (root / "free" / "f").chmod(0o666)
    (root / "g").chmod(0o666)
    (root / "locked").chmod(0o755)  # owned by root: nobody cannot unlink inside it
    code = (
        "import sys; from preloop.fs import remove_tree; "
        "freed, err = remove_tree(sys.argv[1]); "
        "print(freed, err.errno, err.filename)"
    )
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", code, str(root)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    freed, errno_, filename = r.stdout.split()
    assert int(errno_) == 13  # EACCES
    assert filename == str(root / "locked" / "stuck")
    assert int(freed) > 0
    assert sorted(p.name for p in root.iterdir()) == ["locked"]
    assert (root / "locked" / "stuck").read_text() == "cannot go"
