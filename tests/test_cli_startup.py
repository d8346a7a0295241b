"""Command start-up: the modules a command imports (an import budget, not a timing),
and the lazy command table staying complete."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from preloop.cli import cli
from preloop.cli.commands import COMMANDS

# Imported by no command that does not need it: the scheduler, the workflow
# loader, the runner, rich, YAML, async I/O and the database drivers.
HEAVY = (
    "anyio",
    "asyncio",
    "importlib.metadata",
    "psycopg",
    "rich",
    "sqlite3",
    "yaml",
    "preloop.control",
    "preloop.engine",
    "preloop.runner",
    "preloop.snapshot",
    "preloop.workflow",
)


def imported_modules(*args: str) -> set[str]:
    """The modules `preloop ARGS...` imports, from `python -X importtime`."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "preloop", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    names = set()
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def _heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


def test_version_import_budget() -> None:
    names = imported_modules("--version")
    assert not _heavy(names)
    # `--version` is answered before the command framework is imported at all.
    assert "click" not in names
    assert {n for n in names if n.startswith("preloop")} <= {
        "preloop",
        "preloop.__main__",
        "preloop.cli",
        "preloop._version",
    }
    # The interpreter's own start-up plus a handful; today about 45 modules.
    assert len(names) <= 70, sorted(names)


def test_du_import_budget(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    names = imported_modules("du", str(tmp_path))
    assert not _heavy(names)
    # A plain `du PATH` is answered before the command framework is imported.
    assert "click" not in names and "dataclasses" not in names, sorted(names)
    assert {n for n in names if n.startswith("preloop")} <= {
        "preloop",
        "preloop.__main__",
        "preloop.cli",
        "preloop.cli.du_report",
        "preloop._native",
    }
    assert len(names) <= 70, sorted(names)
    # Through click (`--` ends the options), still without the heavy modules.
    names = imported_modules("du", "--", str(tmp_path))
    assert not _heavy(names) and "click" in names
    assert {n for n in names if n.startswith("preloop.cli.")} <= {
        "preloop.cli.app",
        "preloop.cli.commands",
        "preloop.cli.du",
        "preloop.cli.du_report",
    }
    assert len(names) <= 130, sorted(names)


@pytest.mark.parametrize(
    "flags", [[], ["--json"], ["--cross-filesystems"], ["--json", "--cross-filesystems"]]
)
@pytest.mark.parametrize("missing", [False, True])
def test_du_fast_path_prints_what_the_command_prints(
    tmp_path: Path, flags: list[str], missing: bool
) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 1000)
    (tmp_path / "d" / "l").symlink_to("f")
    path = str(tmp_path / ("missing" if missing else "d"))

    def run(*args: str) -> tuple[int, str, str]:
        r = subprocess.run(
            [sys.executable, "-m", "preloop", "du", *args], capture_output=True, text=True
        )
        return r.returncode, r.stdout, r.stderr

    fast = run(*flags, path)
    assert fast == run(*flags, "--", path)  # the click command
    assert fast[0] == (1 if missing else 0), fast
    assert (path in fast[2]) if missing else (path in fast[1])


@pytest.mark.parametrize("stdout", ["full", "reader gone", "closed"])
def test_du_fast_path_fails_writing_as_the_command_does(tmp_path: Path, stdout: str) -> None:
    """Output that cannot be written: the same exit status and stderr (one
    line, or nothing for a reader that went away), never a traceback."""

    def run(*args: str) -> tuple[int, str]:
        if stdout == "full":
            with open("/dev/full", "wb") as full:
                r = subprocess.run(
                    [sys.executable, "-m", "preloop", "du", *args],
                    stdout=full,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            return r.returncode, r.stderr
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            r = subprocess.run(
                [sys.executable, "-m", "preloop", "du", *args],
                stdout=write_end if stdout == "reader gone" else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                # "closed": the command starts with descriptor 1 closed
                preexec_fn=None if stdout == "reader gone" else (lambda: os.close(1)),
            )
        finally:
            os.close(write_end)
        return r.returncode, r.stderr

    fast = run(str(tmp_path))
    assert fast == run("--", str(tmp_path))
    assert "Traceback" not in fast[1]
    expected = {"full": 1, "reader gone": 1, "closed": 0}[stdout]
    assert fast[0] == expected, fast


def test_du_fields_are_tree_sizes() -> None:
    import dataclasses

    from preloop.cli.du_report import FIELDS
    from preloop.fs import TreeSize

    assert tuple(f.name for f in dataclasses.fields(TreeSize)) == FIELDS


def test_help_lists_every_command() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "preloop", "--help"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    listed = r.stdout.split("Commands:", 1)[1].split()
    for name in COMMANDS:
        assert name in listed


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_table_entry_defines_its_command(name: str) -> None:
    ctx = click.Context(cli)
    command = cli.get_command(ctx, name)
    assert command is not None, f"{COMMANDS[name]} does not register {name!r} on cli"
    assert command.name == name


def test_every_registered_command_is_in_the_table() -> None:
    ctx = click.Context(cli)
    for name in list(COMMANDS):
        cli.get_command(ctx, name)
    # A module that registers a command the table does not name would make that
    # command appear only after some other command's module happened to load.
    assert set(cli.commands) <= set(COMMANDS)


def test_unknown_command_is_a_usage_error() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "preloop", "no-such-command"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "No such command 'no-such-command'" in r.stderr
    assert "Traceback" not in r.stderr
