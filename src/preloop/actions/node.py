"""Which `node` runs JavaScript actions.

`PRELOOP_NODE` (a path or a command name) when set; otherwise the newest of
the node binaries on PATH (`node`, `node24`, `node22`, `node20`, ...) and of
the usual version-manager directories. The choice and each binary's version
are computed once per process.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from preloop.errors import PreloopError

__all__ = ["NodeNotFound", "NodeRuntime", "find_node"]

_NAMES = ("node", "node24", "node22", "node20", "node18", "node16", "nodejs")


class NodeNotFound(PreloopError):
    """No usable `node` on this host."""


@dataclass(frozen=True, slots=True)
class NodeRuntime:
    path: str
    version: str  # e.g. v20.19.2

    @property
    def major(self) -> int:
        m = re.match(r"v?(\d+)", self.version)
        return int(m.group(1)) if m else 0


@functools.cache
def _version(path: str) -> str | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=20, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text if re.match(r"v?\d+\.", text) else None


def _candidates(env_path: str) -> list[str]:
    seen: list[str] = []
    for name in _NAMES:
        found = shutil.which(name, path=env_path)
        if found and os.path.realpath(found) not in map(os.path.realpath, seen):
            seen.append(found)
    home = Path.home()
    for pattern in (".nvm/versions/node/*/bin/node", ".volta/tools/image/node/*/bin/node"):
        for found_path in sorted(home.glob(pattern)):
            if os.access(found_path, os.X_OK):
                seen.append(str(found_path))
    return seen


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


@functools.cache
def _find(choice: str, env_path: str) -> NodeRuntime:
    if choice:
        path = shutil.which(choice, path=env_path) or (choice if os.path.isfile(choice) else None)
        version = _version(path) if path else None
        if path is None or version is None:
            raise NodeNotFound(
                f"PRELOOP_NODE={choice!r} is not a working node (`{choice} --version` failed)"
            )
        return NodeRuntime(path, version)
    best: NodeRuntime | None = None
    for path in _candidates(env_path):
        version = _version(path)
        if version is not None and (best is None or _key(version) > _key(best.version)):
            best = NodeRuntime(path, version)
    if best is None:
        raise NodeNotFound(
            "JavaScript actions need node and none was found on PATH: install node "
            "(20 or newer) or set PRELOOP_NODE to its path"
        )
    return best


def find_node(env: Mapping[str, str] | None = None) -> NodeRuntime:
    env = os.environ if env is None else env
    return _find(env.get("PRELOOP_NODE", "").strip(), env.get("PATH", os.defpath))
