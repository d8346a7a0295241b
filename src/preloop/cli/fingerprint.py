"""`preloop fingerprint`: a host-capped native fingerprint from the command line."""

from __future__ import annotations

from pathlib import Path

import click

from preloop.cli.app import cli, emit_json
from preloop.fingerprint import fingerprint


@cli.command("fingerprint")
@click.argument("roots", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--mode",
    type=click.Choice(["content", "metadata"]),
    default="content",
    show_default=True,
    help="content hashes every file's bytes; metadata reads no file (kind, path, mode, "
    "size, mtime).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def fingerprint_command(roots: tuple[Path, ...], mode: str, as_json: bool) -> None:
    """Fingerprint of the trees (or files) at ROOT..., in format v1.

    Prints `digest <64 hex>` over all roots, then one `root <64 hex> <path>` line per
    resolved root. Waits for a host slot when 4 walks already run on this machine.
    """
    result = fingerprint(roots, mode="metadata" if mode == "metadata" else "content")
    if as_json:
        emit_json(
            {
                "digest": result.digest,
                "mode": result.mode,
                "files": result.files,
                "bytes": result.bytes,
                "roots": dict(result.roots),
            }
        )
        return
    click.echo(f"digest {result.digest}")
    for root, digest in result.roots.items():
        click.echo(f"root {digest} {root}")
