"""Who holds a run repository after its capture: `<state>/snapshots/.holders/<run_id>.owner`.

A capture's own owner marker (`.staging/<run_id>-<nonce>.owner`) is removed
when the capture is accepted; from then on the run repository belongs to the
process that runs the run (`preloop run`), which removes it when the run ends.
A process killed after the capture and before the run's cleanup (between
capture and submit, or between the run's end and the removal) used to leave
the repository behind for good, and its `objects/info/alternates` kept the
cache entry it borrows from out of eviction forever.

So the process that will own the repository writes a holder marker (pid,
process start time and host, `preloop.snapshot.owner`) *before* the capture
starts, and removes it *after* the repository (`release_run_repository`).
`sweep_abandoned_run_repositories` removes the repository and the marker when
the holder is dead (same host; pid and start time no longer match) and no
unfinished run the caller knows of uses it: a same-host `preloop runner` may
still be running a dead submitter's run from it. A process with a store at
hand (`preloop run`) says which with `keep_run_repositories` before it
sweeps, and every sweep of that state directory in the process (the
post-capture prune's too) keeps them. It runs in `preloop sweep`, at
`preloop run` start (`sweep_workspace_snapshots`) and at the start of every
object-cache prune, so the prune then evicts the entry. Run repositories
without a holder marker (`preloop snapshot`) are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from collections.abc import Collection
from pathlib import Path

from preloop.snapshot import layout
from preloop.snapshot.owner import read_marker, write_marker

__all__ = [
    "HOLDERS_DIR_NAME",
    "hold_run_repository",
    "holder_marker_path",
    "keep_run_repositories",
    "release_run_repository",
    "sweep_abandoned_run_repositories",
]

HOLDERS_DIR_NAME = ".holders"
_SUFFIX = ".owner"


def holders_dir(state_dir: Path) -> Path:
    return layout.snapshots_dir(Path(state_dir)) / HOLDERS_DIR_NAME


def holder_marker_path(state_dir: Path, run_id: str) -> Path:
    return holders_dir(state_dir) / f"{layout.validate_run_id(run_id)}{_SUFFIX}"


def hold_run_repository(state_dir: Path, run_id: str) -> Path:
    """Records this process as the holder of `snapshots/<run_id>` (call before
    capturing it). Returns the marker's path."""
    path = holder_marker_path(state_dir, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_marker(path, {"run_id": run_id, "host": socket.gethostname()})
    return path


def release_run_repository(state_dir: Path, run_id: str) -> None:
    """Removes `snapshots/<run_id>`, then its holder marker (in that order: a
    crash in between leaves a dead holder, which the sweep finishes)."""
    shutil.rmtree(layout.run_repository(Path(state_dir), run_id), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        holder_marker_path(state_dir, run_id).unlink()


# Run ids that sweeps in this process keep, by absolute state directory.
_kept: dict[Path, frozenset[str]] = {}
_kept_lock = threading.Lock()


def keep_run_repositories(state_dir: Path, run_ids: Collection[str]) -> None:
    """From now on, sweeps of `state_dir` in this process keep the run
    repositories `run_ids` (those unfinished runs in the caller's store
    reference) although their holder died. Replaces what an earlier call gave."""
    with _kept_lock:
        _kept[Path(state_dir).absolute()] = frozenset(run_ids)


def sweep_abandoned_run_repositories(
    state_dir: Path, in_use: Collection[str] = ()
) -> tuple[list[Path], list[str]]:
    """Removes run repositories whose holder died on this host, unless their
    run id is in `in_use` or was given to `keep_run_repositories` (unfinished
    runs a caller with a store knows of). Returns (removed paths, errors)."""
    state_dir = Path(state_dir).absolute()
    with _kept_lock:
        in_use = set(in_use) | _kept.get(state_dir, frozenset())
    root = holders_dir(state_dir)
    removed: list[Path] = []
    errors: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed, errors
    except OSError as exc:
        return removed, [f"cannot list {root}: {exc.strerror or exc}"]
    host = socket.gethostname()
    for name in names:
        marker = root / name
        if name.startswith(".") and name.endswith(".tmp"):
            continue  # a marker being written (or a crash mid-write: tiny, harmless)
        if not name.endswith(_SUFFIX):
            continue
        run_id = name[: -len(_SUFFIX)]
        try:
            found = read_marker(marker)
        except (ValueError, OSError) as exc:
            errors.append(f"kept the run repository of {run_id}: unreadable holder: {exc}")
            continue
        if found is None:
            continue  # released meanwhile
        owner, document = found
        if document.get("host", host) != host or owner.is_alive() or run_id in in_use:
            continue
        try:
            repo = layout.run_repository(state_dir, run_id)
        except Exception as exc:  # a foreign name in the holders directory
            errors.append(f"ignored holder {marker}: {exc}")
            continue
        try:
            shutil.rmtree(repo)
            removed.append(repo)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(f"cannot remove {repo}: {exc.strerror or exc}")
            continue
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
            removed.append(marker)
    return removed, errors
