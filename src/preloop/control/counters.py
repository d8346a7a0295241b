"""Instrumentation every store keeps: graph loads, statements per operation,
and on PostgreSQL the settle lock hold and `lock_run` wait times.

Tests and benchmarks read `Store.counters.snapshot()`; nothing here changes
behaviour.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["Counters", "CountersSnapshot"]


@dataclass(frozen=True, slots=True)
class CountersSnapshot:
    """A consistent copy of `Counters` at one moment."""

    graph_loads: int
    operations: dict[str, int]
    statements: dict[str, int]
    settle_lock_hold_ns: int
    settle_lock_holds: int
    #: The part of the two above held by one-statement operations (a batch's
    #: `preloop_complete_claim`), as the server measured it.
    statement_lock_hold_ns: int
    statement_lock_holds: int
    lock_run_wait_ns: int
    lock_run_waits: int
    deadlock_retries: int

    def statements_per(self, op: str) -> float:
        """Mean statements per call of operation `op` (0 when never called)."""
        n = self.operations.get(op, 0)
        return self.statements.get(op, 0) / n if n else 0.0

    @property
    def mean_settle_lock_hold_ms(self) -> float:
        return (
            self.settle_lock_hold_ns / self.settle_lock_holds / 1e6
            if self.settle_lock_holds
            else 0.0
        )

    @property
    def mean_lock_run_wait_ms(self) -> float:
        return self.lock_run_wait_ns / self.lock_run_waits / 1e6 if self.lock_run_waits else 0.0


@dataclass
class Counters:
    """Live counters, shared by every thread using one store."""

    graph_loads: int = 0
    operations: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    statements: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    settle_lock_hold_ns: int = 0
    settle_lock_holds: int = 0
    statement_lock_hold_ns: int = 0
    statement_lock_holds: int = 0
    lock_run_wait_ns: int = 0
    lock_run_waits: int = 0
    deadlock_retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_statements(self, op: str, n: int) -> None:
        with self._lock:
            self.operations[op] += 1
            self.statements[op] += n

    def add_graph_load(self) -> None:
        with self._lock:
            self.graph_loads += 1

    def add_lock_run_wait(self, ns: int) -> None:
        with self._lock:
            self.lock_run_wait_ns += ns
            self.lock_run_waits += 1

    def add_settle_lock_hold(self, ns: int, *, statement: bool = False) -> None:
        with self._lock:
            self.settle_lock_hold_ns += ns
            self.settle_lock_holds += 1
            if statement:
                self.statement_lock_hold_ns += ns
                self.statement_lock_holds += 1

    def add_deadlock_retry(self) -> None:
        with self._lock:
            self.deadlock_retries += 1

    def snapshot(self) -> CountersSnapshot:
        with self._lock:
            return CountersSnapshot(
                graph_loads=self.graph_loads,
                operations=dict(self.operations),
                statements=dict(self.statements),
                settle_lock_hold_ns=self.settle_lock_hold_ns,
                settle_lock_holds=self.settle_lock_holds,
                statement_lock_hold_ns=self.statement_lock_hold_ns,
                statement_lock_holds=self.statement_lock_holds,
                lock_run_wait_ns=self.lock_run_wait_ns,
                lock_run_waits=self.lock_run_waits,
                deadlock_retries=self.deadlock_retries,
            )

    def reset(self) -> None:
        with self._lock:
            self.graph_loads = 0
            self.operations.clear()
            self.statements.clear()
            self.settle_lock_hold_ns = self.settle_lock_holds = 0
            self.statement_lock_hold_ns = self.statement_lock_holds = 0
            self.lock_run_wait_ns = self.lock_run_waits = 0
            self.deadlock_retries = 0
