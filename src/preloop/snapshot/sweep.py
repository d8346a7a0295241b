"""Startup sweep of run-scoped leftovers: staging directories
(`snapshots/.staging/<run_id>-<nonce>`) and unaccepted run repositories
(`snapshots/<run_id>`) that no live capture owns, plus interrupted first clones
in the object cache, and run repositories whose holder (the `preloop run`
that captured them) died before removing them (`preloop.snapshot.holders`).
A live capture's files are never touched.

Ownership is the owner marker `<run_id>-<nonce>.owner` (pid + process start
time). It is written before the staging directory and removed after it, so a
staging directory without a marker is an orphan. A marker whose process is gone
means that capture never finished: its staging directory and the run repository
it reserved or published are removed, then the marker. Captures of this very
process are recognised through the in-process registry of live captures.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from preloop.snapshot import layout
from preloop.snapshot.capture import CAPTURE_FILE
from preloop.snapshot.holders import sweep_abandoned_run_repositories
from preloop.snapshot.locks import try_acquire_cache_lock
from preloop.snapshot.owner import ProcessIdentity, read_marker
from preloop.snapshot.work import is_live

__all__ = ["SweepReport", "sweep_workspace_snapshots"]


@dataclass
class SweepReport:
    """What a sweep removed, what it kept because a live capture owns it, and
    what it could not decide or remove (each with the reason)."""

    removed: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _owner_is_live(owner: ProcessIdentity, staging_name: str) -> bool:
    if owner.pid == os.getpid() and owner == ProcessIdentity.current():
        return is_live(staging_name)
    return owner.is_alive()


def _remove(path: Path, report: SweepReport) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return True
    except OSError as exc:
        report.errors.append(f"cannot remove {path}: {exc.strerror or exc}")
        return False
    report.removed.append(path)
    return True


def _published_by(run_repo: Path, nonce: str) -> bool | None:
    """True if `run_repo` was published by capture `nonce`; None if it is an
    empty reservation; False otherwise."""
    try:
        return (run_repo / CAPTURE_FILE).read_text().strip() == nonce
    except FileNotFoundError:
        try:
            return None if not any(run_repo.iterdir()) else False
        except FileNotFoundError:
            return False


def sweep_workspace_snapshots(state_dir: Path) -> SweepReport:
    """Removes capture leftovers under `state_dir` that no live capture owns."""
    report = SweepReport()
    state_dir = Path(state_dir).absolute()
    staging_root = layout.staging_dir(state_dir)
    try:
        names = os.listdir(staging_root)
    except FileNotFoundError:
        names = []
    entries = [(n, layout.parse_staging_name(n)) for n in names]
    markers = {p.staging_name: n for n, p in entries if p is not None and p.is_owner_marker}
    live_runs: set[str] = set()
    dead: list[tuple[str, str, str]] = []  # (staging name, run id, nonce)
    for staging_name, marker_name in markers.items():
        parsed = layout.parse_staging_name(staging_name)
        assert parsed is not None
        try:
            found = read_marker(staging_root / marker_name)
        except (ValueError, OSError) as exc:
            report.errors.append(f"kept {staging_root / staging_name}: unreadable marker: {exc}")
            live_runs.add(parsed.run_id)
            continue
        if found is None:
            continue  # removed meanwhile: the capture finished
        if _owner_is_live(found[0], staging_name):
            live_runs.add(parsed.run_id)
            report.kept.append(staging_root / staging_name)
        else:
            dead.append((staging_name, parsed.run_id, parsed.nonce))

    for staging_name, run_id, nonce in dead:
        run_repo = layout.run_repository(state_dir, run_id)
        published = _published_by(run_repo, nonce)
        ok = _remove(staging_root / staging_name, report)
        if published or (published is None and run_id not in live_runs):
            ok = _remove(run_repo, report) and ok
        if ok:
            _remove(staging_root / markers[staging_name], report)

    for name, parsed in entries:
        if parsed is None:
            # A marker's temporary from a crash mid-write: `.<name>.<hex>.tmp`.
            if name.startswith(".") and name.endswith(".tmp"):
                _remove(staging_root / name, report)
            continue
        if parsed.is_owner_marker or name in markers:
            continue
        # No marker was ever written for it or the marker is already gone; the
        # marker is written first and removed last, so check again right
        # before removing.
        if not (staging_root / f"{name}.owner").exists():
            _remove(staging_root / name, report)

    _sweep_cache_temporaries(state_dir, report)
    # Run repositories whose `preloop run` died after the capture
    # (`preloop.snapshot.holders`).
    removed, errors = sweep_abandoned_run_repositories(state_dir)
    report.removed.extend(removed)
    report.errors.extend(errors)
    return report


def _sweep_cache_temporaries(state_dir: Path, report: SweepReport) -> None:
    cache = layout.cache_dir(state_dir)
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return
    by_key: dict[str, list[str]] = {}
    for name in names:
        parsed = layout.parse_cache_entry_name(name)
        if parsed is not None and parsed.kind == "tmp":
            by_key.setdefault(parsed.key, []).append(name)
    for key, temporaries in by_key.items():
        # First clones run under the entry's lock: when it is free, any
        # temporary of that key is an interrupted clone.
        lock = try_acquire_cache_lock(state_dir, key)
        if lock is None:
            report.kept.extend(cache / n for n in temporaries)
            continue
        with lock, contextlib.suppress(FileNotFoundError):
            for name in temporaries:
                _remove(cache / name, report)
