"""The object-cache byte cap: what is evicted, what survives, and fail-closed aborts.

Real bare repositories, real alternates, real flock held by another process, real
permission errors (as `nobody` in a child process, since tests run as root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from preloop.config import ConfigError, get
from preloop.fs import tree_bytes
from preloop.snapshot import layout
from preloop.snapshot.limits import STALE_PIN_AGE
from preloop.snapshot.locks import CachePin
from preloop.snapshot.prune import (
    MAX_BYTES_KNOB,
    TRASH_PREFIX,
    PruneHooks,
    PruneOutcome,
    PruneReport,
    SkipReason,
    measure_object_cache,
    object_cache_max_bytes,
    prune_after_capture,
    prune_snapshot_object_cache_sync,
)
from preloop.snapshot.references import snapshot_object_cache_references
from preloop.testing.object_cache import make_cache_entry, make_run_repository, set_last_use

KiB = 1024
T0 = 1_700_000_000.0


def prune(state: Path, cap: int, **kw: object) -> PruneReport:
    return prune_snapshot_object_cache_sync(state, cap, **kw)  # type: ignore[arg-type]


def entry_bytes(state: Path, key: str) -> int:
    total = 0
    for p in (
        layout.cache_repository(state, key),
        layout.cache_last_head_path(state, key),
        layout.cache_index_path(state, key),
    ):
        if os.path.lexists(p):
            total += tree_bytes(p).allocated_bytes
    return total


def present(state: Path, key: str) -> bool:
    return layout.cache_repository(state, key).is_dir()


def fsck(repo: Path) -> None:
    subprocess.run(
        ["git", "-C", repo, "fsck", "--connectivity-only", "--no-dangling"],
        capture_output=True,
        check=True,
    )


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def four_entries(state: Path) -> list[str]:
    """Entries a (oldest) .. d (newest), created in a different order."""
    keys = {}
    for name, age in (("c", 2), ("a", 0), ("d", 3), ("b", 1)):
        keys[name] = make_cache_entry(state, name, payload=64 * KiB, last_use=T0 + age * 60)
    return [keys[n] for n in "abcd"]


# --- eviction order and the cap ----------------------------------------------------


def test_oldest_first_eviction_stops_at_the_cap(state: Path) -> None:
    a, b, c, d = four_entries(state)
    sizes = {k: entry_bytes(state, k) for k in (a, b, c, d)}
    total = sum(sizes.values())
    cap = total - sizes[a] - 1  # a alone is not enough: b must go too, c must not
    report = prune(state, cap)
    assert report.outcome is PruneOutcome.COMPLETED
    assert [e.key for e in report.evicted] == [a, b]
    assert not present(state, a) and not present(state, b)
    assert present(state, c) and present(state, d)
    assert not layout.cache_last_head_path(state, a).exists()
    assert report.total_bytes_before == total
    assert report.reclaimed_bytes == sizes[a] + sizes[b]
    assert report.total_bytes_after == sizes[c] + sizes[d] <= cap
    assert all(not e.partial for e in report.evicted)
    assert report.skipped == ()
    # lock files stay (every process must lock the same inode); no private trash is left
    assert layout.cache_lock_path(state, a).exists()
    assert not [n for n in os.listdir(layout.cache_dir(state)) if n.startswith(TRASH_PREFIX)]


def test_last_use_follows_the_index_sidecar(state: Path) -> None:
    a, b, c, d = four_entries(state)
    # A capture reusing `a` rewrites its persisted index: `a` becomes the newest.
    index = layout.cache_index_path(state, a)
    index.write_bytes(b"DIRC")
    os.utime(index, (T0 + 3600, T0 + 3600))
    assert [u.key for u in measure_object_cache(state)] == [b, c, d, a]
    report = prune(state, entry_bytes(state, a) + entry_bytes(state, d))
    assert [e.key for e in report.evicted] == [b, c]


def test_under_cap_is_a_no_op(state: Path) -> None:
    keys = four_entries(state)
    before = sorted(os.listdir(layout.cache_dir(state)))
    total = sum(entry_bytes(state, k) for k in keys)
    report = prune(state, total)
    assert report.outcome is PruneOutcome.UNDER_CAP
    assert report.evicted == () and report.total_bytes_after == total
    assert sorted(os.listdir(layout.cache_dir(state))) == before


def test_zero_disables_pruning(state: Path) -> None:
    keys = four_entries(state)
    report = prune(state, 0)
    assert report.outcome is PruneOutcome.DISABLED
    assert all(present(state, k) for k in keys)


def test_missing_cache_directory_is_empty(state: Path) -> None:
    report = prune(state, 1)
    assert report.outcome is PruneOutcome.UNDER_CAP and report.entries == 0


def test_oversized_index_alone_forces_eviction(state: Path) -> None:
    key = make_cache_entry(state, "big-index", payload=1 * KiB, index=512 * KiB, last_use=T0)
    repo_bytes = tree_bytes(layout.cache_repository(state, key)).allocated_bytes
    index_bytes = tree_bytes(layout.cache_index_path(state, key)).allocated_bytes
    # The repository alone fits; only the index sidecar pushes the entry over.
    cap = repo_bytes + 4 * KiB
    report = prune(state, cap)
    assert [e.key for e in report.evicted] == [key]
    assert report.total_bytes_before == entry_bytes_total(repo_bytes, index_bytes, report)
    assert not layout.cache_index_path(state, key).exists()
    assert not present(state, key)
    assert report.reclaimed_bytes == report.total_bytes_before
    assert report.total_bytes_after == 0


def entry_bytes_total(repo_bytes: int, index_bytes: int, report: PruneReport) -> int:
    last_head = report.total_bytes_before - repo_bytes - index_bytes
    assert 0 < last_head <= 4 * KiB  # one small .last-head file
    return repo_bytes + index_bytes + last_head


def test_dry_run_removes_nothing_but_says_what_would_go(state: Path) -> None:
    a, b, c, d = four_entries(state)
    cap = entry_bytes(state, c) + entry_bytes(state, d)
    report = prune(state, cap, dry_run=True)
    assert [e.key for e in report.evicted] == [a, b]
    assert all(present(state, k) for k in (a, b, c, d))
    assert report.total_bytes_after <= cap


def test_crashed_eviction_leftover_is_removed(state: Path) -> None:
    (a,) = [make_cache_entry(state, "a", payload=4 * KiB, last_use=T0)]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = layout.cache_dir(state) / f"{TRASH_PREFIX}{a}-{dead.pid}-0badcafe"
    (leftover / "objects").mkdir(parents=True)
    (leftover / "objects" / "x").write_bytes(b"x" * 100)
    live = layout.cache_dir(state) / f"{TRASH_PREFIX}{a}-1-0badcafe"  # pid 1 is alive
    live.mkdir()
    report = prune(state, 10 * 1024 * KiB)
    assert report.leftovers_removed == (leftover.name,)
    assert not leftover.exists() and live.exists()


# --- what protects an entry --------------------------------------------------------


def test_published_and_staging_references_survive(state: Path) -> None:
    a, b, c, d = four_entries(state)
    snaps = layout.snapshots_dir(state)
    published = snaps / "run-1"
    make_run_repository(published, layout.cache_repository(state, a), relative=True)
    make_run_repository(
        layout.staging_dir(state) / "run-2-0123abcd", layout.cache_repository(state, b)
    )
    make_run_repository(
        layout.staging_dir(state) / "run-3-4567abcd" / layout.STAGING_REPOSITORY_NAME,
        layout.cache_repository(state, c),
        quoted=True,
    )
    (snaps / "stray-file").write_text("not a repository")
    refs = snapshot_object_cache_references(state)
    assert refs.by_key == {
        a: ("run-1",),
        b: (".staging/run-2-0123abcd",),
        c: (".staging/run-3-4567abcd/repository.git",),
    }
    report = prune(state, 1)
    assert [e.key for e in report.evicted] == [d]
    assert {(s.key, s.reason) for s in report.skipped} == {
        (a, SkipReason.REFERENCED),
        (b, SkipReason.REFERENCED),
        (c, SkipReason.REFERENCED),
    }
    assert all(present(state, k) for k in (a, b, c))
    fsck(published)


def test_references_compare_real_paths(tmp_path: Path) -> None:
    real_state = tmp_path / "real-state"
    key = make_cache_entry(real_state, "linked", payload=4 * KiB, last_use=T0)
    (tmp_path / "alias").symlink_to(real_state)
    alias_cache = tmp_path / "alias" / layout.CACHE_DIR_NAME / f"{key}.git"
    run = layout.snapshots_dir(real_state) / "run-1"
    make_run_repository(run, layout.cache_repository(real_state, key))
    # Write the target through the symlinked state directory on purpose.
    (run / "objects" / "info" / "alternates").write_text(f"{alias_cache}/objects\n")
    for view in (real_state, tmp_path / "alias"):
        assert snapshot_object_cache_references(view).referrers(key) == ("run-1",)
        report = prune(view, 1)
        assert report.evicted == () and report.skipped[0].reason is SkipReason.REFERENCED
    assert present(real_state, key)


def test_reference_published_after_the_prescan_is_seen_under_the_lock(state: Path) -> None:
    a, b, _, _ = four_entries(state)
    published: list[str] = []

    def publish_while_locked(key: str) -> None:
        # A capture finished between the pre-scan and the lock: its pin is gone,
        # only its alternates file protects the entry now.
        if key == a and not published:
            make_run_repository(
                layout.snapshots_dir(state) / "late", layout.cache_repository(state, a)
            )
            published.append(key)

    cap = entry_bytes(state, a) * 3
    report = prune(state, cap, hooks=PruneHooks(locked=publish_while_locked))
    assert published == [a]
    assert report.skipped[0].key == a and report.skipped[0].reason is SkipReason.REFERENCED
    assert [e.key for e in report.evicted] == [b]
    fsck(layout.snapshots_dir(state) / "late")


def test_a_pin_taken_before_a_later_entry_of_the_batch_is_locked_is_seen(state: Path) -> None:
    """Candidates are locked in batches: a capture that pins `b` while the prune
    already holds `a`'s lock (before `b`'s) still keeps `b`, and the batch after
    it evicts `c` instead."""
    a, b, c, d = four_entries(state)
    sizes = {k: entry_bytes(state, k) for k in (a, b, c, d)}
    locked: list[str] = []
    pins: list[CachePin] = []

    def pin_b_while_a_is_locked(key: str) -> None:
        locked.append(key)
        if key == a:
            pins.append(CachePin.create(state, b, run_id="run-late"))

    cap = sizes[b] + sizes[d]  # with b pinned, a and c must go
    report = prune(state, cap, hooks=PruneHooks(locked=pin_b_while_a_is_locked))
    assert locked[:2] == [a, b]  # one batch: both locked before any check
    assert [e.key for e in report.evicted] == [a, c]
    assert [(s.key, s.reason) for s in report.skipped] == [(b, SkipReason.PINNED)]
    assert present(state, b) and present(state, d) and pins[0].path.exists()
    assert report.total_bytes_after <= cap


LOCK_HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()  # hold until the test closes our stdin
    """
)


