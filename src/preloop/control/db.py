"""Connections for the two stores: lite (SQLite) and pg (PostgreSQL).

Both expose the same `Tx` (one transaction): SQL is written once with `?`
placeholders; the pg backend rewrites them to `%s`. Every statement is counted
against the operation that runs it; `lock_run` is timed on PostgreSQL (wait),
and so is the time from taking the run lock to commit (settle lock hold): by
the server for a one-statement operation whose function reports it
(`Tx.note_lock_hold`), here otherwise.

lite: one connection per store object, WAL, `synchronous=NORMAL`, a busy
timeout, every transaction `BEGIN IMMEDIATE` (SQLite has one writer, so
transactions never deadlock; several processes wait on the busy timeout).

pg: a `psycopg_pool.ConnectionPool`; READ COMMITTED; a transaction that hits
a deadlock or serialization failure is retried from the start (counted, so
tests can assert there were none).

pg, database faults: a transaction whose connection is lost (server restart,
`pg_terminate_backend`, a network cut) is retried on a fresh connection with
bounded exponential backoff, for as long as the server stays unreachable
(after `outage_warn_after` seconds one line says so, on stderr, and the
retrying goes on). Retrying is idempotent by construction, for every store
operation without per-method care:

- each operation is one transaction and `fn` only reads and writes through
  it, so an attempt that did not commit left nothing behind and rerunning
  `fn` from the start is the same operation (this already holds for the
  deadlock retry);
- the one ambiguous moment is a connection lost during COMMIT: the server may
  have committed and the answer was lost. Before committing, each attempt
  reads its transaction id (`pg_current_xact_id_if_assigned()`, one short
  statement; null on a read-only transaction, which has nothing to commit
  and whose rows are returned as read); after a lost COMMIT the status of
  that id is asked on a new connection (`pg_xact_status`): `committed` returns the attempt's result
  (it is never rerun), `aborted` or unknown reruns it. So a claim, a
  completion or a submission is applied exactly once.

Connections are in autocommit mode: a transaction is an explicit BEGIN ...
COMMIT (`Backend.transaction`), and an operation that is one statement (a
server-side function doing its own work, a claim) runs as that statement
alone, one round trip (`Backend.statement`); a lost connection there is
retried through `transaction`, whose commit check applies it exactly once.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from preloop import config
from preloop.control.counters import Counters
from preloop.control.schema import MIGRATIONS, render
from preloop.control.wakeups import Listener
from preloop.errors import PreloopError

__all__ = ["Backend", "LiteBackend", "PgBackend", "Row", "StoreError", "Tx"]

Row = dict[str, Any]
T = TypeVar("T")
Dialect = Literal["lite", "pg"]

# The run columns a locked run row carries (what concludes the run).
_RUN_COLS = "id, status, cancel_requested, conc_group, remaining_jobs, failed_jobs, cancelled_jobs"

# A transaction-scoped advisory lock key: "preloop" migrations.
_MIGRATION_LOCK = 0x7072656C6F6F70


class StoreError(PreloopError):
    """The scheduler store cannot be opened or used."""


# Backoff between attempts on a lost connection: doubles from the first to the last.
_RETRY_FIRST = 0.05
_RETRY_MAX = 2.0
# SQLSTATEs of a server that ends or refuses the session (class 08 is the
# connection exception class): admin shutdown, crash shutdown, cannot connect now.
_LOST_STATES = frozenset({"57P01", "57P02", "57P03"})


class Tx:
    """One transaction. `op` names the operation its statements count against."""

    __slots__ = ("_backend", "_cur", "_pg", "lock_held_ns", "lock_taken_ns", "op", "statements")

    def __init__(self, backend: Backend, cur: Any, op: str) -> None:
        self._backend = backend
        self._cur = cur
        self._pg = backend.dialect == "pg"
        self.op = op
        self.statements = 0
        self.lock_taken_ns = 0
        #: The run lock's hold as the server measured it (None: timed here).
        self.lock_held_ns: int | None = None

    @property
    def dialect(self) -> Dialect:
        return self._backend.dialect

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Runs one statement; returns its rows (empty for statements without)."""
        self.statements += 1
        if self._pg:
            if params:
                self._cur.execute(_pg_sql(sql), params)
            else:  # no placeholders: the text goes as is (plpgsql bodies use %)
                self._cur.execute(sql)
            return list(self._cur.fetchall()) if self._cur.description else []
        cur = self._cur.execute(sql, params)
        if cur.description is None:
            return []
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self.execute(sql, params)
        return rows[0] if rows else None

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if not rows:
            return
        self.statements += 1
        if self._pg:
            self._cur.executemany(_pg_sql(sql), rows)
        else:
            self._cur.executemany(sql, rows)

    def lock_run(self, run_id: int, settle_delta: int | None = None) -> Row | None:
        """The run row, locked (pg: the wait is timed; lite already holds the
        write lock). Lock order: this comes before any job row. With
        `settle_delta` the lock is taken by the statement that adjusts
        `remaining_jobs` (the settle path's first write)."""
        cols = _RUN_COLS
        if settle_delta is not None:
            sql = (
                f"UPDATE runs SET remaining_jobs = remaining_jobs + ? WHERE id = ? RETURNING {cols}"
            )
            params: tuple[Any, ...] = (settle_delta, run_id)
        else:
            sql = f"SELECT {cols} FROM runs WHERE id = ?" + (" FOR UPDATE" if self._pg else "")
            params = (run_id,)
        t0 = time.perf_counter_ns()
        row = self.one(sql, params)
        t1 = time.perf_counter_ns()
        if self._pg:
            self._backend.counters.add_lock_run_wait(t1 - t0)
        self.lock_taken_ns = self.lock_taken_ns or t1
        return row

    def note_lock_run_wait(self, call_start_ns: int, wait_ns: int) -> None:
        """For a server-side function that took the run lock itself: `wait_ns`
        as it measured, and the hold counted from when the wait ended."""
        self._backend.counters.add_lock_run_wait(wait_ns)
        self.lock_taken_ns = self.lock_taken_ns or call_start_ns + wait_ns

    def note_lock_hold(self, hold_ns: int) -> None:
        """For a server-side function that took the run lock and committed in
        the same statement: the hold as it measured it, from taking the lock
        to its end (the commit). Timed here instead, it would also count the
        answer's way back and its decoding, after the server let go."""
        self.lock_held_ns = (self.lock_held_ns or 0) + hold_ns

    def try_lock_run(self, run_id: int) -> Row | None:
        """The run row if it can be locked without waiting (pg `SKIP LOCKED`):
        used only when the caller already holds a different run's lock, so no
        transaction ever waits on run rows out of order."""
        sql = f"SELECT {_RUN_COLS} FROM runs WHERE id = ?"
        if not self._pg:
            return self.one(sql, (run_id,))
        return self.one(sql + " FOR UPDATE SKIP LOCKED", (run_id,))

    def lock_runs(self, run_ids: Sequence[int]) -> None:
        """Locks the rows of several runs, in id order (pg; the wait is timed
        as `lock_run`'s): for a transaction about to settle jobs of each, so
        it never holds a row of one (or a group its cascade takes) while
        waiting for another's out of order. Lite already holds the write lock."""
        if not self._pg or not run_ids:
            return
        t0 = time.perf_counter_ns()
        self.execute(_LOCK_RUNS, (sorted(set(run_ids)),))
        t1 = time.perf_counter_ns()
        self._backend.counters.add_lock_run_wait(t1 - t0)
        self.lock_taken_ns = self.lock_taken_ns or t1

    def lock_runs_within(self, run_ids: Sequence[int], wait: str) -> bool:
        """`lock_runs`, waiting at most `wait` (a PostgreSQL interval such as
        "200ms") for each row: False, with none of them taken and nothing
        else of the transaction undone, when one stays held longer. For a
        transaction that holds no other row yet, so it takes run rows in the
        order every transaction does. Lite has one writer: always True."""
        if not self._pg or not run_ids:
            return True
        import psycopg

        prev = self.one("SELECT current_setting('lock_timeout') AS v")
        assert prev is not None
        self.execute("SAVEPOINT preloop_lock_runs")
        try:
            self.execute("SELECT set_config('lock_timeout', ?, true)", (wait,))
            self.lock_runs(run_ids)
        except psycopg.errors.LockNotAvailable:
            # Also undoes the timeout set above.
            self.execute("ROLLBACK TO SAVEPOINT preloop_lock_runs")
            return False
        # Releasing the savepoint would keep the short timeout for the rest
        # of the transaction.
        self.execute("SELECT set_config('lock_timeout', ?, true)", (prev["v"],))
        self.execute("RELEASE SAVEPOINT preloop_lock_runs")
        return True

    def next_wait_seqs(self, n: int = 1) -> list[int]:
        """`n` places in the groups' queues, in increasing order. PostgreSQL
        takes them from the `wait_order` sequence (schema migration 27),
        which no transaction holds: a counter row would be held by every
        writer of a waiter until it commits, a queue shared by every group
        of every run. Lite has one writer and keeps the `wait_seq` row."""
        if self._pg:
            rows = self.execute(
                "SELECT nextval('wait_order') AS v FROM generate_series(1, ?) ORDER BY 1", (n,)
            )
            return [int(r["v"]) for r in rows]
        row = self.one("UPDATE wait_seq SET value = value + ? WHERE id = 1 RETURNING value", (n,))
        assert row is not None
        last = int(row["value"])
        return list(range(last - n + 1, last + 1))


