"""Secrets given to `preloop run` / `preloop runner`: `--secret` and
`--secret-file`; and the options other commands share with `preloop run`:
the `vars` context's `--var NAME=VALUE` and `--var-file FILE`, and
`--action` overrides.

`--secret NAME=VALUE` puts the value in the process list (`ps`,
`/proc/<pid>/cmdline`, readable by every local user), so it draws a one-time
warning; `--secret NAME` (the value from the environment) and
`--secret-file FILE` do not.

A secret file (and a variables file) is in dotenv format, as `act
--secret-file` reads it:

    # a comment
    NAME=value                 # unquoted: trailing ` # comment` and blanks removed
    export OTHER=value         # `export ` is allowed
    QUOTED="a \\"b\\"\\nsecond line"   # double quotes: \\n \\r \\t \\\\ \\" escapes, may span lines
    RAW='no $escapes here'     # single quotes: literal, may span lines

Later definitions win, and `--secret` (`--var`) arguments win over the files.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from preloop.errors import UsageError

__all__ = [
    "action_option",
    "parse_secret_file",
    "parse_secrets",
    "parse_vars",
    "sandbox_options",
    "secret_options",
    "secret_warning",
    "var_options",
]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "$": "$"}

_warned = False

# preloop.runner.sandbox.SANDBOX_NETWORKS, spelled here so that the CLI does not
# import the runner (and the native module) to build its options.
SANDBOX_NETWORKS = ("host", "none")

#: The warning printed once when a secret value is given on the command line.
secret_warning = (
    "preloop: warning: --secret NAME=VALUE puts the value in the process list, where "
    "every local user can read it; use --secret-file FILE or --secret NAME (value from "
    "the environment)"
)


def _double_quoted(text: str, pos: int, where: str) -> tuple[str, int]:
    out: list[str] = []
    i = pos
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            out.append(_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
            i += 2
            continue
        if c == '"':
            return "".join(out), i + 1
        out.append(c)
        i += 1
    raise UsageError(f"{where}: unterminated double-quoted value")


def parse_secret_file(path: Path, option: str = "--secret-file") -> dict[str, str]:
    """NAME -> value from a dotenv file (see the module docstring). A missing
    or malformed file is a `UsageError` naming `option`, the file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not UTF-8 text") from None
    secrets: dict[str, str] = {}
    i = 0
    n = len(text)
    while i < n:
        line_no = text.count("\n", 0, i) + 1
        where = f"{option} {path}:{line_no}"
        end = text.find("\n", i)
        end = n if end < 0 else end
        line = text[i:end]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            i = end + 1
            continue
        lead = len(line) - len(line.lstrip())
        start = i + lead
        if text.startswith("export ", start):
            start += len("export ")
            while start < end and text[start] in " \t":
                start += 1
        m = _NAME.match(text, start)
        if m is None or m.end() > end:
            raise UsageError(f"{where}: expected NAME=VALUE (a name is letters, digits and _)")
        name = m.group(0)
        j = m.end()
        while j < end and text[j] in " \t":
            j += 1
        if j >= end or text[j] not in "=:":
            raise UsageError(f"{where}: expected NAME=VALUE, got {stripped.split()[0]!r}")
        j += 1
        while j < end and text[j] in " \t":
            j += 1
        if j < n and text[j] == '"':
            value, after = _double_quoted(text, j + 1, where)
        elif j < n and text[j] == "'":
            close = text.find("'", j + 1)
            if close < 0:
                raise UsageError(f"{where}: unterminated single-quoted value")
            value, after = text[j + 1 : close], close + 1
        else:
            raw = text[j:end]
            hash_at = re.search(r"\s#", raw)
            value = (raw[: hash_at.start()] if hash_at else raw).strip()
            after = end
        rest_end = text.find("\n", after)
        rest_end = n if rest_end < 0 else rest_end
        rest = text[after:rest_end].strip()
        if rest and not rest.startswith("#"):
            raise UsageError(f"{where}: unexpected text after the value of {name}")
        secrets[name] = value
        i = rest_end + 1
    return secrets


