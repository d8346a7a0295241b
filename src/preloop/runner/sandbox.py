"""`--sandbox`: each job's steps under bubblewrap, holding even when run as root.

What a sandboxed step sees and may do:

- the host filesystem **read-only** (`--ro-bind / /`), a fresh `/dev`
  (`--dev /dev`) and a `/proc` of its own PID namespace;
- writable places: the job's directory (workspace, `RUNNER_TEMP`, its
  `HOME`) and private per-job `/tmp` and `/var/tmp` (directories in the job
  directory, kept across the job's steps), a per-step `/dev/shm`; nothing else
  of the host, the source repository and the state directory included;
- the state directory **hidden** (an empty tmpfs over it), except the job's
  directory and, read-only, the object directories the job's checkout borrows
  from (the run repository's and the object cache entry's, found through
  `objects/info/alternates`): other runs' logs, repositories and the lite
  database cannot be read;
- **no capabilities** (`--cap-drop ALL`): root inside cannot remount, mount,
  unmount the tmpfs over the state directory, or change file ownership;
- a new PID namespace (`--unshare-pid`) and IPC namespace: host processes are
  neither visible nor signalable; a new session (`--new-session`: no
  `TIOCSTI` into the caller's terminal); `--die-with-parent`: killing the
  step's process group (timeout, cancel) kills the whole sandbox. Processes
  a step leaves in the background end with the step (its PID namespace ends),
  unlike on GitHub, where they live until the job ends;
- the network: `network="host"` (the default: the host's network, so steps
  that download work) or `"none"` (`--unshare-net`: loopback only);
- `HOME` is `<job>/home` (empty, writable); the fingerprint coordination
  directory is bound read-only at its own path after the private `/tmp` and
  `/var/tmp`, as the sandbox-launcher API asks
  (`preloop.fingerprint.sandbox_bind_args`), so fingerprint walks inside
  sandboxes share the host-wide slot cap.

A bind source is taken from the host's view, so the order above (hide, then
bind back) is what makes the hidden parts stay hidden.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from preloop.errors import PreloopError, UsageError
from preloop.fingerprint import prepare_host_coordination, sandbox_bind_args

__all__ = [
    "SANDBOX_NETWORKS",
    "SandboxUnavailable",
    "StepSandbox",
    "borrowed_object_dirs",
    "bubblewrap_argv",
    "bubblewrap_wrapper",
]

#: Where a step sees its private temporary directories, and their names in
#: the job directory.
PRIVATE_DIRS = (("/tmp", "tmp"), ("/var/tmp", "var-tmp"))

#: `--sandbox-network` choices; the first is the default.
SANDBOX_NETWORKS = ("host", "none")


class SandboxUnavailable(PreloopError):
    """`--sandbox` was asked for but bubblewrap is not installed."""


def borrowed_object_dirs(repository: Path, *, limit: int = 16) -> list[Path]:
    """The object directories a repository borrows from, following
    `objects/info/alternates` transitively (the job checkout -> the run
    repository -> the object cache entry). Relative entries are relative to
    the objects directory holding the alternates file, as git reads them."""
    git_dir = repository / ".git" if (repository / ".git").is_dir() else repository
    todo = [git_dir / "objects"]
    seen: list[Path] = []
    while todo and len(seen) < limit:
        objects = todo.pop(0)
        try:
            text = (objects / "info" / "alternates").read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            continue
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            target = Path(os.path.realpath(objects / line))
            if target not in seen and target.is_dir():
                seen.append(target)
                todo.append(target)
    return seen


def bubblewrap_argv(
    job_dir: Path,
    state_dir: Path,
    *,
    workspace: Path | None = None,
    network: str = "host",
    coordination: Path | None = None,
    read_only: Sequence[Path] = (),
    bwrap: str = "bwrap",
) -> list[str]:
    """The bwrap argv prefix (ending in `--`) of a step of the job in `job_dir`.
    `read_only` are further paths the job needs to read (an action's files, a
    tool cache), bound read-only at their own place, inside the hidden state
    directory too."""
    if network not in SANDBOX_NETWORKS:
        raise UsageError(f"--sandbox-network {network!r}: use one of {', '.join(SANDBOX_NETWORKS)}")
    job_dir = Path(os.path.realpath(job_dir))
    state_dir = Path(os.path.realpath(state_dir))
    home = job_dir / "home"
    for d in (home, *(job_dir / name for _, name in PRIVATE_DIRS)):
        d.mkdir(parents=True, exist_ok=True)
    argv = [
        bwrap,
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--unshare-pid",
        "--unshare-ipc",
    ]
    if network == "none":
        argv.append("--unshare-net")
    argv += [
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/dev/shm",
    ]
    for seen, name in PRIVATE_DIRS:
        argv += ["--bind", str(job_dir / name), seen]
    argv += ["--tmpfs", str(state_dir)]
    borrowed = borrowed_object_dirs(workspace) if workspace is not None else []
    for objects in borrowed:
        argv += ["--ro-bind", str(objects), str(objects)]
    for extra in read_only:
        real = os.path.realpath(extra)
        argv += ["--ro-bind", real, real]
    argv += ["--bind", str(job_dir), str(job_dir)]
    if workspace is not None:
        # The workspace slot (see preloop.runner.workspaces) is beside the
        # job's directory: its parent, RUNNER_WORKSPACE, is the job's too.
        outer = Path(os.path.realpath(workspace)).parent
        if not outer.is_relative_to(job_dir):
            argv += ["--bind", str(outer), str(outer)]
    if coordination is not None:
        argv += sandbox_bind_args(coordination)
    argv += ["--setenv", "HOME", str(home), "--"]
    return argv


@dataclass(frozen=True, slots=True)
class StepSandbox:
    """How a job's steps run under bwrap: `wrap(argv, cwd)` is the argv to
    spawn (from any directory of the host) for a step that works in `cwd` as
    the step sees it; `host_path(path)` is where a path a step sees is on
    the host (its private `/tmp` and `/var/tmp` are in the job directory,
    but what is bound at its own place over them, such as a state directory
    under /tmp and the actions in it, is where it is); `home` is the `HOME`
    the step sees."""

    prefix: tuple[str, ...]  # ends with "--"
    private: tuple[tuple[Path, Path], ...]  # (seen at, on the host)
    home: Path | None = None
    own_place: tuple[Path, ...] = ()  # bound at their own path after `private`

    def wrap(self, argv: list[str], cwd: str) -> list[str]:
        return [*self.prefix[:-1], "--chdir", cwd, "--", *argv]

    def host_path(self, path: Path) -> Path:
        if any(path.is_relative_to(own) for own in self.own_place):
            return path
        for seen, host in self.private:
            if path == seen or path.is_relative_to(seen):
                return host / path.relative_to(seen)
        return path


def bubblewrap_wrapper(
    job_dir: Path,
    state_dir: Path,
    *,
    workspace: Path | None = None,
    network: str = "host",
    read_only: Sequence[Path] = (),
) -> StepSandbox:
    """The sandbox of a job's steps (see the module docstring)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "--sandbox needs bubblewrap: install it (apt-get install bubblewrap) or run "
            "without --sandbox"
        )
    coordination = prepare_host_coordination()
    prefix = bubblewrap_argv(
        job_dir,
        state_dir,
        workspace=workspace,
        network=network,
        coordination=coordination,
        read_only=read_only,
        bwrap=bwrap,
    )
    job_dir = Path(os.path.realpath(job_dir))
    private = tuple((Path(seen), job_dir / name) for seen, name in PRIVATE_DIRS)
    # What the argv binds after the private /tmp and /var/tmp (everything a
    # step sees under the state directory is bound at its own path).
    own = [Path(os.path.realpath(state_dir)), Path(coordination)]
    if workspace is not None:
        own.append(Path(os.path.realpath(workspace)).parent)
    return StepSandbox(tuple(prefix), private, job_dir / "home", tuple(own))
