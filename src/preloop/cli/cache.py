"""`preloop cache status|prune`: the shared snapshot object cache and its byte cap."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from preloop import config
from preloop.actions.cache import actions_dir, list_cached_actions
from preloop.cli.app import cli, emit_json, fail, make_console, plural, state_dir_option
from preloop.cli.services import actions_cache_document, print_actions_cache, store_option
from preloop.errors import UsageError
from preloop.snapshot import layout
from preloop.snapshot.prune import (
    MAX_BYTES_KNOB,
    PruneOutcome,
    PruneReport,
    measure_object_cache,
    object_cache_max_bytes,
    prune_snapshot_object_cache_sync,
)
from preloop.snapshot.references import CacheReferenceError, snapshot_object_cache_references


def _state_dir(value: Path | None) -> Path:
    return value if value is not None else config.state_dir()


def _iso(ns: int) -> str | None:
    if ns <= 0:
        return None
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).isoformat(timespec="seconds")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@cli.group("cache")
def cache_group() -> None:
    """The shared snapshot object cache (<state>/snapshot-object-cache); `status`
    also shows the actions cache (actions/cache entries, <state>/actions-cache).

    Entries are <key>.git with their .last-head and .index sidecars. The cap is
    PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES (default 100GiB, 0 disables).
    """


@cache_group.command("status")
@state_dir_option
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def status_command(state_dir: Path | None, store: str | None, as_json: bool) -> None:
    """Entries, sizes, pins, referencing runs and last use, oldest first."""
    config.validate()  # a bad PRELOOP_* value: exit 2 before reading anything
    state = _state_dir(state_dir)
    cap = object_cache_max_bytes()
    try:
        usages = measure_object_cache(state)
    except CacheReferenceError as exc:
        fail(str(exc))
    try:
        refs: dict[str, tuple[str, ...]] | None = snapshot_object_cache_references(state).by_key
        refs_error = None
    except CacheReferenceError as exc:
        refs, refs_error = None, str(exc)
    total = sum(u.total_bytes for u in usages)
    cached_actions = list_cached_actions(state)
    actions: dict[str, Any] = {
        "dir": str(actions_dir(state)),
        "entries": len(cached_actions),
        "total_bytes": sum(a.bytes for a in cached_actions),
    }
    entries: list[dict[str, Any]] = [
        {
            "key": u.key,
            "total_bytes": u.total_bytes,
            "repository_bytes": u.repository_bytes,
            "last_head_bytes": u.last_head_bytes,
            "index_bytes": u.index_bytes,
            "last_use": _iso(u.last_use_ns),
            "pins": [p.removeprefix(layout.cache_pin_prefix(u.key)) for p in u.pins],
            "referenced_by": None if refs is None else list(refs.get(u.key, ())),
        }
        for u in usages
    ]
    if as_json:
        emit_json(
            {
                "state_dir": str(state),
                "cache_dir": str(layout.cache_dir(state)),
                "max_bytes": cap,
                "total_bytes": total,
                "entries": entries,
                "references_error": refs_error,
                "actions": actions,
                "actions_cache": actions_cache_document(state, store),
            }
        )
        return
    console = make_console(file=sys.stdout)
    table = Table("key", "bytes", "last use (UTC)", "pins", "referenced by", box=None)
    for e in entries:
        referrers = "?" if e["referenced_by"] is None else ", ".join(e["referenced_by"]) or "-"
        table.add_row(
            e["key"],
            _human(e["total_bytes"]),
            e["last_use"] or "-",
            str(len(e["pins"])) if e["pins"] else "-",
            referrers,
        )
    if entries:
        console.print(table)
    cap_text = "disabled" if cap == 0 else _human(cap)
    console.print(
        f"{plural(len(entries), 'entry', 'entries')}, {_human(total)} in "
        f"{layout.cache_dir(state)} (cap {cap_text})",
        highlight=False,
    )
    if refs_error:
        console.print(f"references unknown: {refs_error}", highlight=False)
    console.print(
        f"action cache: {actions['entries']} actions, {_human(actions['total_bytes'])} in "
        f"{actions['dir']} (`preloop actions list`)",
        highlight=False,
    )
    print_actions_cache(console, actions_cache_document(state, store))


def _report_document(report: PruneReport) -> dict[str, Any]:
    return {
        "state_dir": str(report.state_dir),
        "outcome": report.outcome.value,
        "dry_run": report.dry_run,
        "max_bytes": report.max_bytes,
        "entries": report.entries,
        "total_bytes_before": report.total_bytes_before,
        "total_bytes_after": report.total_bytes_after,
        "reclaimed_bytes": report.reclaimed_bytes,
        "evicted": [
            {
                "key": e.key,
                "size_bytes": e.size_bytes,
                "removed_bytes": e.removed_bytes,
                "partial": e.partial,
                "error": e.error,
            }
            for e in report.evicted
        ],
        "skipped": [
            {"key": s.key, "reason": s.reason.value, "detail": s.detail} for s in report.skipped
        ],
        "stale_pins_removed": list(report.stale_pins_removed),
        "leftovers_removed": list(report.leftovers_removed),
        "error": report.error,
    }


@cache_group.command("prune")
@state_dir_option
@click.option(
    "--max-bytes",
    "max_bytes_raw",
    metavar="N",
    help=f"Cap for this run, e.g. 50GiB or 1073741824 (default: ${MAX_BYTES_KNOB}); 0 disables.",
)
@click.option("--dry-run", is_flag=True, help="Report what would be evicted; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def prune_command(
    state_dir: Path | None, max_bytes_raw: str | None, dry_run: bool, as_json: bool
) -> None:
    """Evict least recently used, unused entries until the cache is under the cap.

    Busy (locked), pinned and referenced entries are never removed. Anything
    unreadable in the snapshots makes the prune remove nothing and exit 1.
    """
    if max_bytes_raw is None:  # (--max-bytes stands in for the cap knob)
        config.validate()  # a bad PRELOOP_* value: exit 2 before reading anything
    state = _state_dir(state_dir)
    if max_bytes_raw is None:
        cap = object_cache_max_bytes()
    else:
        try:
            cap = config.parse_bytes(max_bytes_raw)
        except ValueError as exc:
            raise UsageError(f"--max-bytes: {exc}") from None
    report = prune_snapshot_object_cache_sync(state, cap, dry_run=dry_run)
    if as_json:
        emit_json(_report_document(report))
    else:
        verb = "would evict" if dry_run else "evicted"
        for e in report.evicted:
            note = f" (partial: {e.error})" if e.partial else ""
            click.echo(f"{verb} {e.key}: {_human(e.removed_bytes)}{note}")
        for s in report.skipped:
            click.echo(f"kept {s.key}: {s.reason.value}" + (f" ({s.detail})" if s.detail else ""))
        for name in report.stale_pins_removed:
            click.echo(f"{'would remove' if dry_run else 'removed'} stale pin {name}")
        if report.outcome is PruneOutcome.DISABLED:
            click.echo("cache cap is 0: pruning is disabled")
        elif report.outcome is not PruneOutcome.ABORTED:
            click.echo(
                f"{report.outcome.value}: {_human(report.total_bytes_before)} -> "
                f"{_human(report.total_bytes_after)} (cap {_human(cap)}), "
                f"{_human(report.reclaimed_bytes)} {'reclaimable' if dry_run else 'reclaimed'}"
            )
    if report.outcome is PruneOutcome.ABORTED:
        if as_json:
            sys.exit(1)
        fail(report.error or "cache prune aborted")
    if report.outcome is PruneOutcome.COALESCED:
        fail(f"another cache prune of {state} is running in this process; nothing done")
