"""`preloop run` on a 50-job workflow of trivial steps, side by side with a plain
shell script running the same steps one after another.

- **run 50 jobs**: wall time of `preloop run` (a process, as a user runs it:
  start-up, capture, plan, submit, local runners, summary) against `sh`
  running each step's script with `bash -e`, sequentially. The difference
  divided by 50 is preloop's overhead per job (target: <= 50 ms), printed
  with the ratio table and kept in `extra_info`.
- **first output**: time from starting `preloop run` to the first line of
  step output on its stdout (the run is interrupted afterwards, untimed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from preloop.engine import Engine, RunRequest

JOBS = 50
PRELOOP = [sys.executable, "-m", "preloop"]
GIT_ID = ["-c", "user.name=Bench", "-c", "user.email=bench@example.com"]


def _repo(root: Path) -> Path:
    root.mkdir(parents=True)
    wf = root / ".github" / "workflows"
    wf.mkdir(parents=True)
    jobs = {
        f"job{i:02d}": {
            "runs-on": "ubuntu-latest",
            "steps": [{"run": f"echo step-output-{i}\ntest -f README.md"}],
        }
        for i in range(JOBS)
    }
    (wf / "ci.yml").write_text(json.dumps({"on": "push", "jobs": jobs}, indent=1))
    (root / "README.md").write_text("bench\n")
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", *GIT_ID, "commit", "-q", "-m", "init"], cwd=root, check=True)
    return root


def _shell_script(root: Path) -> Path:
    steps = root.parent / "steps"
    steps.mkdir()
    lines = ["set -e"]
    for i in range(JOBS):
        step = steps / f"step{i:02d}.sh"
        step.write_text(f"echo step-output-{i}\ntest -f README.md\n")
        lines.append(f"bash -e {step}")
    script = root.parent / "all.sh"
    script.write_text("\n".join(lines) + "\n")
    return script


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.mktemp("run-bench")
    repo = _repo(base / "repo")
    return repo, _shell_script(repo), base / "state"


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env["PRELOOP_STATE_DIR"] = str(state)
    return env


_walls: dict[str, float] = {}


def test_run_50_jobs_preloop(benchmark: Any, workload: tuple[Path, Path, Path]) -> None:
    repo, _, state = workload
    benchmark.group = f"run {JOBS} trivial jobs"
    benchmark.extra_info["impl"] = "preloop"

    def run() -> None:
        proc = subprocess.run(
            [*PRELOOP, "run", "--json"], cwd=repo, env=_env(state), capture_output=True
        )
        assert proc.returncode == 0, proc.stderr

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    _walls["preloop"] = benchmark.stats.stats.mean


def test_run_50_jobs_engine_in_process(benchmark: Any, workload: tuple[Path, Path, Path]) -> None:
    """The same run through `preloop.engine` in this process: the per-job cost
    without the interpreter start-up and imports of the `preloop` command."""
    repo, _, state = workload
    benchmark.group = f"run {JOBS} trivial jobs"
    benchmark.extra_info["impl"] = "preloop engine (in-process)"

    def run() -> None:
        engine = Engine(RunRequest(workspace=repo, state_dir=state))
        outcome = anyio.run(engine.run)
        assert outcome.ok

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    _walls["engine"] = benchmark.stats.stats.mean


def test_run_50_jobs_shell(benchmark: Any, workload: tuple[Path, Path, Path]) -> None:
    repo, script, _ = workload
    benchmark.group = f"run {JOBS} trivial jobs"
    benchmark.extra_info["impl"] = "sh sequential"

    def run() -> None:
        subprocess.run(["sh", str(script)], cwd=repo, check=True, capture_output=True)

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    _walls["shell"] = benchmark.stats.stats.mean
    for impl in ("preloop", "engine"):
        if impl in _walls:
            per_job = (_walls[impl] - _walls["shell"]) / JOBS
            benchmark.extra_info[f"{impl}_overhead_per_job_ms"] = round(per_job * 1000, 1)
            print(f"\n{impl} overhead per job: {per_job * 1000:.1f} ms (target <= 50 ms)")


def test_time_to_first_step_output(benchmark: Any, workload: tuple[Path, Path, Path]) -> None:
    repo, _, state = workload
    benchmark.group = "time to first step output"
    benchmark.extra_info["impl"] = "preloop"

    def first_output() -> None:
        # Timed: start-up, capture, plan, submit, claim, checkout, first line.
        # Then the run is interrupted (Ctrl-C), which is not part of the time.
        proc = subprocess.Popen(
            [*PRELOOP, "run"], cwd=repo, env=_env(state), stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if b"] step-output-" in line:
                break
        return proc

    def teardown(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None
        proc.stdout.read()
        proc.wait()

    procs: list[subprocess.Popen[bytes]] = []

    def setup() -> None:  # untimed: ends the previous round's run
        while procs:
            teardown(procs.pop())

    benchmark.pedantic(lambda: procs.append(first_output()), setup=setup, rounds=3, iterations=1)
    setup()