def test_a_fresh_lock_in_another_process_keeps_the_entry(state: Path) -> None:
    a, b, _, _ = four_entries(state)
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(layout.cache_lock_path(state, a))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        report = prune(state, entry_bytes(state, a) * 3)
        assert report.skipped[0].key == a and report.skipped[0].reason is SkipReason.BUSY
        assert [e.key for e in report.evicted] == [b]
        assert present(state, a)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    # Once the holder is gone the entry is evictable again.
    assert prune(state, 1).evicted[0].key == a


def test_a_capture_pin_keeps_the_entry_and_a_stale_pin_is_removed(state: Path) -> None:
    a, b, c, _ = four_entries(state)
    live = CachePin.create(state, a, run_id="run-live")
    stale = CachePin.create(state, b, run_id="run-crashed")
    old = time.time() - STALE_PIN_AGE - 60
    os.utime(stale.path, (old, old))
    cap = entry_bytes(state, a) * 2
    report = prune(state, cap)
    assert (a, SkipReason.PINNED) in {(s.key, s.reason) for s in report.skipped}
    assert present(state, a) and live.path.exists()
    assert report.stale_pins_removed == (stale.path.name,)
    assert not stale.path.exists()
    assert [e.key for e in report.evicted] == [b, c]
    live.drop()
    assert prune(state, 1).evicted[0].key == a


