"""The store's record of snapshot bundles: chains, holds and their byte cap.

A run's snapshot reaches runners that share only the store as a *chain* of
git bundles (blobs of kind `bundle` in `preloop.control.blobs`): a full
bundle first, then bundles each thin against the ones before it. Rows of
`preloop_bundles` (migration `_V11_BUNDLES`) name each bundle's repository
(`repo_key`: the submitter's object-cache key), the commit it brings
(`tip`), the bundle it builds on (`parent`, NULL for a full one) and its
`depth` in the chain. The invariant every function here keeps: **a stored
bundle's chain is whole**, so fetching a chain root first always succeeds.

- A *hold* (`preloop_bundle_holds`, one row per `preloop run` invocation,
  keyed by its run key) pins every blob of its chain as `run:<run key>`;
  `release` drops it when the run ends, and `release_ended` (the reaper)
  drops holds whose runs all ended without it (their `preloop run` died).
- `evict` keeps the bundles under a byte cap by removing whole *unheld
  subtrees* (a bundle with every bundle built on it), least recently used
  first, dependents before what they build on: never a held chain, never a
  bundle without its prerequisites.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preloop.control.blobs import BlobMissing, BlobStore

if TYPE_CHECKING:
    from preloop.control.db import Row, Tx
    from preloop.control.store import Store

__all__ = [
    "BUNDLE_KIND",
    "HOLD_GRACE",
    "BundleRow",
    "SnapshotBundles",
    "run_holder",
]

BUNDLE_KIND = "bundle"
#: A hold none of whose runs is unfinished is released by the reaper once it is
#: this old (its submitter submits within seconds of holding; a hold that old
#: with no unfinished run belongs to a `preloop run` that died or forgot).
HOLD_GRACE = 600.0
#: Rows read per repository when choosing a base (newest first).
_CANDIDATES = 256


def run_holder(run_key: str) -> str:
    """The pin holder of a `preloop run` invocation's chain."""
    return f"run:{run_key}"


@dataclass(frozen=True, slots=True)
class BundleRow:
    digest: str
    repo_key: str
    tip: str
    parent: str | None
    depth: int
    created_at: float


