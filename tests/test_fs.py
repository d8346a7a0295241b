"""tree_bytes against `du` on awkward trees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from preloop.fs import TreeSize, tree_bytes, write_text_atomic
from preloop.testing.trees import TreeSpec, make_tree


def du(path: Path, *args: str) -> int:
    out = subprocess.run(
        ["du", "-s", *args, "--", os.fsencode(path)], check=True, capture_output=True
    ).stdout
    return int(out.split(b"\t", 1)[0])


def assert_matches_du(path: Path, *, one_file_system: bool = True) -> TreeSize:
    size = tree_bytes(path, one_file_system=one_file_system)
    xdev = ("-x",) if one_file_system else ()
    assert size.apparent_bytes == du(path, "-b", *xdev)
    assert size.allocated_bytes == du(path, "--block-size=1", *xdev)
    return size


def test_generated_tree_matches_du(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "t", TreeSpec("small", 500, 40, 0, 9000, 2, 70_000, 200_000))
    size = assert_matches_du(root)
    assert size.files == 502
    assert size.dirs == 41


def test_hard_links_counted_once(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "sub").mkdir()
    os.link(tmp_path / "a", tmp_path / "sub" / "c")
    size = assert_matches_du(tmp_path)
    assert size.files == 1


def test_symlinks_never_followed(tmp_path: Path) -> None:
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "f").write_bytes(b"y" * 50_000)
    (tmp_path / "to_file").symlink_to(tmp_path / "big" / "f")
    (tmp_path / "to_dir").symlink_to(tmp_path / "big")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    (tmp_path / "self").symlink_to(".")
    size = assert_matches_du(tmp_path)
    assert size.symlinks == 6
    assert size.files == 1


def test_root_symlink_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"z" * 5000)
    (tmp_path / "link").symlink_to(tmp_path / "d")
    size = tree_bytes(tmp_path / "link")
    assert (size.symlinks, size.files, size.dirs) == (1, 0, 0)


def test_single_file_root(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"q" * 12345)
    size = assert_matches_du(tmp_path / "f")
    assert (size.files, size.dirs, size.apparent_bytes) == (1, 0, 12345)


def test_sparse_files_and_empty_dirs(tmp_path: Path) -> None:
    with open(tmp_path / "sparse", "wb") as fh:
        fh.seek(64 * 1024 * 1024)
        fh.write(b"end")
    for i in range(20):
        (tmp_path / f"empty{i}").mkdir()
    size = assert_matches_du(tmp_path)
    assert size.apparent_bytes > size.allocated_bytes


def test_awkward_names(tmp_path: Path) -> None:
    base = os.fsencode(tmp_path)
    for name in [b"new\nline", b"\xff\xfe invalid utf8", b"tab\tand space", b"-dash", b"..."]:
        with open(os.path.join(base, name), "wb") as fh:
            fh.write(name * 100)
    os.mkdir(os.path.join(base, b"dir\n\xff"))
    with open(os.path.join(base, b"dir\n\xff", b"inner\xfe"), "wb") as fh:
        fh.write(b"inner")
    size = assert_matches_du(tmp_path)
    assert size.files == 6
    # bytes paths are accepted too
    assert tree_bytes(base.decode("utf-8", "surrogateescape")) == size


def _make_chain(root: Path, depth: int) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            os.mkdir("d", dir_fd=fd)
            if i % 1000 == 0:
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "wb") as fh:
                    fh.write(b"x" * i)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def _flatten_chain(root: Path) -> None:
    """Moves every level of a `d/d/d/...` chain up to `root`, so removal is shallow
    (`rm -rf` on the deep chain itself is quadratic and takes half a minute)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        current, i = "d", 0
        while True:
            try:
                os.rename(f"{current}/d", f"flat{i}", src_dir_fd=fd, dst_dir_fd=fd)
            except FileNotFoundError:
                break
            current, i = f"flat{i}", i + 1
    finally:
        os.close(fd)


def test_ten_thousand_deep_nesting(tmp_path: Path) -> None:
    # 10,000 directories: on tmpfs when there is one, since creating and removing
    # them on a disk filesystem mounted with `discard` costs tens of seconds.
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    root = Path(tempfile.mkdtemp(prefix="preloop-deep-", dir=base))
    _make_chain(root, 10_000)
    try:
        size = assert_matches_du(root)
        assert size.dirs == 10_001
        assert size.files == 10
    finally:
        _flatten_chain(root)
        shutil.rmtree(root)


def test_deep_tree_with_branches_reopens_closed_ancestors(tmp_path: Path) -> None:
    """Siblings at every level of a 300-deep chain: ancestors whose descriptors
    were closed under the open-descriptor cap must be reopened by name."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(300):
            os.mkdir("a", dir_fd=fd)
            os.mkdir("b", dir_fd=fd)
            with open(os.open("b/f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "wb") as fh:
                fh.write(b"1234567")
            nfd = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    try:
        size = assert_matches_du(tmp_path)
        assert size.dirs == 601
        assert size.files == 300
    finally:
        subprocess.run(["rm", "-rf", "--", str(tmp_path / "a"), str(tmp_path / "b")], check=True)


def test_missing_root_names_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        tree_bytes(tmp_path / "nope")
    assert info.value.filename == str(tmp_path / "nope")


def test_permission_denied_names_exact_path(public_tmp: Path) -> None:
    locked = public_tmp / "outer" / "locked"
    locked.mkdir(parents=True)
    (locked / "secret").write_text("s")
    locked.chmod(0o000)
    code = (
        "import os, sys\n"
        "from preloop.fs import tree_bytes\n"  # import first: the interpreter lives under /root
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    tree_bytes({str(public_tmp)!r})\n"
        "except PermissionError as e:\n"
        "    print(e.filename); sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(locked)
    finally:
        locked.chmod(0o755)


def _try_mount_tmpfs(target: Path) -> bool:
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )
    return r.returncode == 0


def test_one_file_system_stops_at_mount_points(tmp_path: Path) -> None:
    (tmp_path / "here").write_bytes(b"h" * 3000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _try_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        (mnt / "there").write_bytes(b"t" * 100_000)
        inside = assert_matches_du(tmp_path, one_file_system=True)
        across = assert_matches_du(tmp_path, one_file_system=False)
        assert across.files == inside.files + 1
        assert across.dirs == inside.dirs + 1
        assert across.apparent_bytes >= inside.apparent_bytes + 100_000
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_an_atomic_write_leaves_the_old_file_or_the_new_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "note"
    write_text_atomic(target, "old\n")
    write_text_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    # A rename that cannot happen (the path is a non-empty directory): the
    # error is raised and no temporary file is left beside it.
    blocked = tmp_path / "dir"
    (blocked / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        write_text_atomic(blocked, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "note"]