# Rows locked in the order they come out of the sort: every transaction that
# takes several run rows takes them in id order.
_LOCK_RUNS = "SELECT id FROM runs WHERE id = ANY(?::BIGINT[]) ORDER BY id FOR UPDATE"

_PG_CACHE: dict[str, str] = {}


def _pg_sql(sql: str) -> str:
    out = _PG_CACHE.get(sql)
    if out is None:
        out = _PG_CACHE[sql] = sql.replace("?", "%s")
    return out


class Backend(ABC):
    """What the scheduler needs from a database."""

    dialect: Dialect
    url: str

    def __init__(self) -> None:
        self.counters = Counters()

    @abstractmethod
    def transaction(self, op: str, fn: Callable[[Tx], T]) -> T:
        """Runs `fn` in one transaction (retried whole on a pg deadlock)."""

    def statement(self, op: str, fn: Callable[[Tx], T]) -> T:
        """Runs `fn`, which issues exactly one statement, as its own
        transaction: on PostgreSQL one round trip (autocommit, no BEGIN or
        COMMIT); on SQLite the same as `transaction`."""
        return self.transaction(op, fn)

    def once_per_connection(self, op: str, fn: Callable[[Tx], T]) -> T | None:
        """Runs `fn` (one statement, as `statement`) the first time `op` is
        asked on the server session this thread's next operations use, and
        returns its result; None, doing nothing, every time after. For work a
        session does once, such as planning a function's statements before a
        call that holds a lock runs them. Lite has no server sessions: None."""
        return None

    def listener(self, start: bool = True) -> Listener | None:
        """The process's wake-up listener (pg; started on first use unless
        `start` is false), or None."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Releases the connection(s)."""

    def _finish(self, tx: Tx, committed_ns: int) -> None:
        self.counters.add_statements(tx.op, tx.statements)
        if self.dialect != "pg":
            return
        if tx.lock_held_ns is not None and tx.statements == 1:
            # One statement in autocommit: its end was the commit.
            self.counters.add_settle_lock_hold(tx.lock_held_ns, statement=True)
        elif tx.lock_taken_ns:
            # More statements after the lock: the round trips to commit hold it too.
            self.counters.add_settle_lock_hold(committed_ns - tx.lock_taken_ns)


