"""Every top-level `preloop` command and the module that defines it.

The group imports a command's module only when that command runs (or when help
lists the commands), so `preloop --version` and `preloop du` do not pay for the
scheduler, the workflow loader and rich. A module registers its commands on
`preloop.cli.app.cli` with `@cli.command(...)`/`@cli.group(...)` as usual.

Adding a command is one line here: its name and its module.
"""

from __future__ import annotations

__all__ = ["COMMANDS"]

COMMANDS: dict[str, str] = {
    "actions": "preloop.cli.actions",
    "artifacts": "preloop.cli.services",
    "cache": "preloop.cli.cache",
    "cancel": "preloop.cli.runs",
    "config": "preloop.cli.config_cmd",
    "du": "preloop.cli.du",
    "fingerprint": "preloop.cli.fingerprint",
    "hook": "preloop.cli.hook",
    "list": "preloop.cli.listing",
    "logs": "preloop.cli.runs",
    "plan": "preloop.cli.plan",
    "rerun": "preloop.cli.run",
    "run": "preloop.cli.run",
    "runner": "preloop.cli.runner",
    "snapshot": "preloop.cli.snapshot",
    "status": "preloop.cli.runs",
    "sweep": "preloop.cli.snapshot",
    "toolcache": "preloop.cli.services",
}
