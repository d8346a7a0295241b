"""`preloop du`: the native byte walker from the command line."""

from __future__ import annotations

from dataclasses import asdict

import click

from preloop.cli.app import cli, emit_json, fail
from preloop.fs import tree_bytes


@cli.command("du")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option(
    "--cross-filesystems",
    is_flag=True,
    help="Descend into other filesystems mounted below PATH (default: stay on one, like du -x).",
)
def du_command(path: str, as_json: bool, cross_filesystems: bool) -> None:
    """Size of the tree at PATH, counted like `du`.

    Apparent bytes match `du -sb`, allocated bytes `du -s --block-size=1`;
    symlinks are not followed and hard-linked files count once.
    """
    try:
        size = tree_bytes(path, one_file_system=not cross_filesystems)
    except OSError as exc:
        fail(f"cannot size {exc.filename or path}: {exc.strerror or exc}")
    if as_json:
        emit_json({"path": path, **asdict(size)})
        return
    click.echo(
        f"{size.apparent_bytes}\tapparent bytes\n"
        f"{size.allocated_bytes}\tallocated bytes\n"
        f"{size.files}\tfiles\n{size.dirs}\tdirs\n{size.symlinks}\tsymlinks\n"
        f"{path}"
    )
