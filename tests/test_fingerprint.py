"""Native fingerprints: format v1, stability, roots, the slot the walk takes, the CLI."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from preloop import _native
from preloop.cli import cli
from preloop.fingerprint import (
    FingerprintRootError,
    HostSlots,
    TreeChangedWhileHashing,
    fingerprint,
)


@pytest.fixture(autouse=True)
def coordination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "coordination"
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(directory))
    yield directory
    _native.set_test_hooks()


def build(root: Path, order: list[str] | None = None) -> Path:
    """A small tree with every kind fingerprints distinguish, created in `order`."""
    items = {
        "a.txt": b"alpha\n",
        "a-b.txt": b"dash sorts before slash\n",
        "a/inner.txt": b"inner\n",
        "a/deeper/z.bin": bytes(range(256)) * 40,
        "run.sh": b"#!/bin/sh\necho hi\n",
        "empty": b"",
    }
    root.mkdir(parents=True)
    for name in order or list(items):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(items[name])
    (root / "run.sh").chmod(0o755)
    (root / "link").symlink_to("a.txt")
    (root / "empty-dir").mkdir()
    return root


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def kind_of(st: os.stat_result) -> bytes:
    if stat.S_ISDIR(st.st_mode):
        return b"dir"
    if stat.S_ISLNK(st.st_mode):
        return b"symlink"
    return b"file"


def reference_digest(root: Path, mode: str) -> str:
    """Recomputes a root's digest from the README's description of format v1."""
    import hashlib

    entries: list[tuple[bytes, os.stat_result]] = []

    def collect(directory: bytes, rel: bytes) -> None:
        for name in os.listdir(directory):
            st = os.lstat(os.path.join(directory, name))
            path = rel + name
            entries.append((path, st))
            if stat.S_ISDIR(st.st_mode):
                collect(os.path.join(directory, name), path + b"/")

    base = os.fsencode(root)
    collect(base, b"")
    entries.sort(key=lambda e: e[0] + b"/" if stat.S_ISDIR(e[1].st_mode) else e[0])
    h = hashlib.sha256(
        b"preloop/tree-digest/v1\0" if mode == "content" else b"preloop/tree-metadata/v1\0"
    )
    for rel, st in entries:
        h.update(frame(kind_of(st)) + frame(rel))
        if mode == "metadata":
            h.update(frame(st.st_mode.to_bytes(8, "big")))
            h.update(frame(st.st_size.to_bytes(8, "big")))
            h.update(frame(st.st_mtime_ns.to_bytes(8, "big")))
        elif stat.S_ISREG(st.st_mode):
            data = Path(os.fsdecode(base + b"/" + rel)).read_bytes()
            h.update(frame(b"\x01" if st.st_mode & stat.S_IXUSR else b"\x00"))
            h.update(frame(len(data).to_bytes(8, "big")))
            h.update(frame(hashlib.sha256(data).digest()))
        elif stat.S_ISLNK(st.st_mode):
            h.update(frame(os.readlink(base + b"/" + rel)))
    return h.hexdigest()


def combined(*root_digests: str) -> str:
    import hashlib

    h = hashlib.sha256(b"preloop/roots-digest/v1\0")
    for d in root_digests:
        h.update(frame(bytes.fromhex(d)))
    return h.hexdigest()


@pytest.mark.parametrize("mode", ["content", "metadata"])
def test_digest_matches_the_documented_format(tmp_path: Path, mode: str) -> None:
    root = build(tmp_path / "tree")
    result = fingerprint(root, mode=mode)  # type: ignore[arg-type]
    expected = reference_digest(root, mode)
    assert result.roots == {str(root): expected}
    assert result.digest == combined(expected)
    assert result.files == 6
    assert result.bytes == sum(
        p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    )


def test_two_roots_are_combined_in_byte_order(tmp_path: Path) -> None:
    one = build(tmp_path / "b-one")
    two = build(tmp_path / "a-two")
    result = fingerprint([one, two, one])
    assert list(result.roots) == [str(two), str(one)]
    assert result.digest == combined(*result.roots.values())


def test_stable_across_runs_and_listing_order(tmp_path: Path) -> None:
    first = build(tmp_path / "x")
    order = ["empty", "run.sh", "a/deeper/z.bin", "a/inner.txt", "a-b.txt", "a.txt"]
    second = build(tmp_path / "y", order)
    d1 = fingerprint(first).roots[str(first)]
    assert fingerprint(first).roots[str(first)] == d1
    assert fingerprint(second).roots[str(second)] == d1


def digest_of(root: Path, mode: str = "content") -> str:
    return fingerprint(root, mode=mode).digest  # type: ignore[arg-type]


def test_content_digest_changes_on_content_exec_bit_rename_and_retarget(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    seen = {digest_of(root)}

    (root / "a.txt").write_bytes(b"alphA\n")
    seen.add(digest_of(root))
    (root / "a.txt").chmod(0o744)
    seen.add(digest_of(root))
    (root / "a.txt").rename(root / "a2.txt")
    seen.add(digest_of(root))
    (root / "link").unlink()
    (root / "link").symlink_to("a2.txt")
    seen.add(digest_of(root))
    assert len(seen) == 5


def test_touch_changes_metadata_digest_only(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    content, metadata = digest_of(root), digest_of(root, "metadata")
    st = (root / "a.txt").stat()
    os.utime(root / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert digest_of(root) == content
    assert digest_of(root, "metadata") != metadata


def test_metadata_mode_reads_no_file(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    secret = root / "a.txt"
    secret.chmod(0o000)
    try:
        if os.access(secret, os.R_OK):  # root reads anything: check via the hook instead
            read: list[str] = []
            _native.set_test_hooks(after_read=read.append)
            fingerprint(root, mode="metadata")
            assert read == []
        else:
            fingerprint(root, mode="metadata")
            with pytest.raises(PermissionError):
                fingerprint(root)
    finally:
        secret.chmod(0o644)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda p: p.write_bytes(b"grown while hashed\n"), "size="),
        (lambda p: os.utime(p, ns=(0, 123_456_789)), "mtime_ns=123456789"),
        (lambda p: p.chmod(0o600), "mode="),
        (lambda p: p.unlink(), "after: gone"),
    ],
)
def test_change_between_read_and_restat_raises(tmp_path: Path, change: object, field: str) -> None:
    root = build(tmp_path / "t")
    target = root / "a" / "inner.txt"

    def after_read(path: str) -> None:
        if path == str(target):
            change(target)  # type: ignore[operator]

    # Every directory counts as changed lately: files are lstat'ed at the listing.
    _native.set_test_hooks(after_read=after_read, recent_ns=10**18)
    with pytest.raises(TreeChangedWhileHashing) as caught:
        fingerprint(root)
    assert caught.value.path == str(target)
    assert str(target) in str(caught.value)
    assert "before: type=f" in str(caught.value)
    assert field in str(caught.value)
    _native.set_test_hooks()
    fingerprint(root)  # the walk released its slot and buffer: the next one runs


def lazy_listing(recent_ns: int) -> None:
    """Directories changed before `recent_ns` ago list their regular files without
    lstat (checked on the descriptor after the read); 0: anything before the listing,
    negative: everything, however fresh, counts as old."""
    _native.set_test_hooks(recent_ns=recent_ns)


def test_lazy_listed_files_give_the_same_digest_with_one_read_each(tmp_path: Path) -> None:
    root = settled(build(tmp_path / "t"))
    reads: list[str] = []
    _native.set_test_hooks(after_read=reads.append, recent_ns=-3600 * 10**9)
    assert fingerprint(root).roots[str(root)] == reference_digest(root, "content")
    assert sorted(reads) == sorted(
        str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    )


def settled(root: Path) -> Path:
    """Returns once the walk's clock (CLOCK_REALTIME_COARSE, which also stamps
    ctimes) has passed every ctime in the tree, so a listing made now finds the
    tree old and a change made later new; skips unless the filesystem is one
    whose listings can be lazy (fingerprint.c)."""
    import subprocess
    import time

    fs_type = subprocess.run(
        ["stat", "-f", "-c", "%t", str(root)], capture_output=True, text=True, check=True
    ).stdout.strip()
    if int(fs_type, 16) not in (0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0xF2F52010):
        pytest.skip(f"{root} is on a filesystem (type {fs_type}) whose listings are not lazy")
    newest = max(p.lstat().st_ctime_ns for p in [root, *root.rglob("*")])
    coarse = 5  # CLOCK_REALTIME_COARSE: no name for it in the time module
    tick = int(time.clock_getres(coarse) * 1e9)
    while (behind := newest - time.clock_gettime_ns(coarse)) >= 0:
        time.sleep(max(behind + 1, tick) / 1e9)  # the clock itself is what is waited for
    return root


def test_lazy_file_changed_during_its_first_read_is_read_again(tmp_path: Path) -> None:
    root = settled(build(tmp_path / "t"))
    target = root / "a" / "inner.txt"
    reads: list[str] = []

    def after_read(path: str) -> None:
        reads.append(path)
        if path == str(target) and reads.count(path) == 1:
            target.write_bytes(b"rewritten during the first read\n")

    _native.set_test_hooks(after_read=after_read, recent_ns=0)
    digest = fingerprint(root).roots[str(root)]
    assert reads.count(str(target)) == 2  # changed lately: bracketed by two fstats
    assert reads.count(str(root / "a.txt")) == 1  # old: proven by one fstat
    assert digest == reference_digest(root, "content")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda p, n: p.write_bytes(b"grown while hashed\n" * n), "size="),
        (lambda p, n: os.utime(p, ns=(0, 123_456_789 + n)), "mtime_ns=12345679"),
        (lambda p, n: p.chmod(0o600 if n % 2 else 0o640), "mode="),
        (lambda p, n: p.unlink() if p.exists() else None, "after: gone"),
    ],
)
def test_lazy_file_that_keeps_changing_raises(tmp_path: Path, change: object, field: str) -> None:
    root = settled(build(tmp_path / "t"))
    target = root / "a" / "inner.txt"
    calls: list[str] = []

    def after_read(path: str) -> None:
        if path == str(target):
            calls.append(path)
            change(target, len(calls))  # type: ignore[operator]

    _native.set_test_hooks(after_read=after_read, recent_ns=0)
    with pytest.raises(TreeChangedWhileHashing) as caught:
        fingerprint(root)
    assert caught.value.path == str(target)
    assert "before: type=f" in str(caught.value)
    assert field in str(caught.value)


@pytest.mark.parametrize("replacement", ["symlink", "removed", "dir"])
def test_lazy_file_replaced_after_the_listing(tmp_path: Path, replacement: str) -> None:
    root = settled(build(tmp_path / "t"))
    target = root / "a.txt"  # read after a-b.txt ('-' sorts before '.')

    def after_read(path: str) -> None:
        if path == str(root / "a-b.txt") and target.is_file() and not target.is_symlink():
            target.unlink()
            if replacement == "symlink":
                target.symlink_to("run.sh")
            elif replacement == "dir":
                target.mkdir()

    _native.set_test_hooks(after_read=after_read, recent_ns=0)
    if replacement == "dir":  # listed as a file, sorted as one: cannot be walked in order
        with pytest.raises(TreeChangedWhileHashing, match="before: type=f"):
            fingerprint(root)
        return
    digest = fingerprint(root).roots[str(root)]
    _native.set_test_hooks()
    assert digest == reference_digest(root, "content")


def test_missing_and_nested_roots_are_refused(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    with pytest.raises(FingerprintRootError, match=f"{tmp_path}/nope cannot be used"):
        fingerprint([root, tmp_path / "nope"])
    with pytest.raises(FingerprintRootError, match=f"{root}/a lies inside root {root}"):
        fingerprint([root / "a", root])
    with pytest.raises(FingerprintRootError, match="no fingerprint roots"):
        fingerprint([])


def test_roots_are_resolved_and_deduplicated(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    (tmp_path / "alias").symlink_to(root)
    result = fingerprint([tmp_path / "alias", root, f"{root}/."])
    assert list(result.roots) == [str(root)]


def test_a_file_root_is_one_entry(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    result = fingerprint(root / "run.sh")
    assert result.files == 1
    again = fingerprint(root / "run.sh")
    assert again.digest == result.digest
    (root / "run.sh").chmod(0o644)
    assert fingerprint(root / "run.sh").digest != result.digest


def test_deep_tree_beyond_the_open_descriptor_cap(tmp_path: Path) -> None:
    root = tmp_path / "deep"
    path = root
    for _ in range(150):
        path = path / "d"
    path.mkdir(parents=True)
    (path / "leaf").write_bytes(b"bottom")
    (root / "sibling").write_bytes(b"after the way back up")
    result = fingerprint(root)
    assert result.files == 2
    assert result.roots[str(root)] == reference_digest(root, "content")


def test_coordination_directory_inside_a_root_is_not_fingerprinted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = build(tmp_path / "t")
    before = fingerprint(root).digest
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(root / ".coordination"))
    assert fingerprint(root).digest == before
    assert (root / ".coordination" / "slot-0").exists()


def test_the_walk_waits_for_a_host_slot_without_the_gil(tmp_path: Path, coordination: Path) -> None:
    root = build(tmp_path / "t")
    slots = HostSlots(coordination)
    held = [slots.try_acquire() for _ in range(4)]
    assert all(held) and slots.try_acquire() is None
    waiting = threading.Event()
    _native.set_test_hooks(full_scan=lambda path: waiting.set())
    results: list[str] = []
    walker = threading.Thread(target=lambda: results.append(fingerprint(root).digest))
    walker.start()
    assert waiting.wait(30)  # blocked in the kernel on a slot, yet this thread runs
    assert results == []
    for slot in held:
        assert slot is not None
        slot.release()
    walker.join(30)
    assert len(results) == 1
    assert len([s for s in (slots.try_acquire() for _ in range(4)) if s]) == 4


def test_cli_prints_digest(tmp_path: Path) -> None:
    root = build(tmp_path / "t")
    out = CliRunner().invoke(cli, ["fingerprint", str(root)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == f"digest {fingerprint(root).digest}"
    assert lines[1].startswith("root ") and lines[1].endswith(str(root))
    js = CliRunner().invoke(cli, ["fingerprint", "--json", "--mode", "metadata", str(root)])
    assert js.exit_code == 0
    assert f'"digest": "{fingerprint(root, mode="metadata").digest}"' in js.output


def test_cli_missing_root_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "preloop", "fingerprint", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert f"{tmp_path}/missing cannot be used" in proc.stderr
