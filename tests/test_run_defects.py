"""Regression tests for the command-line defects of issue 13, and the output
rules (no wrapping when piped, still-running lines, annotation counts,
singular/plural, step summaries)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from tests.run_support import make_repo, workflow
from tests.test_run_cli import spawn

from preloop.control import Lease
from preloop.control.urls import check_store_url
from preloop.engine import Engine, EngineEvents, RunRequest
from preloop.errors import UsageError
from preloop.runner import JobResult
from preloop.services.storage import LocalStorage

pytest_plugins = ["preloop.testing.control_fixtures"]

PRELOOP = [sys.executable, "-m", "preloop"]
ROOT = Path(__file__).resolve().parents[1]


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env.pop("COLUMNS", None)
    env.update(PRELOOP_STATE_DIR=str(state), **extra)
    return env


def preloop(*args: str, cwd: Path, state: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PRELOOP, *args],
        cwd=cwd,
        env=_env(state, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )


ECHO = """\
name: CI
on: push
jobs:
  build:
    runs-on: ubuntu-latest
    steps:
      - run: echo "{text}"
"""


def test_logs_never_show_another_stores_run_with_the_same_id(tmp_path: Path) -> None:
    state = tmp_path / "state"
    a, b = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    repo_a = make_repo(tmp_path / "a", workflow(ECHO.format(text="from-store-a")))
    repo_b = make_repo(tmp_path / "b", workflow(ECHO.format(text="from-store-b")))
    assert preloop("run", "--store", a, cwd=repo_a, state=state).returncode == 0
    assert preloop("run", "--store", b, cwd=repo_b, state=state).returncode == 0
    for url, mine, other in ((a, "from-store-a", "from-store-b"), (b, "from-store-b", "x-a")):
        out = preloop("logs", "--store", url, "1", cwd=tmp_path, state=state)
        assert out.returncode == 0, out.stderr
        assert f"[build] {mine}" in out.stdout
        assert other not in out.stdout
        one = preloop("logs", "--store", url, "1", "build", cwd=tmp_path, state=state)
        assert mine in one.stdout and other not in one.stdout


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgres//x", "--store 'postgres//x' is not a store URL: use postgresql://"),
        ("postgres//x", "(did you mean postgres://x?)"),
        ("sqlit:/tmp/x.db", "(did you mean sqlite:///tmp/x.db?)"),
        ("sqlite:///missing/dir/x.db", "directory /missing/dir does not exist"),
        ("mysql://host/db", "is not a store URL"),
    ],
)
def test_a_mistyped_store_is_an_error_and_creates_nothing(
    tmp_path: Path, url: str, message: str
) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["status"], ["logs", "1"], ["cancel", "1"]):
        out = preloop(*args, "--store", url, cwd=tmp_path, state=tmp_path / "state")
        assert out.returncode == 2, out
        assert out.stderr.count("\n") == 1 and message in out.stderr
    env_out = preloop("status", cwd=tmp_path, state=tmp_path / "state", PRELOOP_STORE_URL=url)
    assert env_out.returncode == 2 and "PRELOOP_STORE_URL" in env_out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not Path("/missing").exists()


def test_a_store_url_typo_suggests_the_url_it_meant() -> None:
    for typed, meant in (
        ("postgres//x", "postgres://x"),
        ("postgresql:/u@h/db", "postgresql://u@h/db"),
        ("postgresq://h/db", "postgresql://h/db"),
        ("sqlite//tmp/x.db", "sqlite:///tmp/x.db"),
    ):
        with pytest.raises(UsageError) as caught:
            check_store_url(typed, "--store")
        assert str(caught.value).endswith(f"(did you mean {meant}?)"), caught.value
        assert ":://" not in str(caught.value)
    with pytest.raises(UsageError) as caught:
        check_store_url("mysql://h/db", "--store")
    assert "did you mean" not in str(caught.value)


def test_unreachable_or_missing_postgresql_is_one_line_at_once(tmp_path: Path, pg_url: str) -> None:
    closed = "postgresql://postgres@127.0.0.1:1/test"
    out = preloop("status", "--store", closed, cwd=tmp_path, state=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"preloop: error: cannot connect to the PostgreSQL store {closed}")
    assert lines[0].endswith("(from --store)")
    out = preloop("status", cwd=tmp_path, state=tmp_path, PRELOOP_STORE_URL=closed)
    assert out.stderr.count("\n") == 1 and out.stderr.rstrip().endswith("(from PRELOOP_STORE_URL)")
    # A permanent error (no such database) is reported at once, not retried.
    base = pg_url.split("?")[0].rsplit("/", 1)[0]
    missing = f"{base}/preloop_no_such_database"
    out = preloop("status", "--store", missing, cwd=tmp_path, state=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "preloop_no_such_database" in out.stderr and "does not exist" in out.stderr


FAIL_FAST = """\
on: push
jobs:
  test:
    strategy:
      fail-fast: true
      matrix:
        leg: [a, b]
    runs-on: ubuntu-latest
    timeout-minutes: 2
    steps:
      - run: |
          if [ "${{{{ matrix.leg }}}}" = a ]; then exit 1; fi
          # b fails too, right after a's failure has been recorded (its
          # result file is written after the store completed it).
          until ls {state}/logs/*/test%230.json >/dev/null 2>&1; do sleep 0.02; done
          exit 1
"""


def test_a_leg_shows_one_conclusion_live_and_in_the_summary(tmp_path: Path, store_url: str) -> None:
    state = tmp_path / "state"
    repo = make_repo(tmp_path / "repo", workflow(FAIL_FAST.format(state=state)))
    live: dict[str, str] = {}

    def end(lease: Lease, result: JobResult) -> None:
        live[lease.job_id] = result.conclusion

    request = RunRequest(workspace=repo, store_url=store_url, state_dir=state, local_runners=2)
    outcome = anyio.run(Engine(request, EngineEvents(on_job_end=end)).run)
    summary = {j.id: j.conclusion for j in outcome.jobs if j.kind == "job"}
    assert summary["test#0"] == "failure"
    assert live == summary


def test_kill_tracked_counts_each_process_once(tmp_path: Path) -> None:
    """A killed process with a large address space stays visible in /proc
    while it exits; the old loop killed and counted it again."""
    from preloop.runner.job import kill_tracked

    script = "import sys,time; b=bytearray(256<<20); print('ready', flush=True); time.sleep(600)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "RUNNER_TRACKING_ID": f"kt-{os.getpid()}-x"},
        )
        for _ in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert kill_tracked(f"kt-{os.getpid()}-", prefix=True) == 3
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_sandbox_test_skips_where_bubblewrap_is_missing(tmp_path: Path) -> None:
    """The sandbox test skips (never fails) on a machine without `bwrap`."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not Path(d).is_dir():
            continue
        for entry in Path(d).iterdir():
            target = bindir / entry.name
            if entry.name != "bwrap" and not target.exists():
                target.symlink_to(entry)
    assert shutil.which("bwrap", path=str(bindir)) is None
    env = {**os.environ, "PATH": str(bindir)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            "tests/test_engine.py::test_sandbox_private_tmp_and_readonly_coordination",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout and "bubblewrap" in out.stdout


LONG = "a-job-name-that-is-much-longer-than-eighty-columns-" + "x" * 40


def test_piped_output_is_never_wrapped_and_counts_are_singular(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            f"""\
            name: CI
            on: push
            jobs:
              build:
                name: {LONG}
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      echo "::warning::same warning"
                      echo "::warning::same warning"
                      echo "::warning::same warning"
                      echo "::notice::once"
                      echo "## Step summary heading" >> "$GITHUB_STEP_SUMMARY"
            """
        ),
    )
    out = preloop("run", cwd=repo, state=state)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "run 1: CI (1 job)" in lines
    assert any(LONG in line and "success" in line for line in lines), out.stdout
    assert f"  {LONG}: warning: same warning (×3)" in lines
    assert f"  {LONG}: notice: once" in lines
    summary = preloop("logs", "1", "--summary", cwd=repo, state=state)
    assert summary.returncode == 0, summary.stderr
    assert f"## {LONG}" in summary.stdout and "## Step summary heading" in summary.stdout
    config = preloop("config", cwd=repo, state=state)
    store_row = next(line for line in config.stdout.splitlines() if "PRELOOP_STORE_URL" in line)
    assert "or empty for the lite store at $PRELOOP_STATE_DIR/preloop.db." in store_row
    cache = preloop("cache", "status", cwd=repo, state=state)
    cache_dir = str(state / "snapshot-object-cache")
    assert any(
        line.startswith("1 entry, ") and cache_dir in line for line in cache.stdout.splitlines()
    ), cache.stdout
    # The tables of `actions list`, `toolcache` and `artifacts`: whole rows.
    (state / "actions" / "repos" / "owner" / LONG / ("c" * 40)).mkdir(parents=True)
    tool = state / "toolcache" / LONG / "1.2.3"
    (tool / "x64").mkdir(parents=True)
    (tool / "x64.complete").touch()
    storage = LocalStorage(state)
    upload = storage.create_artifact("1", "build", LONG, None)

    async def body() -> AsyncIterator[bytes]:
        yield b"zip"

    anyio.run(storage.write_block, upload, None, body(), 1024)
    storage.finalize_artifact("1", "build", LONG, 3, "sha256:x")
    for args, expect in (
        (("actions", "list"), f"owner/{LONG}"),
        (("toolcache",), f"{LONG}  1.2.3"),
        (("artifacts", "1"), f"{LONG}  3 B"),
    ):
        listed = preloop(*args, cwd=repo, state=state)
        assert listed.returncode == 0, listed.stderr
        assert any(expect in line for line in listed.stdout.splitlines()), listed.stdout


def test_a_silent_step_prints_a_still_running_line(tmp_path: Path) -> None:
    fifo = tmp_path / "release.fifo"
    os.mkfifo(fifo)
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            f"""\
            on: push
            jobs:
              quiet:
                runs-on: ubuntu-latest
                steps:
                  - name: wait for the test
                    run: read line < {fifo}; echo "released"
            """
        ),
    )
    proc = spawn(
        [*PRELOOP, "run"], _env(tmp_path / "state", PRELOOP_SILENT_STEP_NOTICE="1"), cwd=repo
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            # On a loaded machine the job may first be silent before its
            # step starts ("still running: the job"); the step's own notice
            # comes once the step has been silent in turn.
            if "still running: wait for the test" in line:
                break
        assert seen and "[quiet] … still running: wait for the test" in seen[-1], seen
        with open(fifo, "w") as w:
            w.write("go\n")
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "[quiet] released" in rest


@pytest.mark.parametrize("command", ["run", "runner"])
def test_sandbox_network_without_sandbox_is_an_error(tmp_path: Path, command: str) -> None:
    # Alone it would sandbox nothing while looking as if the network were cut.
    # (checked before anything else: the runner's store is never contacted)
    store = ["--store", "postgresql://nobody@127.0.0.1:1/none"] if command == "runner" else []
    proc = preloop(
        command, *store, "--sandbox-network", "none", cwd=tmp_path, state=tmp_path / "state"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "preloop: error: --sandbox-network none needs --sandbox "
        "(add --sandbox, or drop --sandbox-network)"
    )
    assert not (tmp_path / "state").exists()
