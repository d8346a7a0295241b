"""Every `PRELOOP_*` knob in one table: name, default, parser, one-line doc.

Read a knob with `get("PRELOOP_HOME")`; a bad value raises `ConfigError`
naming the variable. `preloop config` prints the table. Later features add
their rows to `KNOBS`, nowhere else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preloop.errors import ConfigError

__all__ = [
    "KNOBS",
    "Knob",
    "get",
    "parse_bool",
    "parse_bytes",
    "parse_nonnegative_int",
    "parse_optional_seconds",
    "parse_path",
    "parse_positive_int",
    "preloop_home",
    "state_dir",
    "validate",
]


@dataclass(frozen=True, slots=True)
class Knob:
    """One environment variable: `default` is a raw string (parsed like user input)
    or a callable computing it from the environment at read time."""

    name: str
    default: str | Callable[[Mapping[str, str]], str]
    parser: Callable[[str], Any]
    doc: str


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(raw: str) -> int:
    """`123`, `50GiB`, `1.5 GB`: a non-negative byte count (SI and IEC units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", raw)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"expected a byte count such as 1073741824, 50GiB or 500MB, got {raw!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def parse_positive_int(raw: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"expected a whole number >= 1, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"expected a whole number >= 1, got {raw!r}")
    return value


def parse_nonnegative_int(raw: str) -> int:
    """A whole number >= 0."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"expected a whole number >= 0, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"expected a whole number >= 0, got {raw!r}")
    return value


def parse_optional_seconds(raw: str) -> float | None:
    """Seconds >= 0 (`30`, `2.5`); empty means no bound (None)."""
    if not raw.strip():
        return None
    try:
        value = float(raw.strip().removesuffix("s"))
    except ValueError:
        raise ValueError(
            f"expected seconds such as 30 or 2.5, or empty for none, got {raw!r}"
        ) from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"expected seconds >= 0, or empty for none, got {raw!r}")
    return value


def parse_bool(raw: str) -> bool:
    """1/0, true/false, yes/no, on/off."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def parse_path(raw: str) -> Path:
    """A path; `~` is expanded. Relative paths are taken from the current directory."""
    if not raw.strip():
        raise ValueError("expected a path, got an empty value")
    return Path(raw).expanduser().absolute()


def _parse_url_base(raw: str) -> str:
    """A URL base (`https://host`, `file:///dir`, `ssh://...`), no trailing slash."""
    value = raw.strip().rstrip("/")
    if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) and not value.startswith("/"):
        raise ValueError(f"expected a URL base such as https://github.com, got {raw!r}")
    return value


def _parse_transport(raw: str) -> str:
    """`path`, `store`, or empty (the store's default)."""
    value = raw.strip().lower()
    if value not in ("", "path", "store"):
        raise ValueError(f"expected path or store (or empty for the default), got {raw!r}")
    return value


def _parse_tool_cache_layout(raw: str) -> str:
    """`auto` or `always`."""
    value = raw.strip().lower()
    if value not in ("auto", "always"):
        raise ValueError(f"expected auto or always, got {raw!r}")
    return value


def _home_default(env: Mapping[str, str]) -> str:
    return str(Path("~/.preloop").expanduser())


def _state_default(env: Mapping[str, str]) -> str:
    return str(preloop_home(env) / "state")


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in [
        Knob("PRELOOP_HOME", _home_default, parse_path, "preloop's home directory."),
        Knob(
            "PRELOOP_STATE_DIR",
            _state_default,
            parse_path,
            "State directory: snapshots, object cache, lite store, logs.",
        ),
        Knob(
            "PRELOOP_COORDINATION_DIR",
            "/var/tmp/preloop-coordination",
            parse_path,
            "Host directory of the fingerprint slot semaphore (tests); never derived from TMPDIR.",
        ),
        Knob(
            "PRELOOP_FINGERPRINT_SLOT_TIMEOUT",
            "",
            parse_optional_seconds,
            "Seconds a fingerprint waits for a host slot before failing; empty waits without "
            "bound. A wait over 3 s logs which pids hold the slots.",
        ),
        Knob(
            "PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES",
            "100GiB",
            parse_bytes,
            "Byte cap of the shared snapshot object cache (e.g. 50GiB); 0 disables eviction.",
        ),
        Knob(
            "PRELOOP_SNAPSHOT_TRANSPORT",
            "",
            _parse_transport,
            "How runners get a run's snapshot: `store` (git bundles in the PostgreSQL store, "
            "the default there) or `path` (its path in the submitter's state directory, "
            "which runners must mount at the same path; the only choice on the lite store).",
        ),
        Knob(
            "PRELOOP_SNAPSHOT_STORE_MAX_BYTES",
            "10GiB",
            parse_bytes,
            "Byte cap of the snapshot bundles in the store (whole unused chains evicted, least "
            "recently used first; a chain an unfinished run needs is never evicted); 0: no cap.",
        ),
        Knob(
            "PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE",
            "4",
            parse_positive_int,
            "Snapshot captures of one namespace (tenant) that run at once in a process.",
        ),
        Knob(
            "PRELOOP_STORE_URL",
            "",
            str,
            "Scheduler store: postgresql://... for a shared PostgreSQL, sqlite:///path, "
            "or empty for the lite store at $PRELOOP_STATE_DIR/preloop.db.",
        ),
        Knob(
            "PRELOOP_ACTIONS_CACHE_MAX_BYTES",
            "10GiB",
            parse_bytes,
            "Byte cap of the actions cache (actions/cache entries, least recently used "
            "evicted first); 0 disables the cap.",
        ),
        Knob(
            "PRELOOP_ARTIFACT_RETENTION_DAYS",
            "90",
            parse_nonnegative_int,
            "Days a run's artifacts are kept (removed when `preloop run` starts); 0 keeps them.",
        ),
        Knob(
            "PRELOOP_ACTIONS_URL",
            "https://github.com",
            _parse_url_base,
            "Where `uses: owner/repo@ref` actions are fetched from (<base>/<owner>/<repo>); "
            "any git URL base, e.g. file:///srv/action-mirrors.",
        ),
        Knob(
            "PRELOOP_ACTIONS_FETCH_TIMEOUT",
            "600",
            parse_positive_int,
            "Seconds one git call resolving or fetching an action may take before it is killed.",
        ),
        Knob(
            "PRELOOP_ACTION_OVERRIDES",
            "",
            str,
            "Local overrides of remote actions, `;`-separated: owner/repo[/path][@ref]=DIR or "
            "owner/repo[/path][@ref]=skip[:reason] (like `preloop run --action`).",
        ),
        Knob(
            "PRELOOP_NODE",
            "",
            str,
            "The node that runs JavaScript actions (a path or command); empty: the newest "
            "node found on PATH.",
        ),
        Knob(
            "PRELOOP_SILENT_STEP_NOTICE",
            "30",
            parse_positive_int,
            "Seconds a step may stay silent before `preloop run` prints a still-running line.",
        ),
        Knob(
            "PRELOOP_TOOL_CACHE_LAYOUT",
            "auto",
            _parse_tool_cache_layout,
            "A job's own tool cache: `auto` lays it out for jobs that may read it (an action "
            "other than checkout, artifacts and cache, or a step naming the tool cache), an "
            "empty directory for the others; `always` for every job (a step's script reads "
            "RUNNER_TOOL_CACHE without naming it).",
        ),
        Knob(
            "PRELOOP_LEASE_SECONDS",
            "60",
            parse_positive_int,
            "Lease of a claimed job in seconds: its runner heartbeats every third of it, and a "
            "runner or engine that cannot reach the store for longer says so (and keeps trying).",
        ),
    ]
}


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of knob `name` from `env` (default: `os.environ`)."""
    knob = KNOBS[name]
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        raw = knob.default(env) if callable(knob.default) else knob.default
        try:
            return knob.parser(raw)
        except ValueError as exc:  # a default is ours: failing here is a bug
            raise AssertionError(f"default of {name} does not parse: {exc}") from exc
    try:
        return knob.parser(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc} ({knob.doc.rstrip('.')})") from None


def preloop_home(env: Mapping[str, str] | None = None) -> Path:
    """`$PRELOOP_HOME`, default `~/.preloop`."""
    value: Path = get("PRELOOP_HOME", env)
    return value


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$PRELOOP_STATE_DIR`, default `$PRELOOP_HOME/state`."""
    value: Path = get("PRELOOP_STATE_DIR", env)
    return value


def validate(env: Mapping[str, str] | None = None) -> None:
    """Reads every knob: the first bad value raises `ConfigError` (exit 2).
    Commands that run long call this at start, so a bad value is reported
    there and not half-way (e.g. in a background prune after the capture)."""
    for name in KNOBS:
        get(name, env)
