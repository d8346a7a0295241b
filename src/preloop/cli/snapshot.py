"""`preloop snapshot` and `preloop sweep`: workspace capture and the startup
sweep of capture leftovers from the command line."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import click

from preloop import config
from preloop.cli.app import cli, emit_json
from preloop.snapshot import capture_workspace, sweep_workspace_snapshots


def _state_dir(value: Path | None) -> Path:
    return value if value is not None else config.state_dir()


@cli.command("snapshot")
@click.argument(
    "path", type=click.Path(path_type=Path, file_okay=False), default=".", required=False
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="State directory (default: $PRELOOP_STATE_DIR).",
)
@click.option("--run-id", help="Run id (default: a new random id).")
@click.option("--namespace", help="Namespace (tenant) of the capture (default: origin's owner).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def snapshot_command(
    path: Path, state_dir: Path | None, run_id: str | None, namespace: str | None, as_json: bool
) -> None:
    """Capture the work tree at PATH (default: the current directory).

    The snapshot holds what `git add -A` would stage (staged, unstaged and
    untracked-not-ignored files) and leaves the repository untouched. Prints the
    run id, the run repository and the snapshot commit.
    """
    config.validate()  # a bad PRELOOP_* value (the cache cap): exit 2 before capturing
    state = _state_dir(state_dir)
    run = run_id or uuid.uuid4().hex
    snap = anyio.run(lambda: capture_workspace(state, path, run, namespace=namespace))
    if as_json:
        emit_json(
            {
                "run_id": snap.run_id,
                "repository": str(snap.repository),
                "commit": snap.commit,
                "tree": snap.tree,
                "parents": list(snap.parents),
                "ref": snap.ref,
                "namespace": snap.namespace,
                "cache_key": snap.cache_key,
            }
        )
        return
    click.echo(f"run        {snap.run_id}\nrepository {snap.repository}\ncommit     {snap.commit}")


@cli.command("sweep")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="State directory (default: $PRELOOP_STATE_DIR).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def sweep_command(state_dir: Path | None, as_json: bool) -> None:
    """Remove leftovers of captures that crashed or timed out (never a live one's)."""
    config.validate()
    report = sweep_workspace_snapshots(_state_dir(state_dir))
    if as_json:
        emit_json(
            {
                "removed": [str(p) for p in report.removed],
                "kept": [str(p) for p in report.kept],
                "errors": report.errors,
            }
        )
    else:
        for p in report.removed:
            click.echo(f"removed {p}")
        for p in report.kept:
            click.echo(f"kept    {p} (live capture)")
        click.echo(f"{len(report.removed)} removed, {len(report.kept)} kept")
    for error in report.errors:
        click.echo(f"preloop: warning: {error}", err=True)
    if report.errors:
        raise SystemExit(1)
