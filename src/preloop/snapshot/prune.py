"""The byte cap of the shared snapshot object cache (seed 000, "Shared object-cache cap").

`prune_snapshot_object_cache(state_dir, max_bytes, sweep)` keeps
`<state>/snapshot-object-cache` under `max_bytes` by evicting whole entries,
least recently used first, and never removes an entry that is in use.

**Entries.** An entry is `<key>.git` plus its `<key>.last-head` and `<key>.index`
sidecars; its size is the disk usage (allocated bytes, what `du -s` counts) of
all three, measured with the native walker `preloop.fs.tree_bytes`. The
`<key>.lock` file is never removed (every process must lock the same inode).

**Last use** of an entry is the newest modification time among `<key>.git`
(the directory: set when the entry is cloned into place), `<key>.last-head` and
`<key>.index`. `ensure_object_cache` rewrites `<key>.last-head` whenever the
HEAD it syncs moves, and the post-capture hook `prune_after_capture` touches it
after every successful capture, so a capture that reuses an unchanged entry
counts as a use too. (The index sidecar's time is only read, never set: git's
racy-clean check depends on it.) Entries are evicted oldest last use first, ties
broken by key.

**Safety.** Every candidate is retired under its per-entry cache lock, taken with
`try_acquire_cache_lock` only (a busy entry is skipped, never waited for), and
only after, with that lock held: no pin `<key>.pin-*` exists (pins older than
`STALE_PIN_AGE`, the capture deadline plus the cleanup grace, are crash
leftovers and are removed under the lock) and no run repository's
`objects/info/alternates` references the entry, re-scanned under the lock
(see `preloop.snapshot.references`). Candidates are locked in batches (as
many as the cap needs, at most 64) and one listing of the cache directory and
one reference scan, made once every lock of the batch is held, serve the whole
batch. Anything unreadable in that state aborts the whole eviction (fail
closed); only ENOENT means "absent".

**Removal** unlinks the sidecars and renames `<key>.git` to a private
`.evicting-<key>-<pid>-<nonce>` directory while the lock is held, then deletes
the renamed tree after the lock is released, in one native GIL-free `unlinkat`
walk (`preloop.fs.remove_tree`) that counts the bytes it removes; the trees of a
batch are removed by up to four threads at once. A crash leaves at worst an intact
repository without sidecars or that private directory, which the next prune
removes once its process is gone. Only bytes really removed
are subtracted from the total; a removal that fails part-way is reported as
partial, and eviction stops as soon as the total is at or below the cap.

**Soft ceiling.** `git clone --local` hard-links objects, and each entry is
sized on its own (a hard-linked inode counts once per entry), so the total and
the reclaimed bytes are an upper bound of the physical usage and reclaim, not a
guarantee.

**Single flight.** One prune per state directory at a time
(`SnapshotObjectCacheSweep`): a request while one runs is dropped, not queued.
The permit is taken before the work starts, and it is released on completion,
error or cancellation; a cancelled prune whose walk is still running in its
worker thread keeps ownership until the walk returns.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.abc

from preloop import config
from preloop.errors import ConfigError, PreloopError
from preloop.fs import remove_tree, tree_bytes
from preloop.snapshot import layout
from preloop.snapshot.holders import sweep_abandoned_run_repositories
from preloop.snapshot.hooks import register_after_capture
from preloop.snapshot.limits import STALE_PIN_AGE
from preloop.snapshot.locks import list_pins_of, try_acquire_cache_lock
from preloop.snapshot.owner import pid_exists
from preloop.snapshot.references import (
    CacheReferenceError,
    CacheReferences,
    snapshot_object_cache_references,
)
from preloop.snapshot.sweep import SweepReport, sweep_workspace_snapshots

__all__ = [
    "MAX_BYTES_KNOB",
    "CacheEntryUsage",
    "EvictedEntry",
    "PruneHooks",
    "PruneOutcome",
    "PruneReport",
    "SkipReason",
    "SkippedEntry",
    "SnapshotObjectCacheSweep",
    "SweepPermit",
    "measure_object_cache",
    "object_cache_max_bytes",
    "prune_after_capture",
    "prune_snapshot_object_cache",
    "prune_snapshot_object_cache_sync",
    "request_object_cache_prune",
    "start_object_cache_prune",
    "startup_snapshot_maintenance",
]

MAX_BYTES_KNOB = "PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES"
TRASH_PREFIX = ".evicting-"

_log = logging.getLogger(__name__)


def object_cache_max_bytes(env: Mapping[str, str] | None = None) -> int:
    """`PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES` (default 100 GiB; 0 disables)."""
    value: int = config.get(MAX_BYTES_KNOB, env)
    return value


# --- report ------------------------------------------------------------------------


class PruneOutcome(enum.Enum):
    """How a prune request ended."""

    DISABLED = "disabled"  # max_bytes == 0
    UNDER_CAP = "under-cap"  # nothing to do
    COMPLETED = "completed"  # evicted until under the cap, or ran out of candidates
    ABORTED = "aborted"  # fail closed: some state could not be read; see `error`
    COALESCED = "coalesced"  # another prune of this state directory was running
    CANCELLED = "cancelled"  # the caller stopped it between entries


class SkipReason(enum.Enum):
    BUSY = "busy"  # the entry's lock is held (a capture is refreshing it)
    PINNED = "pinned"  # a live capture pin exists
    REFERENCED = "referenced"  # a run repository's alternates point into it


@dataclass(frozen=True, slots=True)
class CacheEntryUsage:
    """One entry's disk usage (allocated bytes) and last use (ns since the epoch)."""

    key: str
    repository_bytes: int
    last_head_bytes: int
    index_bytes: int
    last_use_ns: int
    pins: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.repository_bytes + self.last_head_bytes + self.index_bytes


