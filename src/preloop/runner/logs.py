"""Where job logs and results are kept: `<state>/logs/<run_id>/`.

Each job has `<quoted job id>.log` (its masked log lines, written as they
come) and `<quoted job id>.json` (its `JobResult`: conclusion, outputs,
steps, annotations, step summary). Job ids are URL-quoted so that `caller/inner`
and `test#0` make one flat file name each.

On a PostgreSQL store the lines and the result also go to the store
(`preloop.control.joblogs`), in batches from a thread, so `preloop logs` and
the submitting `preloop run` on other machines see them as they come.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, unquote

from preloop.control.joblogs import JobLogStore
from preloop.errors import PreloopError
from preloop.runner.job import JobResult

__all__ = [
    "JobLog",
    "LogShipper",
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

_log = logging.getLogger(__name__)


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


class LogShipper:
    """Sends one job's lines to the store in batches, from its own thread, so
    a step's output never waits on the database. A batch leaves at most
    `GATHER` seconds after its first line (or when `MAX_BATCH` lines wait);
    a batch the store refuses is kept and sent again after a pause, in
    order. `close` sends what is left (waiting at most `CLOSE_WAIT`)."""

    GATHER = 0.05
    MAX_BATCH = 500
    RETRY_PAUSE = 1.0
    CLOSE_WAIT = 60.0

    def __init__(self, logs: JobLogStore, run_id: int, job_id: str) -> None:
        self._logs = logs
        self.run_id = run_id
        self.job_id = job_id
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._closing = False
        self._seq = 0
        self._warned = False
        self._thread = threading.Thread(
            target=self._loop, name=f"preloop-log-{job_id}", daemon=True
        )
        self._thread.start()

    def add(self, line: str) -> None:
        self.add_many([line])

    def add_many(self, lines: list[str]) -> None:
        """`add` for each of `lines`, under one lock."""
        if not lines:
            return
        with self._cond:
            before = len(self._pending)
            self._pending.extend(lines)
            if before == 0 or len(self._pending) >= self.MAX_BATCH:
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return  # closing, nothing left
                if not self._closing:
                    # Gather what the step prints right after its first line.
                    self._cond.wait_for(
                        lambda: len(self._pending) >= self.MAX_BATCH or self._closing,
                        timeout=self.GATHER,
                    )
                batch = self._pending[: self.MAX_BATCH]
            try:
                self._logs.append(self.run_id, self.job_id, self._seq, batch)
            except PreloopError as exc:
                # The store's own retries gave up: keep the lines, pause, retry.
                if not self._warned:
                    _log.warning(
                        "log lines of run %s job %r not stored yet (will retry): %s",
                        self.run_id,
                        self.job_id,
                        exc,
                    )
                    self._warned = True
                with self._cond:
                    self._cond.wait(timeout=self.RETRY_PAUSE)
                continue
            self._seq += 1
            with self._cond:
                del self._pending[: len(batch)]

    def close(self) -> bool:
        """Sends what is left; False when the store did not take it in time."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(self.CLOSE_WAIT)
        return not self._thread.is_alive()


class JobLog:
    """Appends one job's log lines (already masked) to its log file, and with
    `remote` to the store as well."""

    def __init__(
        self,
        state_dir: Path,
        run_id: int | str,
        job_id: str,
        remote: JobLogStore | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.run_id = run_id
        self.job_id = job_id
        self.path = log_path(state_dir, run_id, job_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._start = time.monotonic()
        self._remote = remote
        self._shipper = None if remote is None else LogShipper(remote, int(run_id), job_id)

    def write(self, line: str) -> None:
        self.write_lines([line])

    def write_lines(self, lines: list[str]) -> None:
        """Appends `lines` with one write and one flush."""
        if not lines:
            return
        if self._file is not None:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        if self._shipper is not None:
            self._shipper.add_many(lines)

    def save_result(self, result: JobResult) -> None:
        path = result_path(self.state_dir, self.run_id, self.job_id)
        tmp = path.with_suffix(".json.tmp")
        doc = asdict(result)
        tmp.write_text(json.dumps(doc, sort_keys=True, indent=1))
        tmp.replace(path)
        if self._remote is not None:
            # The lines first: a follower that sees the result has every line.
            self._close_shipper()
            try:
                self._remote.save_result(int(self.run_id), self.job_id, doc)
            except PreloopError as exc:
                _log.warning(
                    "the result of run %s job %r was not stored: %s", self.run_id, self.job_id, exc
                )

    def _close_shipper(self) -> None:
        shipper, self._shipper = self._shipper, None
        if shipper is not None and not shipper.close():
            _log.warning(
                "log lines of run %s job %r did not reach the store in time; the runner's "
                "state directory keeps them in %s",
                self.run_id,
                self.job_id,
                self.path,
            )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._close_shipper()