def parse_secrets(
    values: Iterable[str], files: Iterable[Path] = (), *, warn: bool = True
) -> dict[str, str]:
    """Secrets from `--secret-file` FILEs, then `--secret` values: `NAME=VALUE`,
    or a bare `NAME` taking the value of environment variable NAME. A value
    given on the command line prints `secret_warning` once per process."""
    global _warned
    secrets: dict[str, str] = {}
    for path in files:
        secrets.update(parse_secret_file(path))
    for item in values:
        if "=" in item:
            key, value = item.split("=", 1)
            if warn and not _warned:
                _warned = True
                print(secret_warning, file=sys.stderr)
        else:
            key, value = item, os.environ.get(item, "")
            if item not in os.environ:
                raise UsageError(f"--secret {item}: no environment variable {item} (use K=V)")
        if not key:
            # Never echo the argument: it holds the value.
            raise UsageError("--secret =...: use NAME=VALUE")
        secrets[key] = value
    return secrets


def parse_vars(values: Iterable[str], files: Iterable[Path] = ()) -> dict[str, str]:
    """The `vars` context: `--var-file` FILEs, then `--var NAME=VALUE`s."""
    found: dict[str, str] = {}
    for path in files:
        found.update(parse_secret_file(path, "--var-file"))
    for item in values:
        name, eq, value = item.partition("=")
        if not eq or not _NAME.fullmatch(name):
            raise UsageError(f"--var {item}: use NAME=VALUE (a name is letters, digits and _)")
        found[name] = value
    return found


def local_run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`-j/--jobs`, `--store` and `--state-dir`, shared by `preloop run` and
    `preloop rerun`: where the run is stored and how many local runners run it."""
    fn = click.option(
        "--state-dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="State directory (default: $PRELOOP_STATE_DIR).",
    )(fn)
    fn = click.option(
        "--store", help="Store URL (default: $PRELOOP_STORE_URL, else the lite store)."
    )(fn)
    return click.option(
        "-j",
        "--jobs",
        "parallel",
        type=int,
        help="Local runners (default: CPU count; 0: only `preloop runner` processes).",
    )(fn)


def action_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--action`, shared by `preloop run`, `plan` and `list`: a remote
    action or reusable workflow read from a local directory, or skipped."""
    return click.option(
        "--action",
        "actions",
        multiple=True,
        metavar="OWNER/REPO[/PATH][@REF]=DIR|skip[:REASON]",
        help="Run a local directory in place of a remote action or reusable workflow, or "
        "skip it (repeatable).",
    )(fn)


def var_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--var` and `--var-file`, shared by `preloop run` and `preloop plan`."""
    fn = click.option(
        "--var-file",
        "var_files",
        multiple=True,
        type=click.Path(path_type=Path, dir_okay=False),
        help="A dotenv file of configuration variables (the `vars` context; may be repeated).",
    )(fn)
    return click.option(
        "--var",
        "variables",
        multiple=True,
        metavar="NAME=VALUE",
        help="A configuration variable, `vars.NAME` (repository variables on GitHub); repeatable.",
    )(fn)


def secret_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--secret` and `--secret-file`, shared by `preloop run` and `preloop runner`."""
    fn = click.option(
        "--secret-file",
        "secret_files",
        multiple=True,
        type=click.Path(path_type=Path, dir_okay=False),
        help="A dotenv file of secrets (NAME=value lines; may be repeated).",
    )(fn)
    return click.option(
        "--secret",
        multiple=True,
        help="A secret NAME (value from the environment) or NAME=VALUE (visible in the "
        "process list: prefer --secret-file).",
    )(fn)


def sandbox_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--sandbox` and `--sandbox-network` (which needs `--sandbox`: alone it
    would silently sandbox nothing)."""

    @functools.wraps(fn)
    def checked(*args: Any, **kw: Any) -> Any:
        if kw.get("sandbox_network") is not None and not kw.get("sandbox"):
            raise UsageError(
                f"--sandbox-network {kw['sandbox_network']} needs --sandbox (add --sandbox, "
                "or drop --sandbox-network)"
            )
        kw["sandbox_network"] = kw.get("sandbox_network") or SANDBOX_NETWORKS[0]
        return fn(*args, **kw)

    opt = click.option(
        "--sandbox-network",
        type=click.Choice(SANDBOX_NETWORKS),
        default=None,
        help="With --sandbox: the host's network (the default), or none (loopback only).",
    )(checked)
    return click.option(
        "--sandbox",
        is_flag=True,
        help="Run each step under bubblewrap: read-only host, hidden state directory, "
        "no capabilities, own PID namespace.",
    )(opt)
