"""Where job logs and results are kept: `<state>/logs/<run_id>/`.

Each job has `<quoted job id>.log` (its masked log lines, written as they
come) and `<quoted job id>.json` (its `JobResult`: conclusion, outputs,
steps, annotations, step summary). Job ids are URL-quoted so that `caller/inner`
and `test#0` make one flat file name each.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, unquote

from preloop.runner.job import JobResult

__all__ = [
    "JobLog",
    "job_ids_with_logs",
    "log_path",
    "mark_run",
    "read_result",
    "result_path",
    "run_log_dir",
    "run_logs_name",
    "run_marker",
]

#: `<state>/logs/<run>/run-key`: the host-unique key of the run whose logs
#: these are. Run ids repeat across stores sharing a state directory, so
#: `preloop logs` checks it against the run it was asked for.
_MARKER = "run-key"


def mark_run(state_dir: Path, run_id: int | str, run_key: str) -> None:
    """Makes `logs/<run_id>` the directory of the run with `run_key`: logs
    of another run with the same id (another store) are moved aside to
    `logs/<run_id>.<its key>` first. Called before the run's logs are opened."""
    d = run_log_dir(state_dir, run_id)
    current = run_marker(state_dir, run_id)
    if current == run_key:
        return
    if current is not None:
        aside = run_log_dir(state_dir, f"{run_id}.{current}")
        if not aside.exists():
            d.rename(aside)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{_MARKER}.{run_key}"
    tmp.write_text(run_key)
    tmp.replace(d / _MARKER)


def run_logs_name(state_dir: Path, run_id: int, run_key: str | None) -> str | None:
    """The name under `logs/` holding the logs of run `run_id` with
    `run_key`, or None when this state directory has none of that run."""
    current = run_marker(state_dir, run_id)
    if run_key is None or current is None or current == run_key:
        return str(run_id)
    aside = f"{run_id}.{run_key}"
    return aside if run_log_dir(state_dir, aside).is_dir() else None


def run_marker(state_dir: Path, run_id: int | str) -> str | None:
    try:
        return (run_log_dir(state_dir, run_id) / _MARKER).read_text().strip() or None
    except OSError:
        return None


def run_log_dir(state_dir: Path, run_id: int | str) -> Path:
    return Path(state_dir) / "logs" / str(run_id)


def log_path(state_dir: Path, run_id: int | str, job_id: str) -> Path:
    return run_log_dir(state_dir, run_id) / f"{quote(job_id, safe='')}.log"


def result_path(state_dir: Path, run_id: int | str, job_id: str) -> Path:
    return run_log_dir(state_dir, run_id) / f"{quote(job_id, safe='')}.json"


def job_ids_with_logs(state_dir: Path, run_id: int | str) -> list[str]:
    d = run_log_dir(state_dir, run_id)
    if not d.is_dir():
        return []
    return sorted(unquote(p.name[: -len(".log")]) for p in d.glob("*.log"))


def read_result(state_dir: Path, run_id: int | str, job_id: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(result_path(state_dir, run_id, job_id).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data


class JobLog:
    """Appends one job's log lines (already masked) to its log file."""

    def __init__(self, state_dir: Path, run_id: int | str, job_id: str) -> None:
        self.state_dir = Path(state_dir)
        self.run_id = run_id
        self.job_id = job_id
        self.path = log_path(state_dir, run_id, job_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._start = time.monotonic()

    def write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def save_result(self, result: JobResult) -> None:
        path = result_path(self.state_dir, self.run_id, self.job_id)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(result), sort_keys=True, indent=1))
        tmp.replace(path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
