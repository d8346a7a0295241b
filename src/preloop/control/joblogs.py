"""Job logs and results in the store: how a job's output reaches machines
that share only the database (`preloop logs` anywhere, the submitting
`preloop run` showing a remote job live).

A job's writer (its runner) numbers its batches of lines 0, 1, 2, ... and
inserts each as one row `(run_id, job_id, seq)`. The insert is idempotent by
construction: ON CONFLICT DO NOTHING on that key, so the store's retry of a
lost connection (`preloop.control.db`), which may rerun a batch that did
commit, writes nothing twice. A result is one row per job, replaced on
rewrite. Lines arrive masked: nothing here sees a secret.

On PostgreSQL each write also NOTIFYs `LOGS` (delivered at commit), so a
follower wakes at once instead of polling.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from preloop.control.wakeups import LOGS

if TYPE_CHECKING:
    from preloop.control.store import Store

__all__ = ["JobElsewhere", "JobLogStore", "LogBatch"]


@dataclass(frozen=True, slots=True)
class LogBatch:
    job_id: str
    seq: int
    lines: list[str]


@dataclass(frozen=True, slots=True)
class JobElsewhere:
    """A job of a run that a runner other than the caller's has claimed."""

    job_id: str
    name: str
    status: str
    conclusion: str | None
    runner: str
    started_at: float | None
    completed_at: float | None


class JobLogStore:
    """Job logs and results of one open `Store` (lite or PostgreSQL).
    Thread-safe as the store is; every method is one statement."""

    def __init__(self, store: Store) -> None:
        self._db = store.backend
        self._pg = store.dialect == "pg"

    def _write(self, op: str, sql: str, params: Sequence[Any]) -> None:
        """One write as one statement (on PostgreSQL one round trip, the
        NOTIFY in the same statement: a CTE around the write)."""
        if self._pg:
            sql = f"WITH w AS ({sql} RETURNING 1) SELECT pg_notify('{LOGS}', '') FROM w"
        self._db.statement(op, lambda tx: tx.execute(sql, params))

    def append(self, run_id: int, job_id: str, seq: int, lines: Sequence[str]) -> None:
        """Stores batch `seq` of the job's lines (a rerun of the same batch is a no-op)."""
        self._write(
            "log_append",
            "INSERT INTO preloop_job_logs (run_id, job_id, seq, lines, at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, job_id, seq) DO NOTHING",
            (run_id, job_id, seq, "\n".join(lines), time.time()),
        )

    def save_result(self, run_id: int, job_id: str, result: dict[str, Any]) -> None:
        """Stores the job's result (`JobResult` as a dict), replacing an older one."""
        self._write(
            "log_result",
            "INSERT INTO preloop_job_results (run_id, job_id, result, at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (run_id, job_id) "
            "DO UPDATE SET result = excluded.result, at = excluded.at",
            (run_id, job_id, json.dumps(result, sort_keys=True), time.time()),
        )

    def read(
        self, run_id: int, job_id: str | None = None, after: dict[str, int] | None = None
    ) -> list[LogBatch]:
        """The run's (or one job's) batches in order, each job's after the
        seq `after` maps it to (a follower passes what it has printed)."""
        sql = "SELECT job_id, seq, lines FROM preloop_job_logs WHERE run_id = ?"
        params: list[Any] = [run_id]
        if job_id is not None:
            sql += " AND job_id = ?"
            params.append(job_id)
        rows = self._db.statement(
            "log_read", lambda tx: tx.execute(sql + " ORDER BY job_id, seq", params)
        )
        seen = after or {}
        return [
            LogBatch(str(r["job_id"]), int(r["seq"]), str(r["lines"]).split("\n"))
            for r in rows
            if int(r["seq"]) > seen.get(str(r["job_id"]), -1)
        ]

    def jobs_with_logs(self, run_id: int) -> set[str]:
        rows = self._db.statement(
            "log_jobs",
            lambda tx: tx.execute(
                "SELECT DISTINCT job_id FROM preloop_job_logs WHERE run_id = ?", (run_id,)
            ),
        )
        return {str(r["job_id"]) for r in rows}

    def results(self, run_id: int) -> dict[str, dict[str, Any]]:
        """The stored results of the run's jobs, by job id."""
        rows = self._db.statement(
            "log_results",
            lambda tx: tx.execute(
                "SELECT job_id, result FROM preloop_job_results WHERE run_id = ?", (run_id,)
            ),
        )
        out: dict[str, dict[str, Any]] = {}
        for r in rows:
            try:
                doc = json.loads(str(r["result"]))
            except ValueError:
                continue
            if isinstance(doc, dict):
                out[str(r["job_id"])] = doc
        return out

    def jobs_elsewhere(self, run_id: int, runner_prefix: str) -> list[JobElsewhere]:
        """The run's jobs claimed by runners whose names do not start with
        `runner_prefix` (the caller's own): what a submitter follows."""
        rows = self._db.statement(
            "log_elsewhere",
            lambda tx: tx.execute(
                "SELECT id, name, status, conclusion, runner, started_at, completed_at "
                "FROM jobs WHERE run_id = ? AND kind = 'job' AND runner IS NOT NULL "
                "AND substr(runner, 1, ?) <> ?",
                (run_id, len(runner_prefix), runner_prefix),
            ),
        )
        return [
            JobElsewhere(
                str(r["id"]),
                str(r["name"]),
                str(r["status"]),
                r["conclusion"],
                str(r["runner"]),
                r["started_at"],
                r["completed_at"],
            )
            for r in rows
        ]