# --- fail closed -------------------------------------------------------------------

UNPRIVILEGED = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from preloop.snapshot.prune import prune_snapshot_object_cache_sync
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    report = prune_snapshot_object_cache_sync(Path(sys.argv[1]), int(sys.argv[2]))
    print(json.dumps({
        "outcome": report.outcome.value,
        "error": report.error,
        "evicted": [[e.key, e.size_bytes, e.removed_bytes, e.partial, e.error]
                    for e in report.evicted],
        "total_after": report.total_bytes_after,
        "skipped": [[s.key, s.reason.value, s.detail] for s in report.skipped],
    }))
    """
)


def hand_to_nobody(state: Path) -> None:
    """Gives the state tree to `nobody`, so that only the permissions a test
    removes afterwards stand in the way of the unprivileged prune."""
    if os.geteuid() == 0:
        for root, dirs, files in os.walk(state):
            for name in (*dirs, *files):
                os.lchown(os.path.join(root, name), 65534, 65534)
        os.lchown(state, 65534, 65534)


def prune_unprivileged(state: Path, cap: int) -> dict[str, object]:
    """Runs a prune as `nobody` in a child process (when we are root)."""
    done = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED, str(state), str(cap)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_unreadable_alternates_abort_eviction(public_tmp: Path) -> None:
    state = public_tmp / "state"
    keys = four_entries(state)
    run = layout.snapshots_dir(state) / "run-1"
    make_run_repository(run, layout.cache_repository(state, keys[3]))
    hand_to_nobody(state)
    (run / "objects" / "info" / "alternates").chmod(0)
    result = prune_unprivileged(state, 1)
    assert result["outcome"] == "aborted"
    assert "run-1/objects/info/alternates" in str(result["error"])
    assert result["evicted"] == []
    assert all(present(state, k) for k in keys)


@pytest.mark.parametrize("unreadable", ["snapshots", "staging"])
def test_unreadable_snapshot_enumeration_aborts_eviction(public_tmp: Path, unreadable: str) -> None:
    state = public_tmp / "state"
    keys = four_entries(state)
    make_run_repository(
        layout.staging_dir(state) / "run-2-0123abcd", layout.cache_repository(state, keys[0])
    )
    hand_to_nobody(state)
    target = layout.snapshots_dir(state) if unreadable == "snapshots" else layout.staging_dir(state)
    target.chmod(0o311)  # searchable, not listable
    result = prune_unprivileged(state, 1)
    assert result["outcome"] == "aborted"
    assert str(target) in str(result["error"])
    assert result["evicted"] == []
    assert all(present(state, k) for k in keys)


def test_unlistable_cache_directory_aborts_eviction(public_tmp: Path) -> None:
    # A pin listing that cannot be completed must not read as "no pins".
    state = public_tmp / "state"
    keys = four_entries(state)
    hand_to_nobody(state)
    layout.cache_dir(state).chmod(0o311)
    result = prune_unprivileged(state, 1)
    assert result["outcome"] == "aborted"
    assert all(present(state, k) for k in keys)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to create files another user cannot remove"
)


@needs_root
def test_an_entry_whose_lock_cannot_be_opened_is_kept(public_tmp: Path) -> None:
    # Root owns the cache: nobody can read everything but create no lock file.
    state = public_tmp / "state"
    key = make_cache_entry(state, "a", payload=4 * KiB, last_use=T0)
    result = prune_unprivileged(state, 1)
    assert result["outcome"] == "completed" and result["evicted"] == []
    ((skipped_key, reason, detail),) = result["skipped"]  # one entry, kept
    assert (skipped_key, reason) == (key, "busy")
    assert "cannot open its lock file" in detail and str(layout.cache_dir(state)) in detail
    assert present(state, key)


def test_unreadable_alternates_line_aborts_eviction(state: Path) -> None:
    keys = four_entries(state)
    run = layout.snapshots_dir(state) / "run-1"
    make_run_repository(run, layout.cache_repository(state, keys[3]))
    (run / "objects" / "info" / "alternates").write_text('"/no/closing/quote\n')
    report = prune(state, 1)
    assert report.outcome is PruneOutcome.ABORTED
    assert "line 1 is not a valid quoted path" in (report.error or "")
    assert all(present(state, k) for k in keys)


def test_alternates_that_is_a_directory_aborts_eviction(state: Path) -> None:
    keys = four_entries(state)
    (layout.snapshots_dir(state) / "run-1" / "objects" / "info" / "alternates").mkdir(parents=True)
    report = prune(state, 1)
    assert report.outcome is PruneOutcome.ABORTED
    assert all(present(state, k) for k in keys)


@needs_root
def test_partial_removal_is_reported_and_only_removed_bytes_count(public_tmp: Path) -> None:
    state = public_tmp / "state"
    a = make_cache_entry(state, "a", payload=64 * KiB, last_use=T0)
    b = make_cache_entry(state, "b", payload=64 * KiB, last_use=T0 + 60)
    hand_to_nobody(state)
    # A root-owned pack directory inside `a`: nobody can move `a` aside but not empty it.
    stuck = layout.cache_repository(state, a) / "objects" / "pack"
    (stuck / "keep.pack").write_bytes(os.urandom(32 * KiB))
    os.chown(stuck, 0, 0)
    os.chmod(stuck, 0o755)
    os.chown(stuck / "keep.pack", 0, 0)
    size_a = entry_bytes(state, a)
    cap = entry_bytes(state, b)  # met if `a` goes entirely; a partial removal is not enough
    result = prune_unprivileged(state, cap)
    assert result["outcome"] == "completed"
    evicted = result["evicted"]
    assert isinstance(evicted, list)
    first, *rest = evicted
    key, size, removed, partial, error = first
    assert key == a and size == size_a and partial is True
    assert "keep.pack" in error
    left = [n for n in os.listdir(layout.cache_dir(state)) if n.startswith(TRASH_PREFIX)]
    assert len(left) == 1
    assert removed == size_a - tree_bytes(layout.cache_dir(state) / left[0]).allocated_bytes
    # `a` freed too little, so `b` had to go as well.
    assert [r[0] for r in rest] == [b]


# --- the knob ----------------------------------------------------------------------


def test_max_bytes_knob() -> None:
    assert object_cache_max_bytes({}) == 100 * 1024**3
    assert object_cache_max_bytes({MAX_BYTES_KNOB: "0"}) == 0
    assert object_cache_max_bytes({MAX_BYTES_KNOB: "50GiB"}) == 50 * 1024**3
    assert object_cache_max_bytes({MAX_BYTES_KNOB: "1048576"}) == 1024**2
    with pytest.raises(ConfigError, match=MAX_BYTES_KNOB):
        get(MAX_BYTES_KNOB, {MAX_BYTES_KNOB: "lots"})


def test_entries_without_git_are_counted_and_evicted(state: Path) -> None:
    key = make_cache_entry(state, "orphan", payload=4 * KiB, index=8 * KiB, last_use=T0)
    import shutil

    shutil.rmtree(layout.cache_repository(state, key))
    (usage,) = measure_object_cache(state)
    assert usage.repository_bytes == 0 and usage.index_bytes > 0
    report = prune(state, 1)
    assert [e.key for e in report.evicted] == [key]
    assert not layout.cache_index_path(state, key).exists()
    assert not layout.cache_last_head_path(state, key).exists()


def test_set_last_use_orders_measure(state: Path) -> None:
    a, b, c, d = four_entries(state)
    set_last_use(state, d, T0 - 60)
    assert [u.key for u in measure_object_cache(state)] == [d, a, b, c]


def test_post_capture_hook_records_the_use(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c, d = four_entries(state)
    index = layout.cache_index_path(state, a)
    index.write_bytes(b"DIRC")
    os.utime(index, (T0, T0))
    monkeypatch.setenv(MAX_BYTES_KNOB, "0")  # record the use only; no prune
    prune_after_capture(state, a)
    assert [u.key for u in measure_object_cache(state)] == [b, c, d, a]
    assert index.stat().st_mtime == T0  # git's racy-clean check relies on the index time
