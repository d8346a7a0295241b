"""Snapshot upload through the store for a one-file edit in a 50k-file
repository: `publish_snapshot` (a bundle thin against the stored chain,
uploaded to PostgreSQL) side by side with what one would otherwise run,
`git bundle create <snapshot> --not <previous snapshot>` uploaded the same
way. Time and bytes uploaded per edit; the capture between edits is not timed.
Two workspaces: `clean` (only the edited file differs from HEAD) and
`carried` (a 256 KiB untracked file, unchanged between the edits, is in
every snapshot: `git bundle create` uploads it again each time, since
consecutive snapshots are siblings, not ancestors).

    PRELOOP_TEST_PG_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python -m pytest bench/test_snapshot_transport.py --benchmark-only

Target (issue 16): <= 50 ms and <= 64 KB per one-file edit.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from preloop.control import Store, open_store
from preloop.snapshot import Snapshot, capture_workspace
from preloop.snapshot.bundles import BUNDLE_KIND, SnapshotBundles
from preloop.snapshot.gitcmd import git_env
from preloop.snapshot.transport import publish_snapshot
from preloop.testing.pg import scratch_schema
from preloop.testing.trees import TreeSpec, cached_repo

FILES = 50_000
ROUNDS = 10
TARGET_SECONDS = 0.050
TARGET_BYTES = 64 * 1024
CARRIED = "bench-carried.bin"
VARIANTS = ["clean", "carried"]
# (variant, impl) -> (median seconds, median bytes)
RESULTS: dict[tuple[str, str], tuple[float, float]] = {}


def _repo() -> Path:
    """The committed 50k-file repository of bench/test_snapshot.py (built once)."""
    spec = TreeSpec(f"snapshot-bench-{FILES}", FILES, max(1, FILES // 25), 200, 4000)
    repo = cached_repo(spec)
    (repo / CARRIED).unlink(missing_ok=True)
    return repo


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    url = os.environ.get("PRELOOP_TEST_PG_URL")
    if not url:
        pytest.skip("PRELOOP_TEST_PG_URL is not set: the store transport needs PostgreSQL")
    with scratch_schema(url) as scratch, open_store(scratch) as db:
        yield db


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    """One event loop for every publication, as in `preloop run`: its worker
    threads (each keeping a store connection) live as long as it does."""
    with start_blocking_portal() as running:
        yield running


class _Report:
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not RESULTS:
            return
        write = terminalreporter.write_line
        terminalreporter.write_sep("-", f"snapshot upload, one-file edit, {FILES} files (median)")
        for (variant, impl), (seconds, size) in sorted(RESULTS.items()):
            write(f"{variant:>8} {impl:>28}: {seconds * 1000:7.1f} ms  {size / 1024:9.1f} KiB")
        for variant in VARIANTS:
            if (variant, "preloop") in RESULTS:
                seconds, size = RESULTS[(variant, "preloop")]
                met = seconds <= TARGET_SECONDS and size <= TARGET_BYTES
                write(
                    f"{variant}: target <= {TARGET_SECONDS * 1000:.0f} ms and "
                    f"<= {TARGET_BYTES // 1024} KiB: " + ("met" if met else "NOT met")
                )


@pytest.fixture(scope="module", autouse=True)
def report(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("preloop-transport-bench-report"):
        manager.register(_Report(), "preloop-transport-bench-report")


class _Edits:
    """One-file edits of the repository, each captured (untimed) as a snapshot."""

    def __init__(self, state: Path, variant: str) -> None:
        self.repo = _repo()
        if variant == "carried":
            (self.repo / CARRIED).write_bytes(os.urandom(256 * 1024))
        self.state = state
        self.count = 0
        self.previous: Snapshot | None = None
        self.current: Snapshot = self._capture()

    def _capture(self) -> Snapshot:
        self.count += 1
        (self.repo / "bench-modified.txt").write_text(f"edit {self.count} {time.time_ns()}\n")
        snap: Snapshot = anyio.run(
            capture_workspace, self.state, self.repo, f"bench-{self.count}-{os.getpid()}"
        )
        return snap

    def next(self) -> None:
        self.previous, self.current = self.current, self._capture()

    def close(self) -> None:
        (self.repo / CARRIED).unlink(missing_ok=True)


@pytest.fixture(params=VARIANTS)
def edits(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, _Edits]]:
    variant: str = request.param
    made = _Edits(tmp_path / "state", variant)
    try:
        yield variant, made
    finally:
        made.close()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def test_publish_one_file_edit(
    benchmark: Any, store: Store, edits: tuple[str, _Edits], portal: BlockingPortal
) -> None:
    variant, edits_ = edits
    bundles = SnapshotBundles(store)
    sizes: list[float] = []

    def publish() -> None:
        snap = edits_.current
        published = portal.call(
            publish_snapshot, bundles, snap.repository, snap.cache_key, snap.commit, snap.run_id
        )
        assert published.uploaded is not None
        sizes.append(published.uploaded.size)

    publish()  # the first, full bundle: not an edit
    sizes.clear()

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        bundles.release(edits_.current.run_id)  # the run ended (not part of the upload)
        edits_.next()
        return (), {}

    benchmark.group = f"snapshot upload, one-file edit, {FILES} files, {variant}"
    benchmark.extra_info["impl"] = "preloop"
    benchmark.pedantic(publish, setup=setup, rounds=ROUNDS, iterations=1)
    benchmark.extra_info["bytes_median"] = _median(sizes)
    RESULTS[(variant, "preloop")] = (benchmark.stats.stats.median, _median(sizes))
    assert _median(sizes) <= TARGET_BYTES


def test_git_bundle_one_file_edit(
    benchmark: Any, store: Store, edits: tuple[str, _Edits], tmp_path: Path
) -> None:
    variant, edits_ = edits
    bundles = SnapshotBundles(store)
    sizes: list[float] = []
    out = tmp_path / "edit.bundle"

    def bundle_and_upload() -> None:
        snap, prev = edits_.current, edits_.previous
        assert prev is not None
        subprocess.run(
            ["git", "bundle", "create", "-q", str(out), "refs/heads/snapshot",
             "--not", prev.commit],
            env=git_env({"GIT_DIR": str(snap.repository)}),
            check=True,
        )  # fmt: skip
        sizes.append(bundles.blobs.put_file(out, BUNDLE_KIND).size)

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        edits_.next()
        return (), {}

    benchmark.group = f"snapshot upload, one-file edit, {FILES} files, {variant}"
    benchmark.extra_info["impl"] = "git bundle create --not prev"
    benchmark.pedantic(bundle_and_upload, setup=setup, rounds=ROUNDS, iterations=1)
    benchmark.extra_info["bytes_median"] = _median(sizes)
    median = benchmark.stats.stats.median
    RESULTS[(variant, "git bundle create --not prev")] = (median, _median(sizes))
