"""`--sandbox`: each job's steps under bubblewrap.

The sandbox sees the host filesystem, with a private `/tmp` (a per-job
directory), the state directory read-only (the checkout's objects live
there), the job's directory writable, and the fingerprint coordination
directory bound read-only at its own path after the private /tmp, as the
sandbox-launcher API asks (`preloop.fingerprint.sandbox_bind_args`), so
fingerprint walks inside sandboxes share the host-wide slot cap.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from preloop.errors import PreloopError
from preloop.fingerprint import prepare_host_coordination, sandbox_bind_args

__all__ = ["SandboxUnavailable", "bubblewrap_wrapper"]


class SandboxUnavailable(PreloopError):
    """`--sandbox` was asked for but bubblewrap is not installed."""


def bubblewrap_wrapper(
    job_dir: Path, state_dir: Path, private_tmp: Path
) -> Callable[[list[str]], list[str]]:
    """An argv wrapper running each step under bwrap (see the module docstring)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "--sandbox needs bubblewrap: install it (apt-get install bubblewrap) or run "
            "without --sandbox"
        )
    coordination = prepare_host_coordination()
    private_tmp.mkdir(parents=True, exist_ok=True)
    prefix = [
        bwrap,
        "--die-with-parent",
        "--dev-bind",
        "/",
        "/",
        "--bind",
        str(private_tmp),
        "/tmp",
        "--ro-bind",
        str(state_dir),
        str(state_dir),
        "--bind",
        str(job_dir),
        str(job_dir),
        *sandbox_bind_args(coordination),
        "--",
    ]

    def wrap(argv: list[str]) -> list[str]:
        return [*prefix, *argv]

    return wrap
