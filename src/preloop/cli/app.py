"""The `preloop` click group and the one place user errors become one line + exit code."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from preloop.errors import PreloopError

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["cli", "emit_json", "fail", "main", "make_console", "plural", "state_dir_option"]

#: Width of output that is not a terminal: lines are never wrapped or cut.
_PIPE_WIDTH = 1_000_000


#: `--state-dir`, as every command that reads or writes the state directory takes it.
state_dir_option = click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="State directory (default: $PRELOOP_STATE_DIR, i.e. $PRELOOP_HOME/state).",
)


def plural(count: int, word: str, many: str | None = None) -> str:
    """`1 job`, `2 jobs` (`many` for irregular plurals: `1 entry`, `2 entries`)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def make_console(**kw: Any) -> Console:
    """A console for command output: on a terminal, rich's own; anywhere else
    (a pipe, a file, CI logs) lines are never wrapped or truncated.

    Rich markup is off: what it prints is the user's text (a leg named
    `test (3.13, [trio])`, a path, a step's output), where `[trio]` would be
    read as a style tag and dropped from every table cell."""
    from rich.console import Console  # here: `preloop du` and `--version` never load rich

    kw.setdefault("markup", False)
    probe = Console(**kw)
    if probe.is_terminal:
        return probe
    return Console(width=_PIPE_WIDTH, soft_wrap=True, **kw)


class LazyGroup(click.Group):
    """A group whose commands are imported on first use, from `COMMANDS`.

    `preloop --version` and `preloop du` then import click and little else; help
    still lists every command (it imports them all, which only help pays for).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        from preloop.cli.commands import COMMANDS

        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            from preloop.cli.commands import COMMANDS

            module = COMMANDS.get(cmd_name)
            if module is None:
                return None
            # The module registers its commands on `cli` as it is imported.
            importlib.import_module(module)
        return self.commands.get(cmd_name)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from preloop import version

    click.echo(f"preloop, version {version()}")
    ctx.exit()


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "-V",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli() -> None:
    """Run GitHub Actions workflows against a snapshot of your workspace.

    State lives under $PRELOOP_HOME (default ~/.preloop); `preloop config`
    lists every PRELOOP_* setting.
    """


def emit_json(document: Any) -> None:
    """Prints one JSON document for scripts (sorted keys, trailing newline)."""
    import json  # here, not at the top: most commands print no JSON

    click.echo(json.dumps(document, indent=2, sort_keys=True, default=str))


def echo_error(message: str) -> None:
    """`message` on stderr, each of its lines (an invalid workflow's problems
    are one a line) marked as an error."""
    for line in message.splitlines() or [""]:
        click.echo(f"preloop: error: {line}", err=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Ends the command with `message` as `echo_error` prints it, and `code`."""
    echo_error(message)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors never print a traceback."""
    try:
        cli.main(args=argv, prog_name="preloop", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("preloop: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except PreloopError as exc:
        fail(str(exc), exc.exit_code)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        click.echo("preloop: interrupted", err=True)
        sys.exit(130)
    sys.exit(0)
