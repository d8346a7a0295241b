"""How the snapshot code runs git: through the bounded runners, with an
environment that no caller-provided `GIT_*` variable can redirect, hooks
disabled, no auto-gc, C locale (messages are parsed), never prompting, and
credentials in URLs redacted from anything shown to a user."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping, Sequence

from preloop.errors import PreloopError
from preloop.process import (
    CommandFailed,
    CommandResult,
    CommandTimeout,
    run_command,
    run_command_with_stdin,
)

__all__ = ["git", "git_env", "git_failure", "redact"]

# Variables that would point git at another repository, index or object store
# than the one each call names explicitly.
_SCRUBBED = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
    "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
    "GIT_QUARANTINE_PATH",
    "GIT_REPLACE_REF_BASE",
    "GIT_GRAFT_FILE",
    "GIT_SHALLOW_FILE",
    "GIT_LITERAL_PATHSPECS",
    "GIT_GLOB_PATHSPECS",
    "GIT_NOGLOB_PATHSPECS",
    "GIT_ICASE_PATHSPECS",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
    "GIT_AUTHOR_NAME",
    "GIT_AUTHOR_EMAIL",
    "GIT_AUTHOR_DATE",
    "GIT_COMMITTER_NAME",
    "GIT_COMMITTER_EMAIL",
    "GIT_COMMITTER_DATE",
)

# Hooks (post-index-change would run the workspace's own hook against our
# index), split index (would write sharedindex files into the source
# repository; a capture opts in where that cannot happen:
# `preloop.snapshot.index`), auto-gc and signing are all off for every call.
BASE_CONFIG: tuple[str, ...] = (
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.splitIndex=false",
    "-c",
    "gc.auto=0",
    "-c",
    "maintenance.auto=false",
    "-c",
    "commit.gpgSign=false",
    "-c",
    "advice.addEmbeddedRepo=false",
)

_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]+@")


def redact(text: str, secrets: Sequence[str] = ()) -> str:
    """`text` with `scheme://user:password@` reduced to `scheme://***@` and each
    of `secrets` replaced by `***`."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return _URL_CREDENTIALS.sub(r"\g<scheme>***@", text)


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a snapshot git call: ours minus redirecting `GIT_*`
    variables, plus fixed locale and no prompts, plus `extra`."""
    # git's GIT_TEST_* knobs (split index, fsmonitor, index version...) would
    # change what git writes where.
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUBBED and not k.startswith("GIT_TEST_")
    }
    env["LC_ALL"] = "C"
    env["LANGUAGE"] = "C"
    env["GIT_OPTIONAL_LOCKS"] = "0"
    env["GIT_TERMINAL_PROMPT"] = "0"
    env["GCM_INTERACTIVE"] = "never"
    if extra:
        env.update(extra)
    return env


async def git(
    args: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    check: bool = True,
    stdin: bytes | None = None,
    secrets: Sequence[str] = (),
    timeout: float | None = None,
) -> CommandResult:
    """Runs `git <BASE_CONFIG> <args>`; errors show the command with `secrets`
    and URL credentials redacted."""
    argv = ["git", *BASE_CONFIG, *(os.fspath(a) for a in args)]
    display = redact(shlex.join(["git", *(os.fspath(a) for a in args)]), secrets)
    environment = dict(env) if env is not None else git_env()
    try:
        if stdin is None:
            result = await run_command(
                argv, cwd=cwd, env=environment, check=False, display=display, timeout=timeout
            )
        else:
            result = await run_command_with_stdin(
                argv, stdin, cwd=cwd, env=environment, check=False, display=display, timeout=timeout
            )
    except FileNotFoundError as exc:
        if exc.filename == "git":
            raise PreloopError(f"cannot run `{display}`: git is not on PATH: install git") from None
        raise
    if check and result.returncode != 0:
        shown = dataclasses.replace(
            result, stderr=redact(result.stderr_text(), secrets).encode(), argv=()
        )
        raise CommandFailed(display, shown, os.fspath(cwd) if cwd is not None else None)
    return result


def git_failure(exc: CommandFailed | CommandTimeout) -> str:
    """A failed or timed-out git call in one line: git's own diagnosis
    (`fatal:`/`error:`), not the advice it prints after it."""
    if isinstance(exc, CommandTimeout):
        return f"no answer within {exc.timeout:g}s"
    lines = [ln.strip() for ln in exc.result.stderr_text().splitlines() if ln.strip()]
    fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
    return (fatal or lines or [str(exc)])[0]