class SnapshotBundles:
    """Bundle rows, holds and eviction in one open `Store`. Every method is
    one or a few short transactions; all are safe to retry (the store's retry
    of a lost connection reruns them)."""

    def __init__(self, store: Store) -> None:
        self._db = store.backend
        self._pg = store.dialect == "pg"
        self.blobs = BlobStore(store)

    # ------------------------------------------------------------------ rows

    def stored(self, repo_key: str) -> dict[str, BundleRow]:
        """The newest bundles of `repo_key` whose blob is stored whole, by digest."""
        rows = self._db.transaction(
            "bundle_stored",
            lambda tx: tx.execute(
                "SELECT u.digest, u.repo_key, u.tip, u.parent, u.depth, u.created_at "
                "FROM preloop_bundles u JOIN preloop_blobs b ON b.digest = u.digest "
                "WHERE u.repo_key = ? AND b.complete = 1 ORDER BY u.created_at DESC LIMIT ?",
                (repo_key, _CANDIDATES),
            ),
        )
        return {str(r["digest"]): _row(r) for r in rows}

    def rows(self, digests: Sequence[str]) -> dict[str, BundleRow]:
        """The rows of `digests` that exist (with or without a stored blob)."""
        if not digests:
            return {}
        marks = ", ".join("?" for _ in digests)
        rows = self._db.transaction(
            "bundle_rows",
            lambda tx: tx.execute(
                "SELECT digest, repo_key, tip, parent, depth, created_at FROM preloop_bundles "
                f"WHERE digest IN ({marks})",
                tuple(digests),
            ),
        )
        return {str(r["digest"]): _row(r) for r in rows}

    @staticmethod
    def chain(rows: dict[str, BundleRow], digest: str) -> list[BundleRow] | None:
        """The chain ending at `digest`, root first; None when a link is not in `rows`."""
        out: list[BundleRow] = []
        current: str | None = digest
        while current is not None:
            row = rows.get(current)
            if row is None or len(out) > len(rows):  # absent, or a cycle (never written)
                return None
            out.append(row)
            current = row.parent
        out.reverse()
        return out

    # ----------------------------------------------------------------- holds

    def hold(
        self,
        run_key: str,
        repo_key: str,
        chain: Sequence[str],
        new: BundleRow | None = None,
        data: bytes | None = None,
    ) -> None:
        """Pins every blob of `chain` for run `run_key` and records the hold,
        with the bundle `new` (the chain's last) if given, and its bytes
        `data` if given (at most one `BlobStore.CHUNK`: stored in this very
        transaction, so a small bundle costs one commit). Raises
        `BlobMissing`, having written nothing, when a blob of the chain is not
        stored (evicted meanwhile: the caller builds another chain).

        The blob rows are locked (in digest order: no deadlock between two
        holders) before the pins are written, the order `BlobStore.delete`
        relies on: a blob pinned here is kept, one deleted first is missing."""
        holder = run_holder(run_key)
        head = chain[-1] if chain else ""
        if data is not None:
            assert new is not None and len(data) <= BlobStore.CHUNK

        def fn(tx: Tx) -> None:
            now = time.time()
            if data is not None and new is not None:
                # The blob format of `preloop.control.blobs` for a one-chunk
                # blob: row and chunk 0 together, so it is whole once visible.
                tx.execute(
                    "INSERT INTO preloop_blobs (digest, kind, size, complete, created_at, "
                    "used_at) VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (digest) DO UPDATE SET "
                    "complete = 1, used_at = excluded.used_at",
                    (new.digest, BUNDLE_KIND, len(data), now, now),
                )
                tx.execute(
                    "INSERT INTO preloop_blob_chunks (digest, seq, data) VALUES (?, 0, ?) "
                    "ON CONFLICT (digest, seq) DO NOTHING",
                    (new.digest, data),
                )
            if chain:
                marks = ", ".join("?" for _ in chain)
                lock = " ORDER BY digest FOR UPDATE" if self._pg else ""
                found = tx.execute(
                    f"SELECT digest FROM preloop_blobs WHERE digest IN ({marks}) "
                    "AND complete = 1" + lock,
                    tuple(chain),
                )
                have = {str(r["digest"]) for r in found}
                missing = [d for d in chain if d not in have]
                if missing:  # raised inside: the transaction rolls back
                    raise BlobMissing(
                        f"snapshot bundle {missing[0][:12]} was evicted from the store meanwhile"
                    )
            tx.execute(
                "INSERT INTO preloop_bundle_holds (run_key, repo_key, head, created_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (run_key) DO UPDATE SET head = excluded.head",
                (run_key, repo_key, head, now),
            )
            if new is not None:
                tx.execute(
                    "INSERT INTO preloop_bundles (digest, repo_key, tip, parent, depth, "
                    "created_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (digest) DO NOTHING",
                    (new.digest, new.repo_key, new.tip, new.parent, new.depth, new.created_at),
                )
            tx.executemany(
                "INSERT INTO preloop_blob_pins (digest, holder) VALUES (?, ?) "
                "ON CONFLICT (digest, holder) DO NOTHING",
                [(d, holder) for d in chain],
            )

        self._db.transaction("bundle_hold", fn)

    def release(self, run_key: str) -> int:
        """Drops the hold of run `run_key` and its pins; returns pins removed."""
        holder = run_holder(run_key)

        def fn(tx: Tx) -> int:
            pins = tx.execute(
                "DELETE FROM preloop_blob_pins WHERE holder = ? RETURNING digest", (holder,)
            )
            tx.execute("DELETE FROM preloop_bundle_holds WHERE run_key = ?", (run_key,))
            return len(pins)

        return self._db.transaction("bundle_release", fn)

    def release_ended(self, now: float | None = None, grace: float = HOLD_GRACE) -> list[str]:
        """Releases holds older than `grace` none of whose runs is unfinished
        (their `preloop run` ended without releasing them); returns their run
        keys. One short query when nothing is held (an idle fleet)."""
        now = time.time() if now is None else now
        holds = self._db.transaction(
            "bundle_holds",
            lambda tx: tx.execute(
                "SELECT run_key FROM preloop_bundle_holds WHERE created_at < ?", (now - grace,)
            ),
        )
        if not holds:
            return []
        contexts = self._db.transaction(
            "bundle_holds",
            lambda tx: tx.execute("SELECT context FROM runs WHERE status <> 'completed'"),
        )
        live: set[str] = set()
        for row in contexts:
            try:
                engine = (json.loads(row["context"]).get("github") or {}).get("preloop_engine")
            except (ValueError, AttributeError):
                continue
            if isinstance(engine, dict) and engine.get("run_key"):
                live.add(str(engine["run_key"]))
        released = []
        for row in holds:
            key = str(row["run_key"])
            if key not in live:
                self.release(key)
                released.append(key)
        return released

    # -------------------------------------------------------------- eviction

    def evict(self, max_bytes: int) -> list[str]:
        """Removes unheld bundles until those stored total at most `max_bytes`
        (0: no cap): whole subtrees (a bundle and every bundle built on it),
        the least recently used subtree first, each deepest first, so no
        stored bundle ever lacks its prerequisites. A subtree holding a pinned
        bundle is never touched. Returns the digests removed."""
        if max_bytes <= 0:
            return []
        total = self.blobs.total_bytes(BUNDLE_KIND)
        if total <= max_bytes:
            return []
        # Uploads abandoned by a crashed submitter count in the total: gone first.
        if self.blobs.sweep():
            total = self.blobs.total_bytes(BUNDLE_KIND)
        self._drop_orphan_rows()
        rows = self._db.transaction(
            "bundle_evict",
            lambda tx: tx.execute(
                "SELECT b.digest, b.size, b.used_at, u.parent, "
                "EXISTS (SELECT 1 FROM preloop_blob_pins p WHERE p.digest = b.digest) AS pinned "
                "FROM preloop_blobs b LEFT JOIN preloop_bundles u ON u.digest = b.digest "
                "WHERE b.kind = ? AND b.complete = 1",
                (BUNDLE_KIND,),
            ),
        )
        nodes = {str(r["digest"]): r for r in rows}
        children: dict[str, list[str]] = {}
        for digest, r in nodes.items():
            parent = r["parent"]
            if parent is not None and str(parent) in nodes:
                children.setdefault(str(parent), []).append(digest)

        # Post-order (dependents first) subtree of each node, whether any of it
        # is pinned, and when any of it was last used.
        order: dict[str, list[str]] = {}
        pinned: dict[str, bool] = {}
        used: dict[str, float] = {}

        def visit(digest: str) -> None:
            stack = [(digest, False)]
            while stack:
                node, done = stack.pop()
                if node in order:
                    continue
                kids = children.get(node, [])
                if not done:
                    stack.append((node, True))
                    stack.extend((k, False) for k in kids if k not in order)
                    continue
                order[node] = [d for k in kids for d in order[k]] + [node]
                pinned[node] = bool(nodes[node]["pinned"]) or any(pinned[k] for k in kids)
                used[node] = max([float(nodes[node]["used_at"]), *(used[k] for k in kids)])

        for digest in nodes:
            visit(digest)

        def parent_of(digest: str) -> str | None:
            parent = nodes[digest]["parent"]
            return str(parent) if parent is not None and str(parent) in nodes else None

        # Maximal unpinned subtrees: unpinned, and the parent's is pinned (or none).
        units = [d for d in nodes if not pinned[d] and ((p := parent_of(d)) is None or pinned[p])]
        units.sort(key=lambda d: (used[d], d))
        removed: list[str] = []
        for unit in units:
            if total <= max_bytes:
                break
            for digest in order[unit]:
                if not self.blobs.delete(digest):
                    break  # pinned since: keep it and what it builds on
                self._db.transaction("bundle_evict", functools.partial(_drop_row, digest))
                removed.append(digest)
                total -= int(nodes[digest]["size"])
        return removed

    def _drop_orphan_rows(self) -> None:
        """Rows whose blob is gone (a crash between the blob's removal and the
        row's): nothing can build on or fetch them."""
        self._db.transaction(
            "bundle_evict",
            lambda tx: tx.execute(
                "DELETE FROM preloop_bundles WHERE NOT EXISTS "
                "(SELECT 1 FROM preloop_blobs b WHERE b.digest = preloop_bundles.digest)"
            ),
        )


def _drop_row(digest: str, tx: Tx) -> None:
    tx.execute("DELETE FROM preloop_bundles WHERE digest = ?", (digest,))


def _row(r: Row) -> BundleRow:
    parent = r["parent"]
    return BundleRow(
        str(r["digest"]),
        str(r["repo_key"]),
        str(r["tip"]),
        None if parent is None else str(parent),
        int(r["depth"]),
        float(r["created_at"]),
    )
