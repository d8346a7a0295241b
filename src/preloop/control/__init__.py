"""The SQL scheduler: lite (SQLite) and PostgreSQL stores behind one `Store`.

`open_store(url)` opens (and migrates) a store; every `Store` method is one
transaction that reads only the rows it involves. See `preloop.control.store`
for the operations, statuses and the lock order.
"""

from preloop.control.counters import Counters, CountersSnapshot
from preloop.control.db import StoreError
from preloop.control.store import (
    TERMINAL,
    Completion,
    Heartbeat,
    JobInfo,
    JobResultItem,
    Lease,
    NonTerminalConclusion,
    RunInfo,
    Store,
    UnknownRun,
    open_store,
)

__all__ = [
    "TERMINAL",
    "Completion",
    "Counters",
    "CountersSnapshot",
    "Heartbeat",
    "JobInfo",
    "JobResultItem",
    "Lease",
    "NonTerminalConclusion",
    "RunInfo",
    "Store",
    "StoreError",
    "UnknownRun",
    "open_store",
]