@dataclass(frozen=True, slots=True)
class EvictedEntry:
    """An entry that was retired (or, in a dry run, would be). `removed_bytes`
    counts only what was really deleted; `partial` means some of it remains,
    with `error` saying why."""

    key: str
    size_bytes: int
    removed_bytes: int
    partial: bool = False
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SkippedEntry:
    key: str
    reason: SkipReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What one `prune_snapshot_object_cache` call saw and did."""

    state_dir: Path
    outcome: PruneOutcome
    max_bytes: int
    dry_run: bool = False
    entries: int = 0
    total_bytes_before: int = 0
    total_bytes_after: int = 0
    evicted: tuple[EvictedEntry, ...] = ()
    skipped: tuple[SkippedEntry, ...] = ()
    stale_pins_removed: tuple[str, ...] = ()
    leftovers_removed: tuple[str, ...] = ()
    error: str | None = None

    @property
    def reclaimed_bytes(self) -> int:
        """Bytes really removed from entries (a dry run: would be removed)."""
        return sum(e.removed_bytes for e in self.evicted)

    @property
    def over_cap(self) -> bool:
        return self.max_bytes > 0 and self.total_bytes_after > self.max_bytes


@dataclass(frozen=True, slots=True)
class PruneHooks:
    """Test and instrumentation hooks, each called in the prune's worker thread:
    `before_size(key)` before an entry is walked, `locked(key)` right after its
    lock was taken (before the pin and reference checks), `before_remove(key,
    trash)` after `<key>.git` was renamed aside and the lock released (in one of
    the threads removing a batch's trees)."""

    before_size: Callable[[str], None] | None = None
    locked: Callable[[str], None] | None = None
    before_remove: Callable[[str, Path], None] | None = None


_NO_HOOKS = PruneHooks()


class _Stopped(Exception):
    """The owner of this prune asked it to stop between two entries."""


# --- single flight -----------------------------------------------------------------


class SnapshotObjectCacheSweep:
    """Single-flight guard of the object-cache prune for one state directory.

    `try_acquire()` returns a `SweepPermit` or None while another prune owns the
    guard. Work that outlives its requester (a size walk still running in a
    worker thread after the prune was cancelled) holds its own ownership through
    `SweepPermit.hold()`; the guard is free only when every owner has released.
    Thread-safe. `for_state_dir` gives the process-wide guard of a state
    directory (by real path); separate instances are independent. The guard is
    per process: prunes in different processes may overlap, which the per-entry
    locks keep safe."""

    _registry: ClassVar[dict[str, SnapshotObjectCacheSweep]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._owners = 0
        self._runs = 0

    @classmethod
    def for_state_dir(cls, state_dir: str | os.PathLike[str]) -> SnapshotObjectCacheSweep:
        real = os.path.realpath(state_dir)
        with cls._registry_lock:
            sweep = cls._registry.get(real)
            if sweep is None:
                sweep = cls._registry[real] = cls()
            return sweep

    def try_acquire(self) -> SweepPermit | None:
        """The permit to run one prune now, or None when one is running."""
        with self._cv:
            if self._owners:
                return None
            self._owners = 1
            self._runs += 1
            return SweepPermit(self)

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._owners > 0

    @property
    def runs_started(self) -> int:
        """How many permits were granted so far (dropped requests do not count)."""
        with self._cv:
            return self._runs

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no prune owns the guard; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._owners == 0, timeout)

    def _add_owner(self) -> None:
        with self._cv:
            if self._owners == 0:
                raise RuntimeError("SweepPermit.hold() on a released permit")
            self._owners += 1

    def _drop_owner(self) -> None:
        with self._cv:
            self._owners -= 1
            if self._owners == 0:
                self._cv.notify_all()


class SweepPermit:
    """One ownership of a `SnapshotObjectCacheSweep`; `release()` is idempotent."""

    __slots__ = ("__weakref__", "_held", "_lock", "_sweep")

    def __init__(self, sweep: SnapshotObjectCacheSweep) -> None:
        self._sweep = sweep
        self._lock = threading.Lock()
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> SweepPermit:
        """A further ownership for work that may outlive this permit's holder."""
        with self._lock:
            if not self._held:
                raise RuntimeError("SweepPermit.hold() on a released permit")
            self._sweep._add_owner()
        return SweepPermit(self._sweep)

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._sweep._drop_owner()


class _DetachableJob:
    """Runs `fn(should_stop)` in a worker thread with its own ownership `hold`.

    If the awaiting task is cancelled, `abandon()` asks the function to stop at
    its next check; the ownership is released by the thread when the function
    returns, or right away if the thread never started it (anyio skips work
    items whose waiter was already abandoned)."""

    def __init__(self, hold: SweepPermit, fn: Callable[[Callable[[], bool]], PruneReport]) -> None:
        self._hold = hold
        self._fn = fn
        self._lock = threading.Lock()
        self._started = False
        self._abandoned = False
        self._stop = threading.Event()

    def run(self) -> PruneReport:
        with self._lock:
            if self._abandoned:
                raise _Stopped
            self._started = True
        try:
            return self._fn(self._stop.is_set)
        finally:
            self._hold.release()

    def abandon(self) -> None:
        self._stop.set()
        with self._lock:
            if self._started:
                return
            self._abandoned = True
        self._hold.release()


# --- measuring ---------------------------------------------------------------------


def _allocated(path: str | os.PathLike[str]) -> int:
    """Allocated bytes of a file or tree; 0 when it does not exist."""
    try:
        return tree_bytes(path).allocated_bytes
    except FileNotFoundError:
        return 0


def _name_suffix(path_of: Callable[[Path, str], Path]) -> str:
    sample = layout.cache_key("sample", "sample")
    return path_of(Path("/"), sample).name[len(sample) :]


# Entry file names come from `layout`; measuring 1,000s of entries builds them
# as strings (pathlib objects cost more than the lstat calls they name).
_GIT_SUFFIX = _name_suffix(layout.cache_repository)
_LAST_HEAD_SUFFIX = _name_suffix(layout.cache_last_head_path)
_INDEX_SUFFIX = _name_suffix(layout.cache_index_path)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _usage_of(path: str, st: os.stat_result | None) -> int:
    if st is None:
        return 0
    if stat.S_ISDIR(st.st_mode):
        return _allocated(path)
    return st.st_blocks * 512


def _list_cache(state_dir: Path) -> tuple[dict[str, list[str]], list[str]]:
    """Cache keys with the kinds present (`git`, `last-head`, `index`, `pin`) and
    the names of eviction leftovers. Fails closed on a partial listing."""
    cache = layout.cache_dir(state_dir)
    try:
        with os.scandir(cache) as it:
            names = [e.name for e in it]
    except FileNotFoundError:
        return {}, []
    except OSError as exc:
        raise CacheReferenceError(cache, exc.strerror or str(exc)) from None
    keys: dict[str, list[str]] = {}
    leftovers: list[str] = []
    for name in names:
        if name.startswith(TRASH_PREFIX):
            leftovers.append(name)
            continue
        parsed = layout.parse_cache_entry_name(name)
        if parsed is None or parsed.kind in ("lock", "tmp"):
            continue  # a clone in progress belongs to its ensure_object_cache
        kinds = keys.setdefault(parsed.key, [])
        kinds.append(name if parsed.kind == "pin" else parsed.kind)
    return keys, leftovers


def _measure(cache: str, key: str, kinds: list[str], hooks: PruneHooks) -> CacheEntryUsage | None:
    """Sizes one entry; None if it is only pins (nothing to evict)."""
    if not any(k in ("git", "last-head", "index") for k in kinds):
        return None
    if hooks.before_size is not None:
        hooks.before_size(key)
    base = os.path.join(cache, key)
    paths = (base + _GIT_SUFFIX, base + _LAST_HEAD_SUFFIX, base + _INDEX_SUFFIX)
    try:
        stats = [_lstat(p) for p in paths]
        repo_bytes, last_head_bytes, index_bytes = (
            _usage_of(p, st) for p, st in zip(paths, stats, strict=True)
        )
    except OSError as exc:
        raise CacheReferenceError(exc.filename or base, exc.strerror or str(exc)) from None
    return CacheEntryUsage(
        key=key,
        repository_bytes=repo_bytes,
        last_head_bytes=last_head_bytes,
        index_bytes=index_bytes,
        last_use_ns=max((st.st_mtime_ns for st in stats if st is not None), default=0),
        pins=tuple(sorted(k for k in kinds if k.startswith(f"{key}.pin-"))),
    )


def measure_object_cache(
    state_dir: Path,
    *,
    hooks: PruneHooks = _NO_HOOKS,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[CacheEntryUsage]:
    """Every entry of the object cache with its size and last use, oldest last
    use first. Raises `CacheReferenceError` when the cache cannot be listed or
    an entry cannot be sized."""
    keys, _ = _list_cache(state_dir)
    return _measure_listed(state_dir, keys, hooks, should_stop)


def _measure_listed(
    state_dir: Path,
    keys: dict[str, list[str]],
    hooks: PruneHooks,
    should_stop: Callable[[], bool],
) -> list[CacheEntryUsage]:
    cache = os.fspath(layout.cache_dir(state_dir))
    usages: list[CacheEntryUsage] = []
    for key in sorted(keys):
        if should_stop():
            raise _Stopped
        usage = _measure(cache, key, keys[key], hooks)
        if usage is not None:
            usages.append(usage)
    usages.sort(key=lambda u: (u.last_use_ns, u.key))
    return usages


# --- retiring ----------------------------------------------------------------------

_active_trash: set[str] = set()
_active_trash_lock = threading.Lock()


def _remove_leftovers(state_dir: Path, names: list[str]) -> list[str]:
    """Deletes `.evicting-*` trees of prunes whose process is gone (a crash
    between the rename and the deletion)."""
    removed: list[str] = []
    cache = layout.cache_dir(state_dir)
    for name in names:
        pid_text = name[len(TRASH_PREFIX) :].rsplit("-", 2)
        path = cache / name
        with _active_trash_lock:
            active = str(path) in _active_trash
        if active or len(pid_text) != 3 or not pid_text[1].isdigit():
            continue
        pid = int(pid_text[1])
        if pid != os.getpid() and pid_exists(pid):
            continue
        remove_tree(path)
        if not os.path.lexists(path):
            removed.append(name)
    return removed


def _unlink_counted(path: Path) -> tuple[int, str | None]:
    """Removes one sidecar: (bytes freed, error)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, None
    except OSError as exc:
        return 0, f"{path}: {exc.strerror or exc}"
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0, None
    except OSError as exc:
        return 0, f"{path}: {exc.strerror or exc}"
    return st.st_blocks * 512, None


def _delete_tree(trash: Path) -> tuple[int, str | None]:
    """Deletes a renamed-aside repository: (bytes removed, error). One native
    unlinkat walk without the GIL that counts what it really removes, so a failure
    part-way claims only the bytes that are gone."""
    freed, err = remove_tree(trash)
    if err is None:
        return freed, None
    return freed, f"{err.filename or trash}: {err.strerror or err}"


@dataclass
class _Run:
    """Mutable state of one prune pass."""

    state_dir: Path
    max_bytes: int
    dry_run: bool
    hooks: PruneHooks
    should_stop: Callable[[], bool]
    total: int = 0
    evicted: list[EvictedEntry] = field(default_factory=list)
    skipped: list[SkippedEntry] = field(default_factory=list)
    stale_pins: list[str] = field(default_factory=list)


def _check_pins(run: _Run, pins: list[Path], now: float) -> str | None:
    """With the entry's lock held: removes stale pins among `pins` (listed under
    the lock) and returns the name of a live one, if any. An lstat error other
    than ENOENT raises."""
    live: str | None = None
    for pin in pins:
        try:
            age = now - os.lstat(pin).st_mtime
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CacheReferenceError(pin, exc.strerror or str(exc)) from None
        if age <= STALE_PIN_AGE:
            live = live or pin.name
            continue
        if run.dry_run:
            run.stale_pins.append(pin.name)
            continue
        try:
            pin.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CacheReferenceError(pin, f"cannot remove stale pin: {exc.strerror}") from None
        run.stale_pins.append(pin.name)
    return live


# Entries locked and checked together: one listing of the cache directory and one
# reference scan serve the whole batch (per entry, both were O(cache size), which
# made an eviction quadratic). Bounded so the lock descriptors stay few.
_BATCH = 64


@dataclass
class _Aside:
    """An entry whose repository was renamed aside under its lock: `trash` is
    deleted once every lock of the batch is released."""

    usage: CacheEntryUsage
    trash: Path | None
    freed: int
    errors: list[str]


def _lock_batch(
    run: _Run, usages: list[CacheEntryUsage], stack: contextlib.ExitStack
) -> list[CacheEntryUsage]:
    """Takes the lock of each candidate that is free (busy ones are skipped) and
    returns the locked ones; `stack` releases the locks."""
    locked: list[CacheEntryUsage] = []
    for usage in usages:
        try:
            lock = try_acquire_cache_lock(run.state_dir, usage.key)
        except OSError as exc:
            # Without the lock nothing proves the entry idle: keep it.
            detail = f"cannot open its lock file {exc.filename}: {exc.strerror or exc}"
            run.skipped.append(SkippedEntry(usage.key, SkipReason.BUSY, detail))
            continue
        if lock is None:
            run.skipped.append(SkippedEntry(usage.key, SkipReason.BUSY, "its cache lock is held"))
            continue
        stack.enter_context(lock)
        if run.hooks.locked is not None:
            run.hooks.locked(usage.key)
        locked.append(usage)
    return locked


def _move_aside(run: _Run, usage: CacheEntryUsage) -> _Aside:
    """With the entry's lock held: unlinks its sidecars and renames `<key>.git`
    to a private trash name."""
    key = usage.key
    aside = _Aside(usage, None, 0, [])
    # Sidecars first: if we die before the repository is moved aside, what
    # remains is an intact repository without sidecars, which the next
    # capture simply refreshes (a cold index, a fetch check).
    for sidecar in (
        layout.cache_index_path(run.state_dir, key),
        layout.cache_last_head_path(run.state_dir, key),
    ):
        n, err = _unlink_counted(sidecar)
        aside.freed += n
        if err:
            aside.errors.append(err)
    repo = layout.cache_repository(run.state_dir, key)
    candidate = layout.cache_dir(run.state_dir) / (
        f"{TRASH_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(4)}"
    )
    with _active_trash_lock:
        _active_trash.add(str(candidate))
    try:
        os.rename(repo, candidate)
        aside.trash = candidate
    except FileNotFoundError:
        pass
    except OSError as exc:
        aside.errors.append(f"{repo}: {exc.strerror or exc}")
    if aside.trash is None:
        with _active_trash_lock:
            _active_trash.discard(str(candidate))
    return aside


_REMOVERS = 4


def _remove_aside(hooks: PruneHooks, aside: _Aside) -> None:
    """Deletes one renamed-aside repository (its lock already released)."""
    assert aside.trash is not None
    try:
        if hooks.before_remove is not None:
            hooks.before_remove(aside.usage.key, aside.trash)
        n, err = _delete_tree(aside.trash)
    finally:
        with _active_trash_lock:
            _active_trash.discard(str(aside.trash))
    aside.freed += n
    if err:
        aside.errors.append(err)


def _retire_batch(run: _Run, usages: list[CacheEntryUsage]) -> None:
    """Evicts candidates, in order, whose lock is free and which nothing uses,
    until the projected total is at or below the cap. The pin and reference
    checks run after every lock of the batch is held, so each sees any capture
    that published or pinned before its entry was locked."""
    asides: list[_Aside] = []
    with contextlib.ExitStack() as stack:
        locked = _lock_batch(run, usages, stack)
        if not locked:
            return
        try:
            pins = list_pins_of(run.state_dir, [u.key for u in locked])
        except OSError as exc:
            raise CacheReferenceError(
                exc.filename or layout.cache_dir(run.state_dir), exc.strerror or str(exc)
            ) from None
        # Pins are checked before the reference scan: a capture writes its
        # alternates and then drops its pin, so a pin listed above that is gone
        # when checked means alternates the scan below sees (scanning first
        # missed them: the entry was evicted under a running capture).
        now = time.time()
        live_pins = {u.key: _check_pins(run, pins[u.key], now) for u in locked}
        # The pre-scan may predate a publication whose pin is gone by now.
        refs = snapshot_object_cache_references(run.state_dir)
        projected = run.total
        for usage in locked:
            if projected <= run.max_bytes:
                break
            key = usage.key
            live_pin = live_pins[key]
            if live_pin is not None:
                run.skipped.append(SkippedEntry(key, SkipReason.PINNED, live_pin))
                continue
            if key in refs:
                detail = ", ".join(refs.referrers(key))
                run.skipped.append(SkippedEntry(key, SkipReason.REFERENCED, detail))
                continue
            projected -= usage.total_bytes
            if run.dry_run:
                run.evicted.append(EvictedEntry(key, usage.total_bytes, usage.total_bytes))
                run.total -= usage.total_bytes
                continue
            asides.append(_move_aside(run, usage))
    # The trees go in parallel: removal is native and GIL-free, and unlinks wait
    # on the filesystem (its journal), so a few of them overlap well.
    trashed = [a for a in asides if a.trash is not None]
    if len(trashed) > 1:
        with ThreadPoolExecutor(min(_REMOVERS, len(trashed)), "preloop-prune-rm") as pool:
            list(pool.map(functools.partial(_remove_aside, run.hooks), trashed))
    elif trashed:
        _remove_aside(run.hooks, trashed[0])
    for aside in asides:
        run.total -= aside.freed
        run.evicted.append(
            EvictedEntry(
                aside.usage.key,
                aside.usage.total_bytes,
                aside.freed,
                partial=bool(aside.errors),
                error="; ".join(aside.errors) if aside.errors else None,
            )
        )


def _prune_pass(
    state_dir: Path,
    max_bytes: int,
    dry_run: bool,
    hooks: PruneHooks,
    should_stop: Callable[[], bool],
) -> PruneReport:
    """The whole prune, synchronously (runs in a worker thread)."""
    state_dir = Path(state_dir)
    report = functools.partial(PruneReport, state_dir, max_bytes=max_bytes, dry_run=dry_run)
    run = _Run(state_dir, max_bytes, dry_run, hooks, should_stop)
    leftovers: list[str] = []
    usages: list[CacheEntryUsage] = []
    before = 0
    try:
        if not dry_run:
            # A run repository whose holder died references its entry for
            # good: remove it first, so that the entry can be evicted.
            sweep_abandoned_run_repositories(state_dir)
        keys, trash_names = _list_cache(state_dir)
        if trash_names and not dry_run:
            leftovers = _remove_leftovers(state_dir, trash_names)
        usages = _measure_listed(state_dir, keys, hooks, should_stop)
        before = run.total = sum(u.total_bytes for u in usages)
        if run.total <= max_bytes:
            return report(
                PruneOutcome.UNDER_CAP,
                entries=len(usages),
                total_bytes_before=before,
                total_bytes_after=before,
                leftovers_removed=tuple(leftovers),
            )
        refs: CacheReferences = snapshot_object_cache_references(state_dir)
        pending = iter(usages)
        while run.total > max_bytes:
            if should_stop():
                raise _Stopped
            # The next candidates, enough to reach the cap if all are evicted.
            batch: list[CacheEntryUsage] = []
            need = run.total - max_bytes
            for usage in pending:
                if usage.key in refs:
                    detail = ", ".join(refs.referrers(usage.key))
                    run.skipped.append(SkippedEntry(usage.key, SkipReason.REFERENCED, detail))
                    continue
                batch.append(usage)
                need -= usage.total_bytes
                if need <= 0 or len(batch) == _BATCH:
                    break
            if not batch:
                break
            _retire_batch(run, batch)
        outcome, error = PruneOutcome.COMPLETED, None
    except CacheReferenceError as exc:
        outcome, error = PruneOutcome.ABORTED, str(exc)
    except _Stopped:
        outcome, error = PruneOutcome.CANCELLED, None
    return report(
        outcome,
        entries=len(usages),
        total_bytes_before=before,
        total_bytes_after=run.total,
        evicted=tuple(run.evicted),
        skipped=tuple(run.skipped),
        stale_pins_removed=tuple(run.stale_pins),
        leftovers_removed=tuple(leftovers),
        error=error,
    )


# --- entry points ------------------------------------------------------------------


def _sweep_for(state_dir: Path, sweep: SnapshotObjectCacheSweep | None) -> SnapshotObjectCacheSweep:
    return sweep if sweep is not None else SnapshotObjectCacheSweep.for_state_dir(state_dir)


def _trivial(state_dir: Path, max_bytes: int, dry_run: bool) -> PruneReport | None:
    if max_bytes < 0:
        raise PreloopError(f"cache prune of {state_dir}: max_bytes must be >= 0, got {max_bytes}")
    if max_bytes == 0:
        return PruneReport(Path(state_dir), PruneOutcome.DISABLED, 0, dry_run=dry_run)
    return None


async def _prune_owned(
    permit: SweepPermit,
    state_dir: Path,
    max_bytes: int,
    dry_run: bool,
    hooks: PruneHooks,
) -> PruneReport:
    job = _DetachableJob(
        permit.hold(), functools.partial(_prune_pass, state_dir, max_bytes, dry_run, hooks)
    )
    try:
        return await anyio.to_thread.run_sync(job.run, abandon_on_cancel=True)
    finally:
        job.abandon()


async def prune_snapshot_object_cache(
    state_dir: Path,
    max_bytes: int,
    sweep: SnapshotObjectCacheSweep | None = None,
    *,
    dry_run: bool = False,
    hooks: PruneHooks = _NO_HOOKS,
) -> PruneReport:
    """Evicts least recently used, unused entries of `<state_dir>/snapshot-object-cache`
    until its total is at most `max_bytes` (0 disables). See the module docstring.

    `sweep` is the single-flight guard (default: the process-wide guard of
    `state_dir`); while another prune owns it this returns at once with outcome
    `COALESCED`. The walk and removals run in a worker thread; cancelling the
    caller stops them at the next entry, and the guard stays owned until the
    thread is done. With `dry_run` nothing is removed (locks are still tried and
    pins and references checked, so the report says what a real run would do).
    Fail-closed aborts are reported (outcome `ABORTED`, `error`), not raised."""
    trivial = _trivial(state_dir, max_bytes, dry_run)
    if trivial is not None:
        return trivial
    permit = _sweep_for(state_dir, sweep).try_acquire()
    if permit is None:
        return PruneReport(Path(state_dir), PruneOutcome.COALESCED, max_bytes, dry_run=dry_run)
    try:
        return await _prune_owned(permit, state_dir, max_bytes, dry_run, hooks)
    finally:
        permit.release()


def prune_snapshot_object_cache_sync(
    state_dir: Path,
    max_bytes: int,
    sweep: SnapshotObjectCacheSweep | None = None,
    *,
    dry_run: bool = False,
    hooks: PruneHooks = _NO_HOOKS,
) -> PruneReport:
    """`prune_snapshot_object_cache` for synchronous callers (runs in this thread)."""
    trivial = _trivial(state_dir, max_bytes, dry_run)
    if trivial is not None:
        return trivial
    permit = _sweep_for(state_dir, sweep).try_acquire()
    if permit is None:
        return PruneReport(Path(state_dir), PruneOutcome.COALESCED, max_bytes, dry_run=dry_run)
    try:
        return _prune_pass(Path(state_dir), max_bytes, dry_run, hooks, lambda: False)
    finally:
        permit.release()


def _log_report(report: PruneReport, why: str) -> None:
    if report.outcome is PruneOutcome.ABORTED:
        _log.warning("%s object-cache prune of %s aborted: %s", why, report.state_dir, report.error)
    elif report.evicted:
        _log.info(
            "%s object-cache prune of %s reclaimed %d bytes from %d entries",
            why,
            report.state_dir,
            report.reclaimed_bytes,
            len(report.evicted),
        )


def start_object_cache_prune(
    task_group: anyio.abc.TaskGroup,
    state_dir: Path,
    max_bytes: int | None = None,
    sweep: SnapshotObjectCacheSweep | None = None,
    *,
    hooks: PruneHooks = _NO_HOOKS,
    on_done: Callable[[PruneReport], None] | None = None,
) -> bool:
    """Starts a best-effort prune in `task_group` (the startup run, beside
    `sweep_workspace_snapshots`). The permit is taken *before* the task is
    started, so a task cancelled before it first runs cannot wedge the guard.
    False when the request was dropped because a prune is already running (or
    the cap is 0). `max_bytes` defaults to the knob. Errors are logged."""
    limit = object_cache_max_bytes() if max_bytes is None else max_bytes
    if _trivial(state_dir, limit, False) is not None:
        return False
    permit = _sweep_for(state_dir, sweep).try_acquire()
    if permit is None:
        return False

    async def owned() -> None:
        try:
            report = await _prune_owned(permit, state_dir, limit, False, hooks)
            _log_report(report, "background")
            if on_done is not None:
                on_done(report)
        except Exception:
            _log.warning("object-cache prune of %s failed", state_dir, exc_info=True)
        finally:
            permit.release()

    coro = owned()
    # A coroutine that is closed without ever running skips its `finally`.
    weakref.finalize(coro, permit.release)

    def task() -> Coroutine[Any, Any, None]:
        return coro

    task_group.start_soon(task, name=f"object-cache prune {state_dir}")
    return True


async def startup_snapshot_maintenance(
    state_dir: Path,
    task_group: anyio.abc.TaskGroup,
    max_bytes: int | None = None,
    sweep: SnapshotObjectCacheSweep | None = None,
    *,
    on_done: Callable[[PruneReport], None] | None = None,
) -> tuple[SweepReport, bool]:
    """Startup: `sweep_workspace_snapshots` first (in a worker thread), because
    removing the leftovers of dead captures drops their references and lets the
    prune reclaim what only they used; then the object-cache prune is started in
    `task_group` (`start_object_cache_prune`). Returns the sweep report and
    whether the prune was started."""
    report = await anyio.to_thread.run_sync(sweep_workspace_snapshots, Path(state_dir))
    started = start_object_cache_prune(task_group, state_dir, max_bytes, sweep, on_done=on_done)
    return report, started


def request_object_cache_prune(
    state_dir: Path,
    max_bytes: int | None = None,
    sweep: SnapshotObjectCacheSweep | None = None,
    *,
    hooks: PruneHooks = _NO_HOOKS,
) -> threading.Thread | None:
    """Starts a best-effort prune in a background thread and returns it, or None
    when the request was dropped (a prune of this state directory is running,
    or the cap is 0). The permit is taken before the thread starts."""
    limit = object_cache_max_bytes() if max_bytes is None else max_bytes
    if _trivial(state_dir, limit, False) is not None:
        return None
    permit = _sweep_for(state_dir, sweep).try_acquire()
    if permit is None:
        return None

    def body() -> None:
        try:
            _log_report(_prune_pass(Path(state_dir), limit, False, hooks, lambda: False), "post")
        except Exception:
            _log.warning("object-cache prune of %s failed", state_dir, exc_info=True)
        finally:
            permit.release()

    # A daemon thread does not hold up the exit of a short-lived process: the
    # prune is crash safe (see the module docstring), so dying mid-way is fine.
    thread = threading.Thread(target=body, name=f"object-cache prune {state_dir}", daemon=True)
    try:
        thread.start()
    except BaseException:
        permit.release()
        raise
    return thread


def prune_after_capture(state_dir: Path, cache_key: str) -> None:
    """Post-capture hook (`preloop.snapshot.hooks`): runs after each successful
    capture, outside the cache lock. It records the use of entry `cache_key`
    (touches `<key>.last-head`) and requests a background prune; a prune
    already running absorbs the request."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(layout.cache_last_head_path(state_dir, cache_key))
    if layout.cache_dir(state_dir).is_dir():
        try:
            request_object_cache_prune(state_dir)
        except ConfigError as exc:
            # One line, no traceback: `preloop run` reports this at start.
            _log.warning("object-cache prune after the capture skipped: %s", exc)


register_after_capture(prune_after_capture)
