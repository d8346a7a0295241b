"""`preloop du`: the native byte walker from the command line."""

from __future__ import annotations

import sys

import click

from preloop.cli.app import cli
from preloop.cli.du_report import du_report


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
    code, text = du_report(path, as_json=as_json, cross_filesystems=cross_filesystems)
    if code:
        click.echo(text, nl=False, err=True)
        sys.exit(code)
    click.echo(text, nl=False)
