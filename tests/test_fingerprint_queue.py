"""FingerprintQueue: one walk at a time, failures stay with their caller, no leaks on cancel."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from preloop import _native
from preloop.fingerprint import (
    Fingerprint,
    FingerprintQueue,
    FingerprintRootError,
    HostSlots,
    fingerprint,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def coordination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "coordination"
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(directory))
    yield directory
    _native.set_test_hooks()


def tree(root: Path, files: int = 3) -> Path:
    root.mkdir()
    for i in range(files):
        (root / f"f{i}").write_text(f"{root.name} {i}\n")
    return root


def all_slots_free(directory: Path) -> bool:
    slots = [HostSlots(directory).try_acquire() for _ in range(4)]
    free = all(slots)
    for slot in slots:
        if slot:
            slot.release()
    return free


async def test_a_failure_does_not_poison_later_requests(tmp_path: Path) -> None:
    queue = FingerprintQueue()
    good = tree(tmp_path / "good")
    with pytest.raises(FingerprintRootError):
        await queue.fingerprint(tmp_path / "missing")
    assert (await queue.fingerprint(good)).digest == fingerprint(good).digest


async def test_settled_returns_one_result_or_error_per_candidate(tmp_path: Path) -> None:
    queue = FingerprintQueue()
    one, two = tree(tmp_path / "one"), tree(tmp_path / "two")
    results = await queue.fingerprint_settled([one, tmp_path / "missing", [one, two], []])
    assert len(results) == 4
    assert isinstance(results[0], Fingerprint) and results[0].digest == fingerprint(one).digest
    assert isinstance(results[1], FingerprintRootError)
    assert str(tmp_path / "missing") in str(results[1])
    assert isinstance(results[2], Fingerprint) and list(results[2].roots) == [str(one), str(two)]
    assert isinstance(results[3], FingerprintRootError)


async def test_concurrent_callers_walk_one_at_a_time(tmp_path: Path) -> None:
    queue = FingerprintQueue()
    roots = [tree(tmp_path / f"t{i}", files=5) for i in range(4)]
    seen: list[str] = []
    _native.set_test_hooks(after_read=seen.append)
    results: dict[Path, Fingerprint] = {}

    async def one(root: Path) -> None:
        results[root] = await queue.fingerprint(root)

    async with anyio.create_task_group() as tg:
        for root in roots:
            tg.start_soon(one, root)
    assert len(seen) == 20
    walks = [Path(p).parent for p in seen]
    # Every walk's files are contiguous: no two walks interleaved.
    changes = sum(1 for a, b in itertools.pairwise(walks) if a != b)
    assert changes == 3
    assert {r: f.digest for r, f in results.items()} == {r: fingerprint(r).digest for r in roots}


async def test_cancelled_while_queued_or_walking_leaks_nothing(
    tmp_path: Path, coordination: Path
) -> None:
    queue = FingerprintQueue()
    slow, other = tree(tmp_path / "slow"), tree(tmp_path / "other")
    in_walk, finish_walk = threading.Event(), threading.Event()

    def hold_first_walk(path: str) -> None:
        if Path(path).parent == slow:
            in_walk.set()
            finish_walk.wait(60)

    _native.set_test_hooks(after_read=hold_first_walk)
    outcome: dict[str, object] = {}

    async def caller(name: str, root: Path, scope: anyio.CancelScope) -> None:
        with scope:
            outcome[name] = await queue.fingerprint(root)
            return
        outcome[name] = "cancelled"

    walking, queued = anyio.CancelScope(), anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, "walking", slow, walking)
        assert await anyio.to_thread.run_sync(in_walk.wait, 60)
        tg.start_soon(caller, "queued", other, queued)
        await anyio.wait_all_tasks_blocked()
        assert queue._lock.statistics().tasks_waiting == 1
        queued.cancel()
        await anyio.wait_all_tasks_blocked()
        assert outcome["queued"] == "cancelled"
        assert queue._lock.statistics().tasks_waiting == 0
        walking.cancel()  # the native walk runs to its end; then the caller is cancelled
        await anyio.wait_all_tasks_blocked()
        assert "walking" not in outcome
        finish_walk.set()
    assert outcome["walking"] == "cancelled"
    assert not queue._lock.locked()
    assert all_slots_free(coordination)
    _native.set_test_hooks()
    assert (await queue.fingerprint(other)).digest == fingerprint(other).digest
