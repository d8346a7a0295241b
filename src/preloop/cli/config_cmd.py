"""`preloop config`: every PRELOOP_* knob, its value here and what it does."""

from __future__ import annotations

import os

import click
from rich.table import Table

from preloop import config
from preloop.cli.app import cli, emit_json, make_console


@cli.command("config")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def config_command(as_json: bool) -> None:
    """List every PRELOOP_* setting with its effective value and source."""
    rows = []
    for knob in config.KNOBS.values():
        rows.append(
            {
                "name": knob.name,
                "value": str(config.get(knob.name)),
                "source": "environment" if knob.name in os.environ else "default",
                "doc": knob.doc,
            }
        )
    if as_json:
        emit_json(rows)
        return
    table = Table("setting", "value", "source", "meaning")
    for row in rows:
        table.add_row(row["name"], row["value"], row["source"], row["doc"])
    make_console().print(table)
