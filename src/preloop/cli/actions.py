"""`preloop actions list|prune`: the action cache (<state>/actions)."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from preloop import config
from preloop.actions.cache import actions_dir, list_cached_actions, prune_actions
from preloop.cli.app import cli, emit_json, state_dir_option
from preloop.cli.cache import _human
from preloop.errors import UsageError


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat(timespec="seconds")


@cli.group("actions")
def actions_group() -> None:
    """The action cache: remote actions fetched for `uses: owner/repo@ref`.

    Entries live in <state>/actions/repos/<owner>/<repo>/<commit>, fetched
    from $PRELOOP_ACTIONS_URL (default https://github.com).
    """


@actions_group.command("list")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def list_command(state_dir: Path | None, as_json: bool) -> None:
    """Cached actions: repository, commit, the refs that resolved to it, size, last use."""
    state = state_dir if state_dir is not None else config.state_dir()
    entries = list_cached_actions(state)
    if as_json:
        emit_json(
            {
                "state_dir": str(state),
                "actions_dir": str(actions_dir(state)),
                "total_bytes": sum(e.bytes for e in entries),
                "entries": [
                    {
                        "repository": f"{e.owner}/{e.repo}",
                        "commit": e.commit,
                        "refs": list(e.refs),
                        "bytes": e.bytes,
                        "last_use": _iso(e.last_use),
                        "path": str(e.path),
                    }
                    for e in entries
                ],
            }
        )
        return
    console = Console(file=sys.stdout, soft_wrap=True, highlight=False)
    if entries:
        table = Table("repository", "commit", "refs", "bytes", "last use (UTC)", box=None)
        for e in entries:
            table.add_row(
                f"{e.owner}/{e.repo}",
                e.commit[:12],
                ", ".join(e.refs) or "-",
                _human(e.bytes),
                _iso(e.last_use),
            )
        console.print(table)
    total = sum(e.bytes for e in entries)
    console.print(f"{len(entries)} actions, {_human(total)} in {actions_dir(state)}")


@actions_group.command("prune")
@state_dir_option
@click.option(
    "--older-than",
    default="30",
    show_default=True,
    metavar="DAYS",
    help="Remove actions not used for this many days (0: every action).",
)
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def prune_command(state_dir: Path | None, older_than: str, dry_run: bool, as_json: bool) -> None:
    """Remove cached actions unused for --older-than days.

    An action a running job is using, or being fetched right now, is kept;
    the next run fetches a removed action again.
    """
    try:
        days = float(older_than)
        if days < 0:
            raise ValueError
    except ValueError:
        raise UsageError(
            f"--older-than: expected a number of days >= 0, got {older_than!r}"
        ) from None
    state = state_dir if state_dir is not None else config.state_dir()
    removed, busy = prune_actions(state, older_than=days * 86400.0, dry_run=dry_run)
    if as_json:
        emit_json(
            {
                "state_dir": str(state),
                "dry_run": dry_run,
                "removed": [
                    {"repository": f"{e.owner}/{e.repo}", "commit": e.commit, "bytes": e.bytes}
                    for e in removed
                ],
                "busy": [{"repository": f"{e.owner}/{e.repo}", "commit": e.commit} for e in busy],
                "reclaimed_bytes": sum(e.bytes for e in removed),
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    for e in removed:
        click.echo(f"{verb} {e.owner}/{e.repo}@{e.commit[:12]} ({_human(e.bytes)})")
    for e in busy:
        click.echo(f"kept {e.owner}/{e.repo}@{e.commit[:12]}: in use or being fetched")
    click.echo(f"{verb} {len(removed)} actions, {_human(sum(e.bytes for e in removed))}")
