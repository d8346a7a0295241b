"""Captures in 4 processes while the prune runs in a loop with a 1-byte cap.

Every capture publishes a run repository whose objects live in a cache entry
the prune is trying to evict the whole time; each published snapshot must pass
`git fsck --connectivity-only` and check out with the captured content. Each
child drops its snapshot after verifying it and waits (pipe handshake) until a
whole prune pass has started after that, then proves the pass evicted its entry,
so the next capture has to clone the entry again under the same pressure. The
children also run the real post-capture hook (their own knob is 1 byte too).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from preloop.snapshot.prune import MAX_BYTES_KNOB, PruneOutcome, prune_snapshot_object_cache_sync

PROCESSES = 4
CYCLES = 3

CHILD = textwrap.dedent(
    """
    import json, os, shutil, subprocess, sys, tempfile
    from pathlib import Path
    import anyio
    from preloop.snapshot import layout
    from preloop.snapshot.locks import acquire_cache_lock
    from preloop.snapshot.prune import SnapshotObjectCacheSweep
    from preloop.snapshot.workspace import capture_workspace

    state, workspace = Path(sys.argv[1]), Path(sys.argv[2])
    name, cycles = sys.argv[3], int(sys.argv[4])

    def say(**doc):
        print(json.dumps(doc), flush=True)

    def verify(repo, commit, expected):
        subprocess.run(["git", "-C", repo, "fsck", "--connectivity-only", "--no-dangling"],
                       check=True, capture_output=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "checkout"
            subprocess.run(["git", "clone", "--quiet", "--no-local", repo, out],
                           check=True, capture_output=True)
            subprocess.run(["git", "-C", out, "checkout", "--quiet", commit],
                           check=True, capture_output=True)
            got = {p: (out / p).read_text() for p in expected}
            if got != expected:
                raise AssertionError(f"{repo}: checked out {got}, captured {expected}")

    for cycle in range(cycles):
        (workspace / "tracked.txt").write_text(f"{name} cycle {cycle}\\n")
        (workspace / f"untracked-{cycle}.txt").write_text(os.urandom(4096).hex())
        expected = {"tracked.txt": f"{name} cycle {cycle}\\n",
                    f"untracked-{cycle}.txt": (workspace / f"untracked-{cycle}.txt").read_text()}
        snap = anyio.run(capture_workspace, state, workspace, f"{name}-r{cycle}")
        verify(snap.repository, snap.commit, expected)
        say(kind="snapshot", repo=str(snap.repository), commit=snap.commit, key=snap.cache_key,
            expected=expected)
        if cycle == cycles - 1:
            break
        # Drop the snapshot (the run is over): the entry is now unused.
        shutil.rmtree(snap.repository)
        SnapshotObjectCacheSweep.for_state_dir(state).wait_idle()  # our post-capture prune
        say(kind="released", key=snap.cache_key)
        assert sys.stdin.readline() == "pruned\\n"
        # Any prune that held the entry's lock has renamed it away before releasing it.
        with acquire_cache_lock(state, snap.cache_key, timeout=60):
            evicted = not layout.cache_repository(state, snap.cache_key).exists()
        say(kind="checked", key=snap.cache_key, evicted=evicted)
    SnapshotObjectCacheSweep.for_state_dir(state).wait_idle()
    say(kind="done")
    """
)


def git(*args: str | Path) -> None:
    subprocess.run(["git", *map(str, args)], check=True, capture_output=True)


def make_workspace(path: Path, name: str) -> None:
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", path)
    (path / "tracked.txt").write_text("initial\n")
    (path / "big.bin").write_bytes(os.urandom(256 * 1024))
    (path / ".gitignore").write_text("ignored/\n")
    git("-C", path, "add", "-A")
    git(
        "-C", path, "-c", "user.name=t", "-c", "user.email=t@t.invalid",
        "commit", "-q", "-m", f"base of {name}",
    )  # fmt: skip


def test_captures_in_4_processes_while_prune_loops_with_a_tiny_cap(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {**os.environ, MAX_BYTES_KNOB: "1"}
    events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
    procs: list[subprocess.Popen[str]] = []
    for i in range(PROCESSES):
        ws = tmp_path / f"ws{i}"
        make_workspace(ws, f"ws{i}")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(state), str(ws), f"p{i}", str(CYCLES)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )

    def pump(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.put((i, json.loads(line)))
        events.put((i, None))  # end of output

    readers = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for r in readers:
        r.start()

    snapshots: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    pending: dict[int, int] = {}  # child -> passes completed when it released its entry
    finished: set[int] = set()
    outcomes: Counter[PruneOutcome] = Counter()
    evictions = passes = 0
    try:
        while len(finished) < PROCESSES:
            # Wait briefly for a child's message between passes: pacing only, the
            # handshake below is what orders eviction against the children.
            try:
                batch = [events.get(timeout=0.02)]
            except queue.Empty:
                batch = []
            while not events.empty():
                batch.append(events.get_nowait())
            for i, doc in batch:
                if doc is None:
                    finished.add(i)
                elif doc["kind"] == "snapshot":
                    snapshots.append(doc)
                elif doc["kind"] == "released":
                    pending[i] = passes
                elif doc["kind"] == "checked":
                    checks.append(doc)
            report = prune_snapshot_object_cache_sync(state, 1)
            passes += 1
            outcomes[report.outcome] += 1
            evictions += sum(1 for e in report.evicted if not e.partial)
            assert report.outcome is not PruneOutcome.ABORTED, report.error
            for i, released_at in list(pending.items()):
                if passes > released_at:  # a whole pass started after the release
                    stdin = procs[i].stdin
                    assert stdin is not None
                    stdin.write("pruned\n")
                    stdin.flush()
                    del pending[i]
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=120)
    assert [p.returncode for p in procs] == [0] * PROCESSES

    assert len(snapshots) == PROCESSES * CYCLES
    # Every entry that a child released was gone after the next full pass, so
    # the following capture of that child rebuilt its entry under the same prune.
    assert len(checks) == PROCESSES * (CYCLES - 1)
    assert all(c["evicted"] for c in checks), checks
    assert evictions >= 1 and outcomes[PruneOutcome.COMPLETED] >= 1

    # The last snapshot of each child is still published: it kept its entry alive.
    kept = [s for s in snapshots if Path(s["repo"]).exists()]
    assert len(kept) == PROCESSES
    for s in kept:
        git("-C", s["repo"], "fsck", "--connectivity-only", "--no-dangling")
        out = tmp_path / f"final-{Path(s['repo']).name}"
        git("clone", "--quiet", "--no-local", s["repo"], out)
        git("-C", out, "checkout", "--quiet", s["commit"])
        for rel, content in s["expected"].items():
            assert (out / rel).read_text() == content