class LiteBackend(Backend):
    """SQLite in WAL mode; one connection guarded by a lock."""

    dialect: Dialect = "lite"

    def __init__(self, path: Path, busy_timeout_ms: int = 30_000) -> None:
        super().__init__()
        self.url = f"sqlite:///{path}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                str(path),
                isolation_level=None,
                check_same_thread=False,
                timeout=busy_timeout_ms / 1000,
            )
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            _enable_wal(self._conn, busy_timeout_ms / 1000)
            self._conn.execute("PRAGMA synchronous = NORMAL")
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(
                f"cannot open the lite store at {path}: {exc} (check the directory is writable)"
            ) from None
        self._lock = threading.RLock()
        self._migrate()

    def _migrate(self) -> None:
        self.transaction("migrate", lambda tx: _apply_migrations(tx, "lite", self.url))

    def transaction(self, op: str, fn: Callable[[Tx], T]) -> T:
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            tx = Tx(self, conn, op)
            try:
                result = fn(tx)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            self._finish(tx, time.perf_counter_ns())
            return result

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class PgBackend(Backend):
    """PostgreSQL through a psycopg 3 connection pool."""

    dialect: Dialect = "pg"

    def __init__(
        self,
        url: str,
        max_size: int = 16,
        *,
        outage_warn_after: float | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        import psycopg
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool, PoolTimeout

        self.url = url
        # One direct attempt first: an unreachable server or a permanent error
        # (no such database, bad credentials) is one line at once, not the
        # pool's retries and multi-line warnings until its timeout.
        try:
            psycopg.connect(url, connect_timeout=10).close()
        except Exception as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise StoreError(
                f"cannot connect to the PostgreSQL store {_redact(url)}: {reason}"
            ) from None
        self._errors = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
        # A lost or unobtainable connection: retried (see the module docstring).
        self._lost = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)
        #: Seconds of outage before one line reports it (default: the lease).
        self.outage_warn_after = (
            float(config.get("PRELOOP_LEASE_SECONDS"))
            if outage_warn_after is None
            else outage_warn_after
        )
        self._warn = warn or _stderr_line
        self.connection_retries = 0
        self._local = threading.local()
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()
        # Connections checked out by threads, with their thread: one that
        # ended (an anyio worker thread retires after idling) gives its back.
        self._held: list[tuple[threading.Thread, Any]] = []
        self._held_lock = threading.Lock()
        # What `once_per_connection` did on each open connection.
        self._done_on: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            kwargs={"row_factory": dict_row, "autocommit": True},
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=30)
        except Exception as exc:
            self._pool.close()
            raise StoreError(
                f"cannot connect to the PostgreSQL store {_redact(url)}: {exc} "
                "(check PRELOOP_STORE_URL and that the server is running)"
            ) from None
        self._migrate()

    def _migrate(self) -> None:
        def apply(tx: Tx) -> None:
            # Two nodes starting together: the second waits, then finds nothing to do.
            tx.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            _apply_migrations(tx, "pg", self.url)

        self.transaction("migrate", apply)

    def _connection(self) -> Any:
        """This thread's connection: checked out of the pool once and kept, so
        a transaction costs only its own round trips."""
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            self._reclaim_ended()
            conn = self._local.conn = self._pool.getconn()
            with self._held_lock:
                self._held.append((threading.current_thread(), conn))
        return conn

    def once_per_connection(self, op: str, fn: Callable[[Tx], T]) -> T | None:
        try:
            conn = self._connection()
        except self._lost:
            # None to be had now: the operation that follows waits for one
            # (`statement`), and this is done before a later one.
            return None
        with self._held_lock:
            done = self._done_on.setdefault(conn, set())
            if op in done:
                return None
            done.add(op)
        # Lost meanwhile, it runs on a fresh connection, which is not marked:
        # done again before that one's next such operation (harmless).
        return self.statement(op, fn)

    def _reclaim_ended(self) -> None:
        """Gives back the connections of threads that ended: a long-lived
        process whose worker threads come and go would otherwise run the
        pool dry."""
        with self._held_lock:
            ended = [conn for thread, conn in self._held if not thread.is_alive()]
            self._held = [(t, c) for t, c in self._held if t.is_alive()]
        for conn in ended:
            with contextlib.suppress(Exception):
                self._pool.putconn(conn)

    def _drop_connection(self, conn: Any) -> None:
        self._local.conn = None
        with self._held_lock:
            self._held = [(t, c) for t, c in self._held if c is not conn]
        with contextlib.suppress(Exception):  # a broken one is discarded by the pool
            self._pool.putconn(conn)

    def transaction(self, op: str, fn: Callable[[Tx], T]) -> T:
        outage_start: float | None = None
        warned = False
        conflicts = 0
        delay = _RETRY_FIRST
        while True:
            conn: Any = None
            xid: Any = None
            ran = False
            try:
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    tx = Tx(self, cur, op)
                    result = fn(tx)
                    cur.execute("SELECT pg_current_xact_id_if_assigned()::text AS xid")
                    row = cur.fetchone()
                    xid = row["xid"] if row else None
                    ran = True
                # Leaving the block committed.
            except self._errors:
                # Rolled back by the server: rerunning is safe. A short jittered
                # backoff (at most 0.1 s) lets the other transaction finish.
                self.counters.add_deadlock_retry()
                conflicts += 1
                time.sleep(random.uniform(0, min(0.001 * 2**conflicts, 0.1)))
                continue
            except self._lost as exc:
                if not _connection_lost(exc, conn):
                    # e.g. a lock or statement timeout: one line, never a traceback.
                    raise StoreError(
                        f"the store {_redact(self.url)} failed: {_one_line(exc)}"
                    ) from None
                # A broken connection goes back to the pool (which replaces it).
                if conn is not None:
                    self._drop_connection(conn)
                # Read-only (nothing to commit), or the lost COMMIT did commit:
                # the attempt's result stands and `fn` is not rerun.
                if not (ran and (xid is None or self._committed(xid))):
                    now = time.monotonic()
                    outage_start = outage_start or now
                    if not warned and now - outage_start >= self.outage_warn_after:
                        warned = True
                        self._warn(
                            f"preloop: the store {_redact(self.url)} has been unreachable for "
                            f"{now - outage_start:.0f}s ({_one_line(exc)}); still trying"
                        )
                    self.connection_retries += 1
                    time.sleep(delay)
                    delay = min(delay * 2, _RETRY_MAX)
                    continue
            if warned:
                self._warn(f"preloop: the store {_redact(self.url)} is reachable again")
            self._finish(tx, time.perf_counter_ns())
            return result

    def statement(self, op: str, fn: Callable[[Tx], T]) -> T:
        while True:
            conn: Any = None
            try:
                conn = self._connection()
                with conn.cursor() as cur:
                    tx = Tx(self, cur, op)
                    result = fn(tx)
            except self._errors:
                self.counters.add_deadlock_retry()
                continue
            except self._lost as exc:
                if not _connection_lost(exc, conn):
                    raise  # the statement's own error: callers read its sqlstate
                if conn is not None:
                    self._drop_connection(conn)
                # An autocommitted statement whose answer was lost may have run:
                # the retry goes through `transaction`, whose commit check then
                # applies it exactly once from here on. The statements sent
                # here are a heartbeat (idempotent), a claim (the rerun first
                # looks for the jobs a committed attempt claimed, by runner and
                # claim time: `Store._pg_call`) and a completion (idempotent
                # per job).
                return self.transaction(op, fn)
            self._finish(tx, time.perf_counter_ns())
            return result

    def _committed(self, xid: str) -> bool:
        """Whether transaction `xid` committed (asked on a fresh connection
        until the server answers). 'in progress' cannot last: its backend is
        gone, so the server aborts it; we ask again."""
        delay = _RETRY_FIRST
        while True:
            conn: Any = None
            try:
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    cur.execute("SELECT pg_xact_status(%s::xid8) AS s", (xid,))
                    row = cur.fetchone()
                status = row["s"] if row else None
            except self._lost as exc:
                if not _connection_lost(exc, conn):
                    raise
                if conn is not None:
                    self._drop_connection(conn)
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            if status == "in progress":
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            return bool(status == "committed")

    def listener(self, start: bool = True) -> Listener | None:
        with self._listener_lock:
            if self._listener is None and start:
                self._listener = Listener(self.url)
            return self._listener

    def close(self) -> None:
        with self._listener_lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._held_lock:
            held, self._held = self._held, []
        for _, conn in held:
            self._pool.putconn(conn)
        self._pool.close()


