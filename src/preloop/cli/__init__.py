"""The `preloop` command. Each command group lives in its own module here and
registers itself on `cli` when imported; `preloop.cli.commands.COMMANDS` says
which module defines which command, so only the command that runs is imported.

`preloop --version` is answered before click is imported: it is what scripts and
shells run most to probe for the tool. So is a plain `preloop du [--json]
[--cross-filesystems] PATH` (`preloop.cli.du_report`), measured against `du -sb`.
"""

from __future__ import annotations

import sys

__all__ = ["cli", "main"]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (see `preloop.cli.app.main`)."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["--version"], ["-V"]):
        from preloop import version

        sys.stdout.write(f"preloop, version {version()}\n")
        sys.exit(0)
    if args[:1] == ["du"]:
        from preloop.cli.du_report import fast_du

        code = fast_du(args[1:])
        if code is not None:
            sys.exit(code)
    from preloop.cli.app import main as run_main

    run_main(argv)


def __getattr__(name: str) -> object:
    if name == "cli":
        from preloop.cli.app import cli

        return cli
    raise AttributeError(f"module 'preloop.cli' has no attribute {name!r}")
