"""The `preloop` command. Each command group lives in its own module here and
registers itself on `cli` when imported below."""

from preloop.cli import config_cmd, du, plan  # noqa: F401  (registration)
from preloop.cli.app import cli, main

__all__ = ["cli", "main"]
