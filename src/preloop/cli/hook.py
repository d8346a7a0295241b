"""`preloop hook install|uninstall`: a git pre-push hook that runs the push
event for the refs being pushed and blocks the push when a run fails.

The hook chains a pre-push hook that was there before (it is kept as
`pre-push.preloop-chained`, runs first with the same arguments and input,
and is put back by `uninstall`). `PRELOOP_SKIP=1 git push` bypasses the
workflows once.

Each pushed ref runs on what is pushed: its commit, checked out (detached)
in a temporary linked worktree (`_pushed_commit`) and captured from there,
never the work tree, whose uncommitted edits are not part of the push.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click

from preloop.cli.app import cli
from preloop.engine import NothingTriggered, RunRequest
from preloop.errors import UsageError

__all__ = ["hook_group"]

_MARK = "# preloop pre-push hook"
_CHAINED = "pre-push.preloop-chained"
_ZERO = "0" * 40


def _hooks_dir(cwd: Path) -> Path:
    proc = subprocess.run(
        ["git", "rev-parse", "--git-path", "hooks"], cwd=cwd, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise UsageError(f"{cwd} is not inside a git repository")
    path = Path(proc.stdout.strip())
    return path if path.is_absolute() else (cwd / path).resolve()


def _script() -> str:
    python = shlex.quote(sys.executable)
    return f"""#!/bin/sh
{_MARK}: installed by `preloop hook install`, removed by `preloop hook uninstall`.
# Runs the push event's workflows for the pushed refs; a failed run blocks the push.
# PRELOOP_SKIP=1 git push ... skips the workflows once.
input=$(cat)
hookdir=$(dirname "$0")
if [ -x "$hookdir/{_CHAINED}" ]; then
    printf '%s\\n' "$input" | "$hookdir/{_CHAINED}" "$@" || exit $?
fi
if [ "${{PRELOOP_SKIP:-}}" = "1" ]; then
    echo "preloop: PRELOOP_SKIP=1: workflows not run for this push" >&2
    exit 0
fi
printf '%s\\n' "$input" | {python} -m preloop hook pre-push "$@"
"""


@cli.group("hook")
def hook_group() -> None:
    """A git pre-push hook that runs the push workflows before each push."""


@hook_group.command("install")
def install_command() -> None:
    """Install the pre-push hook in this repository (an existing hook is chained)."""
    hooks = _hooks_dir(Path.cwd())
    hooks.mkdir(parents=True, exist_ok=True)
    hook = hooks / "pre-push"
    if hook.exists() and _MARK in hook.read_text(errors="replace"):
        click.echo(f"preloop: the pre-push hook is already installed at {hook}")
        return
    if hook.exists() or hook.is_symlink():
        if (hooks / _CHAINED).exists():
            raise UsageError(f"{hooks / _CHAINED} exists already: remove it or uninstall first")
        hook.rename(hooks / _CHAINED)
        chained = f" (the existing hook runs first, kept as {_CHAINED})"
    else:
        chained = ""
    tmp = hooks / ".pre-push.preloop-tmp"
    tmp.write_text(_script())
    tmp.chmod(0o755)
    tmp.replace(hook)
    click.echo(f"preloop: pre-push hook installed at {hook}{chained}")


@hook_group.command("uninstall")
def uninstall_command() -> None:
    """Remove the pre-push hook (a chained hook is put back)."""
    hooks = _hooks_dir(Path.cwd())
    hook = hooks / "pre-push"
    if not hook.exists() or _MARK not in hook.read_text(errors="replace"):
        raise UsageError(f"no preloop pre-push hook at {hook}")
    chained = hooks / _CHAINED
    if chained.exists() or chained.is_symlink():
        chained.replace(hook)
        click.echo(f"preloop: pre-push hook removed; the previous hook is back at {hook}")
    else:
        hook.unlink()
        click.echo(f"preloop: pre-push hook removed from {hook}")


@hook_group.command("pre-push", hidden=True)
@click.argument("remote", required=False)
@click.argument("url", required=False)
def pre_push_command(remote: str | None, url: str | None) -> None:
    """What the hook runs: git's pre-push input on stdin, one
    `local_ref local_sha remote_ref remote_sha` line per pushed ref."""
    from preloop.cli.run import execute

    status = 0
    for line in sys.stdin.read().splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue
        _local_ref, local_sha, remote_ref, remote_sha = parts
        if local_sha == _ZERO:
            continue  # a deletion runs nothing
        base = None
        if remote_sha != _ZERO and _have(remote_sha):
            base = remote_sha
        click.echo(
            f"preloop: push of {local_sha[:12]} to {remote_ref} on {remote or url or 'the remote'}"
        )
        with _pushed_commit(local_sha) as tree:
            try:
                request = RunRequest(
                    workspace=tree, event="push", ref=remote_ref, base=base, before=remote_sha
                )
                code = execute(request)
            except NothingTriggered as exc:
                click.echo(f"preloop: nothing to run: {exc}")
                continue
        if code != 0:
            status = code
    if status:
        click.echo(
            "preloop: push blocked: a workflow run failed or a workflow is invalid "
            "(PRELOOP_SKIP=1 git push to skip once)",
            err=True,
        )
    sys.exit(status)


# Set by git for hooks in some setups; they would make git commands run in
# the temporary worktree act on the user's work tree and index instead.
_GIT_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_PREFIX")


@contextlib.contextmanager
def _pushed_commit(sha: str) -> Iterator[Path]:
    """`sha` checked out (detached) in a temporary linked worktree of this
    repository (same remotes and refs, so the run's context and changed paths
    are those of the repository); removed on exit. A crash leaves a directory
    in the temp dir whose registration the next hook's `git worktree prune`
    drops once the directory is gone."""
    top = _git_out("rev-parse", "--show-toplevel")
    subprocess.run(["git", "worktree", "prune"], capture_output=True, check=False)
    holder = Path(tempfile.mkdtemp(prefix="preloop-pre-push-"))
    tree = holder / Path(top).name  # the repository's directory name, as in the work tree
    try:
        # No post-checkout hook of the user's runs for this private checkout.
        _git_out(
            "-c",
            "core.hooksPath=/dev/null",
            "worktree",
            "add",
            "--quiet",
            "--detach",
            str(tree),
            sha,
        )
        saved = {k: os.environ.pop(k) for k in _GIT_LOCATION_VARS if k in os.environ}
        try:
            yield tree
        finally:
            os.environ.update(saved)
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(tree)], capture_output=True, check=False
        )
        shutil.rmtree(holder, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], capture_output=True, check=False)


def _git_out(*args: str) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise UsageError(f"git {' '.join(args)}: {lines[-1] if lines else 'failed'}")
    return proc.stdout.strip()


def _have(sha: str) -> bool:
    proc = subprocess.run(
        ["git", "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True, env=os.environ
    )
    return proc.returncode == 0
