"""Actions: step overhead and first fetch, side by side with what a user would
otherwise run.

- **JavaScript action step**: a job of 10 `uses:` steps of a cached
  JavaScript action whose `main` is empty, against a job of 10
  `run: node -e ""` steps, both through `execute_job` (target: <= 1.5x).
- **first fetch**: resolving and fetching a 5 MB action from a `file://`
  remote into an empty action cache, against a plain `git clone` of it
  (target: <= 1.2x); side by side, and in alternating rounds (each round
  fetches and clones, in turn first) whose per-round ratio's median is
  what load on a shared machine disturbs least.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from preloop.actions.cache import ActionCache
from preloop.actions.reference import RemoteRef
from preloop.actions.steps import ActionSource
from preloop.runner import JobHost, execute_job

STEPS = 10
GIT_ENV = {
    "GIT_AUTHOR_NAME": "b",
    "GIT_AUTHOR_EMAIL": "b@example.com",
    "GIT_COMMITTER_NAME": "b",
    "GIT_COMMITTER_EMAIL": "b@example.com",
}


def _publish(remotes: Path, slug: str, files: dict[str, bytes]) -> None:
    work = remotes / ".work" / slug
    work.mkdir(parents=True)
    env = {**os.environ, **GIT_ENV}
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=work, check=True)
    subprocess.run(["git", "add", "-A"], cwd=work, check=True)
    subprocess.run(["git", "commit", "-q", "-m", "a"], cwd=work, check=True, env=env)
    subprocess.run(["git", "tag", "v1"], cwd=work, check=True)
    bare = remotes / f"{slug}.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)


def _job(tmp: Path, steps: list[dict[str, Any]], source: ActionSource) -> None:
    job = tmp / uuid.uuid4().hex[:8]
    ws, temp = job / "ws", job / "temp"
    ws.mkdir(parents=True)
    temp.mkdir()
    result = anyio.run(
        lambda: execute_job(
            {"job": "bench", "steps": steps},
            {"github": {"event_name": "push"}},
            JobHost(workspace=ws, temp=temp, run_id="1", tracking_key="bench", actions=source),
            log=lambda _line: None,
        )
    )
    assert result.conclusion == "success"
    shutil.rmtree(job)


@pytest.fixture(scope="module")
def empty_action(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ActionSource]:
    tmp = tmp_path_factory.mktemp("actions")
    remotes = tmp / "remotes"
    _publish(
        remotes,
        "bench/empty",
        {"action.yml": b"runs:\n  using: node20\n  main: main.js\n", "main.js": b""},
    )
    source = ActionSource(tmp / "state", base_url=f"file://{remotes}")
    _job(tmp, [{"uses": "bench/empty@v1"}], source)  # fetched and resolved for run "bench"
    return tmp, source


@pytest.mark.benchmark(group="10 steps: JavaScript action vs run: node")
def test_js_action_steps(benchmark: Any, empty_action: tuple[Path, ActionSource]) -> None:
    tmp, source = empty_action
    benchmark.extra_info["impl"] = "preloop"
    benchmark.pedantic(
        _job, args=(tmp, [{"uses": "bench/empty@v1"}] * STEPS, source), rounds=8, iterations=1
    )


@pytest.mark.benchmark(group="10 steps: JavaScript action vs run: node")
def test_run_node_steps(benchmark: Any, empty_action: tuple[Path, ActionSource]) -> None:
    tmp, source = empty_action
    benchmark.extra_info["impl"] = 'run: node -e ""'
    benchmark.pedantic(
        _job, args=(tmp, [{"run": 'node -e ""'}] * STEPS, source), rounds=8, iterations=1
    )


@pytest.fixture(scope="module")
def big_action(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("big")
    remotes = tmp / "remotes"
    rng = __import__("random").Random(7)
    files = {
        f"dist/chunk{i:02d}.js": bytes(rng.getrandbits(8) for _ in range(100_000))
        for i in range(50)
    }
    files["action.yml"] = b"runs:\n  using: node20\n  main: dist/chunk00.js\n"
    _publish(remotes, "bench/big", files)
    return remotes


def _fetch(remotes: Path, state: Path) -> None:
    cache = ActionCache(state, run_key=uuid.uuid4().hex, base_url=f"file://{remotes}")
    anyio.run(lambda: cache.fetch(RemoteRef("bench", "big", "", "v1"), lambda _m: None))
    cache.release(wait=True)  # the .git deletion left in the background counts too


def _clone(remotes: Path, dest: Path) -> None:
    subprocess.run(
        ["git", "clone", "-q", f"file://{remotes}/bench/big", str(dest)],
        check=True,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
    )


@pytest.mark.benchmark(group="first fetch of a 5 MB action")
def test_first_fetch(benchmark: Any, big_action: Path, tmp_path: Path) -> None:
    benchmark.extra_info["impl"] = "preloop"

    def setup() -> tuple[tuple[Path, Path], dict[str, Any]]:
        return (big_action, tmp_path / uuid.uuid4().hex), {}

    benchmark.pedantic(_fetch, setup=setup, rounds=15, iterations=1)


@pytest.mark.benchmark(group="first fetch of a 5 MB action")
def test_git_clone(benchmark: Any, big_action: Path, tmp_path: Path) -> None:
    benchmark.extra_info["impl"] = "git clone"

    def setup() -> tuple[tuple[Path, Path], dict[str, Any]]:
        return (big_action, tmp_path / uuid.uuid4().hex), {}

    benchmark.pedantic(_clone, setup=setup, rounds=15, iterations=1)


@pytest.mark.benchmark(group="first fetch of a 5 MB action, alternating rounds")
def test_first_fetch_and_git_clone_alternating(
    benchmark: Any, big_action: Path, tmp_path: Path
) -> None:
    times: dict[str, list[float]] = {"preloop": [], "git clone": []}
    ops = {"preloop": _fetch, "git clone": _clone}

    def round_() -> None:
        order = ["preloop", "git clone"]
        if len(times["preloop"]) % 2:
            order.reverse()  # neither always goes first (warm caches)
        for impl in order:
            started = time.perf_counter()
            ops[impl](big_action, tmp_path / uuid.uuid4().hex)
            times[impl].append(time.perf_counter() - started)

    benchmark.extra_info["impl"] = "preloop + git clone"
    benchmark.pedantic(round_, rounds=15, iterations=1)
    ratios = [p / c for p, c in zip(times["preloop"], times["git clone"], strict=True)]
    ours, git = statistics.median(times["preloop"]), statistics.median(times["git clone"])
    benchmark.extra_info["paired"] = (
        f"preloop / git clone: median of per-round ratios x{statistics.median(ratios):.2f}, "
        f"of medians x{ours / git:.2f}, "
        f"of minima x{min(times['preloop']) / min(times['git clone']):.2f} "
        f"(medians: preloop {ours * 1e3:.0f} ms, git clone {git * 1e3:.0f} ms; "
        f"{len(ratios)} rounds)"
    )