def _stderr_line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _connection_lost(exc: BaseException, conn: Any) -> bool:
    """Whether `exc` means the connection is gone (or none could be had), as
    opposed to an error of the statement on a working connection."""
    if conn is None or conn.closed or getattr(conn, "broken", False):
        return True
    state = getattr(exc, "sqlstate", None) or ""
    return state.startswith("08") or state in _LOST_STATES


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _enable_wal(conn: sqlite3.Connection, timeout: float) -> None:
    """Switches a new database to WAL. Two stores opening one fresh file
    together race for the switch, and SQLite answers the loser "database is
    locked" without calling the busy handler: retry until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)  # back off: the other connection is mid-switch


def _check_version(have: int, url: str) -> None:
    if have > len(MIGRATIONS):
        raise StoreError(
            f"the store {_redact(url)} has schema version {have}, newer than this preloop "
            f"knows ({len(MIGRATIONS)}): upgrade preloop"
        )


def _apply_migrations(tx: Tx, dialect: str, url: str) -> None:
    """Brings the schema from its recorded version to `len(MIGRATIONS)`, in `tx`."""
    tx.execute("CREATE TABLE IF NOT EXISTS preloop_schema_version (version INTEGER NOT NULL)")
    row = tx.one("SELECT version FROM preloop_schema_version")
    have = int(row["version"]) if row else 0
    if row is None:
        tx.execute("INSERT INTO preloop_schema_version (version) VALUES (0)")
    _check_version(have, url)
    for migration in MIGRATIONS[have:]:
        for statement in migration:
            sql = render(statement, dialect)
            if sql is not None:
                tx.execute(sql)
    tx.execute("UPDATE preloop_schema_version SET version = ?", (len(MIGRATIONS),))


def _redact(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
