"""Object-cache prune over 1,000 entries of mixed sizes, side by side with `du -s`.

Two groups:
- **scan**: the cache is under the cap, so the prune lists, sizes (every
  repository plus both sidecars) and orders all 1,000 entries and evicts nothing;
  the baseline is `du -s` of the cache directory (the least an operator would run
  to learn the cache size).
- **evict half**: the cap is half the total, so the prune also takes each
  victim's lock, checks its pins, re-scans references and removes it; the baseline
  is `du -s` plus `rm -rf` of the same entries. Each round starts from a fresh
  copy (the copy is not timed).

The 1,000-entry cache is built once (real `git init --bare` repositories with a
real blob each) under `$PRELOOP_BENCH_TREES` (default /var/tmp/preloop-bench-trees).
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from preloop.snapshot import layout
from preloop.snapshot.prune import PruneOutcome, prune_snapshot_object_cache_sync
from preloop.testing.object_cache import make_cache_entry, make_run_repository

ENTRIES = 1000
KiB = 1024
SEED = 20261129


def _sizes() -> list[int]:
    """Mixed sizes: 90% 2-32 KiB, 9.5% 64-256 KiB, 0.5% 1-4 MiB."""
    rng = random.Random(SEED)
    out = []
    for i in range(ENTRIES):
        if i % 200 == 0:
            out.append(rng.randint(1024, 4096) * KiB)
        elif i % 10 == 0:
            out.append(rng.randint(64, 256) * KiB)
        else:
            out.append(rng.randint(2, 32) * KiB)
    return out


def template_state() -> Path:
    """A state directory with 1,000 cache entries (and 10 run repositories
    referencing some of them), built once and reused."""
    base = Path(os.environ.get("PRELOOP_BENCH_TREES", "/var/tmp/preloop-bench-trees"))
    base.mkdir(parents=True, exist_ok=True)
    root = base / f"object-cache-{ENTRIES}-{SEED}"
    marker = base / f"object-cache-{ENTRIES}-{SEED}.complete"
    with open(base / f"object-cache-{ENTRIES}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and root.is_dir():
            return root
        if root.exists():
            shutil.rmtree(root)
        rng = random.Random(SEED)
        keys = []
        for i, size in enumerate(_sizes()):
            keys.append(
                make_cache_entry(
                    root,
                    f"entry{i:04d}",
                    payload=size,
                    index=rng.randint(1, 64) * KiB,
                    last_use=1.7e9 + rng.random() * 1e6,
                )
            )
        for i, key in enumerate(rng.sample(keys, 10)):
            make_run_repository(
                layout.snapshots_dir(root) / f"run-{i}", layout.cache_repository(root, key)
            )
        marker.write_text("complete\n")
    return root


def du_s(path: Path) -> int:
    out = subprocess.run(["du", "-s", "--block-size=1", path], check=True, capture_output=True)
    return int(out.stdout.split()[0])


@pytest.fixture(scope="module")
def template() -> Path:
    return template_state()


@pytest.mark.parametrize("impl", ["preloop", "du -s"])
def test_prune_scan_1000(benchmark: Any, template: Path, impl: str) -> None:
    cache = layout.cache_dir(template)
    benchmark.group = f"prune scan {ENTRIES} entries (under cap)"
    benchmark.extra_info["impl"] = impl
    if impl == "preloop":

        def run() -> int:
            report = prune_snapshot_object_cache_sync(template, 1 << 62)
            assert report.outcome is PruneOutcome.UNDER_CAP and report.entries == ENTRIES
            return report.total_bytes_before

    else:

        def run() -> int:
            return du_s(cache)

    total = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    # Same quantity, counted per entry vs once per tree (no hard links here).
    assert abs(total - du_s(cache)) <= du_s(cache) // 100


@pytest.mark.parametrize("impl", ["preloop", "du -s + rm -rf"])
def test_prune_evict_half_1000(benchmark: Any, template: Path, tmp_path: Path, impl: str) -> None:
    benchmark.group = f"prune {ENTRIES} entries, evict to half"
    benchmark.extra_info["impl"] = impl
    total = du_s(layout.cache_dir(template))
    cap = total // 2
    # The entries a prune evicts, computed once on a throwaway copy.
    probe = tmp_path / "probe"
    shutil.copytree(template, probe, symlinks=True)
    report = prune_snapshot_object_cache_sync(probe, cap, dry_run=True)
    victims = [e.key for e in report.evicted]
    assert 100 < len(victims) < ENTRIES
    shutil.rmtree(probe)
    rounds = iter(range(1000))
    state: list[Path] = []

    def setup() -> tuple[tuple[Path], dict[str, Any]]:
        fresh = tmp_path / f"round-{next(rounds)}"
        subprocess.run(["cp", "-a", template, fresh], check=True)
        state.append(fresh)
        return (fresh,), {}

    if impl == "preloop":

        def run(fresh: Path) -> int:
            report = prune_snapshot_object_cache_sync(fresh, cap)
            assert report.outcome is PruneOutcome.COMPLETED
            return len(report.evicted)

    else:

        def run(fresh: Path) -> int:
            cache = layout.cache_dir(fresh)
            du_s(cache)
            paths = []
            for key in victims:
                paths += [f"{key}.git", f"{key}.index", f"{key}.last-head"]
            subprocess.run(["rm", "-rf", *paths], cwd=cache, check=True)
            return len(victims)

    evicted = benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    assert evicted == len(victims)
    for path in state:
        shutil.rmtree(path, ignore_errors=True)
