"""The `preloop` command. Each command group lives in its own module here and
registers itself on `cli` when imported below."""

from preloop.cli import (  # noqa: F401  (registration)
    actions,
    cache,
    config_cmd,
    du,
    hook,
    listing,
    plan,
    run,
    runner,
    runs,
    services,
    snapshot,
)
from preloop.cli import fingerprint as _fingerprint  # noqa: F401  (registration)
from preloop.cli.app import cli, main

__all__ = ["cli", "main"]
