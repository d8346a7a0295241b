"""Single flight of the object-cache prune: startup and post-capture requests
coalesce, a cancelled prune keeps ownership while its walk thread runs, and
state directories are independent. Synchronised with hooks and events only."""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import pytest

from preloop.snapshot import layout
from preloop.snapshot.hooks import registered_after_capture, run_after_capture
from preloop.snapshot.prune import (
    MAX_BYTES_KNOB,
    PruneHooks,
    PruneOutcome,
    PruneReport,
    SnapshotObjectCacheSweep,
    prune_after_capture,
    prune_snapshot_object_cache,
    request_object_cache_prune,
    start_object_cache_prune,
)
from preloop.testing.object_cache import make_cache_entry

WAIT = 60.0  # a bound on hangs, never an ordering device


def entries(state: Path, n: int = 2) -> list[str]:
    return [make_cache_entry(state, f"e{i}", payload=8192, last_use=1e9 + i) for i in range(n)]


def present(state: Path, key: str) -> bool:
    return layout.cache_repository(state, key).is_dir()


class Gate:
    """A `before_size` hook that parks the walk thread until `open()`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def __call__(self, key: str) -> None:
        self.entered.set()
        assert self._open.wait(WAIT), "gate never opened"

    def open(self) -> None:
        self._open.set()

    async def wait_entered(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, WAIT)


def test_startup_and_post_capture_requests_coalesce_and_resume_after_completion(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    keys = entries(state)
    sweep = SnapshotObjectCacheSweep()
    gate = Gate()
    done: list[PruneReport] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            assert start_object_cache_prune(
                tg, state, 1, sweep, hooks=PruneHooks(before_size=gate), on_done=done.append
            )
            await gate.wait_entered()
            # While the startup prune runs, every other request is dropped, not queued.
            assert request_object_cache_prune(state, 1, sweep) is None
            assert (await prune_snapshot_object_cache(state, 1, sweep)).outcome is (
                PruneOutcome.COALESCED
            )
            assert start_object_cache_prune(tg, state, 1, sweep) is False
            assert sweep.busy
            gate.open()

    anyio.run(main)
    assert [r.outcome for r in done] == [PruneOutcome.COMPLETED]
    assert sweep.runs_started == 1 and not sweep.busy
    assert not any(present(state, k) for k in keys)

    # After completion the next (post-capture) request runs again.
    keys = entries(state)
    thread = request_object_cache_prune(state, 1, sweep)
    assert thread is not None
    thread.join(WAIT)
    assert sweep.runs_started == 2 and not sweep.busy
    assert not any(present(state, k) for k in keys)


def test_a_cancelled_prune_keeps_ownership_until_its_walk_returns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    keys = entries(state, 3)
    sweep = SnapshotObjectCacheSweep()
    gate = Gate()

    async def start_then_cancel() -> None:
        async with anyio.create_task_group() as tg:
            assert start_object_cache_prune(tg, state, 1, sweep, hooks=PruneHooks(before_size=gate))
            await gate.wait_entered()
            tg.cancel_scope.cancel()

    anyio.run(start_then_cancel)
    # The requesting task is gone; its size walk is still parked in a worker thread.
    assert sweep.busy
    assert request_object_cache_prune(state, 1, sweep) is None
    coalesced = anyio.run(prune_snapshot_object_cache, state, 1, sweep)
    assert coalesced.outcome is PruneOutcome.COALESCED
    assert sweep.runs_started == 1

    gate.open()
    assert sweep.wait_idle(WAIT)
    # The cancelled prune stopped at the next entry instead of evicting.
    assert all(present(state, k) for k in keys)
    resumed = anyio.run(prune_snapshot_object_cache, state, 1, sweep)
    assert resumed.outcome is PruneOutcome.COMPLETED
    assert sweep.runs_started == 2
    assert not any(present(state, k) for k in keys)


def test_a_prune_task_dropped_before_it_ever_ran_releases_the_guard(tmp_path: Path) -> None:
    state = tmp_path / "state"
    entries(state)
    sweep = SnapshotObjectCacheSweep()

    class TornDownGroup:
        """A task group torn down before its task's first step: the coroutine
        is closed without running (its `finally` never executes)."""

        def start_soon(
            self, func: Callable[[], Coroutine[Any, Any, None]], *args: object, name: object = None
        ) -> None:
            func().close()

    assert start_object_cache_prune(cast(anyio.abc.TaskGroup, TornDownGroup()), state, 1, sweep)
    assert not sweep.busy
    assert anyio.run(prune_snapshot_object_cache, state, 1, sweep).outcome is (
        PruneOutcome.COMPLETED
    )


def test_a_prune_cancelled_at_its_first_checkpoint_releases_the_guard(tmp_path: Path) -> None:
    state = tmp_path / "state"
    entries(state)
    sweep = SnapshotObjectCacheSweep()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            assert start_object_cache_prune(tg, state, 1, sweep)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert sweep.wait_idle(WAIT)
    assert anyio.run(prune_snapshot_object_cache, state, 1, sweep).outcome in (
        PruneOutcome.COMPLETED,
        PruneOutcome.UNDER_CAP,  # the first run may have finished its thread work
    )


def test_an_error_inside_the_prune_releases_the_guard(tmp_path: Path) -> None:
    state = tmp_path / "state"
    entries(state)
    sweep = SnapshotObjectCacheSweep()

    def boom(key: str) -> None:
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        anyio.run(
            lambda: prune_snapshot_object_cache(state, 1, sweep, hooks=PruneHooks(before_size=boom))
        )
    assert not sweep.busy
    assert anyio.run(prune_snapshot_object_cache, state, 1, sweep).outcome is (
        PruneOutcome.COMPLETED
    )


def test_a_second_state_directory_is_independent(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    entries(first)
    second_keys = entries(second)
    (tmp_path / "alias").symlink_to(first)
    assert SnapshotObjectCacheSweep.for_state_dir(first) is SnapshotObjectCacheSweep.for_state_dir(
        tmp_path / "alias"
    )
    assert SnapshotObjectCacheSweep.for_state_dir(first) is not (
        SnapshotObjectCacheSweep.for_state_dir(second)
    )
    gate = Gate()
    done: list[PruneReport] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            assert start_object_cache_prune(
                tg, first, 1, hooks=PruneHooks(before_size=gate), on_done=done.append
            )
            await gate.wait_entered()
            assert request_object_cache_prune(tmp_path / "alias", 1) is None
            other = await prune_snapshot_object_cache(second, 1)
            assert other.outcome is PruneOutcome.COMPLETED
            assert not any(present(second, k) for k in second_keys)
            gate.open()

    anyio.run(main)
    assert [r.outcome for r in done] == [PruneOutcome.COMPLETED]


def test_post_capture_hook_requests_a_background_prune(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    keys = entries(state)
    assert prune_after_capture in registered_after_capture()
    monkeypatch.setenv(MAX_BYTES_KNOB, "1")
    anyio.run(run_after_capture, state, keys[0])
    assert SnapshotObjectCacheSweep.for_state_dir(state).wait_idle(WAIT)
    assert not any(present(state, k) for k in keys)
    # With the cap disabled the hook does nothing.
    keys = entries(state)
    monkeypatch.setenv(MAX_BYTES_KNOB, "0")
    anyio.run(run_after_capture, state, keys[0])
    assert SnapshotObjectCacheSweep.for_state_dir(state).wait_idle(WAIT)
    assert all(present(state, k) for k in keys)
