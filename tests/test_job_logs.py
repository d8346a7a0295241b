"""Job logs and results through the store (preloop.control.joblogs): what a
runner on another machine writes, `preloop logs` reads anywhere (also while
the job runs, with -f), and the submitting `preloop run` shows live."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path

from tests.run_support import make_repo, workflow
from tests.test_run_cli import PRELOOP, _env, _start_runner, preloop, runners, spawn
from tests.test_store_faults import _terminate, _with_app_name

from preloop.control import Store, open_store
from preloop.control.joblogs import JobLogStore
from preloop.runner.logs import JobLog
from preloop.testing.control_fixtures import store, store_url

__all__ = ["runners", "store", "store_url"]


def test_batches_are_idempotent_and_read_in_order_after_what_was_printed(store: Store) -> None:
    logs = JobLogStore(store)
    logs.append(7, "build", 0, ["one", "two"])
    logs.append(7, "build", 0, ["one", "two"])  # a retried batch writes nothing twice
    logs.append(7, "build", 1, ["three"])
    logs.append(7, "test (3.12)", 0, ["other job"])
    logs.append(8, "build", 0, ["other run"])
    got = [(b.job_id, b.seq, b.lines) for b in logs.read(7)]
    assert got == [
        ("build", 0, ["one", "two"]),
        ("build", 1, ["three"]),
        ("test (3.12)", 0, ["other job"]),
    ]
    assert [b.lines for b in logs.read(7, "build", {"build": 0})] == [["three"]]
    assert logs.jobs_with_logs(7) == {"build", "test (3.12)"}
    logs.save_result(7, "build", {"conclusion": "failure"})
    logs.save_result(7, "build", {"conclusion": "success"})  # a rewrite replaces
    assert logs.results(7) == {"build": {"conclusion": "success"}}
    assert logs.results(9) == {}


def test_a_job_log_ships_every_line_once_in_order_and_its_result_after_them(
    store: Store, tmp_path: Path
) -> None:
    from preloop.runner.job import JobResult

    logs = JobLogStore(store)
    log = JobLog(tmp_path, 3, "caller/inner", logs)
    for i in range(1234):
        log.write(f"line {i}")
    log.save_result(JobResult("success", {"x": "1"}, [], [], "## done"))
    log.close()
    lines = [line for b in logs.read(3) for line in b.lines]
    assert lines == [f"line {i}" for i in range(1234)]
    assert logs.results(3)["caller/inner"]["summary"] == "## done"
    # The runner's own file has them too.
    assert log.path.read_text().splitlines() == lines


def test_lines_survive_the_connections_being_terminated(
    pg_url: str, pg_server_url: str, tmp_path: Path
) -> None:
    app = "preloop_log_fault"
    with open_store(_with_app_name(pg_url, app)) as s:
        logs = JobLogStore(s)
        log = JobLog(tmp_path, 4, "build", logs)
        cuts = 0
        for i in range(300):
            log.write(f"line {i}")
            if i in (50, 150, 250):
                cuts += _terminate(pg_server_url, app)
        log.close()
        assert cuts >= 1
        lines = [line for b in logs.read(4) for line in b.lines]
        assert lines == [f"line {i}" for i in range(300)]


def _read_until(proc: subprocess.Popen[str], needle: str, limit: float = 120.0) -> str:
    """What `proc` printed up to and including the first line with `needle`."""
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + limit
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not printed; got {seen!r}"
        select.select([fd], [], [], left)
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"{needle!r} not printed before exit; got {seen!r}")
        seen += chunk.decode()
    return seen


def test_remote_jobs_are_shown_live_and_their_logs_read_from_any_machine(
    tmp_path: Path, pg_url: str, runners: list[subprocess.Popen[str]]
) -> None:
    """`preloop run -j 0` on a PostgreSQL store: a runner with its own state
    directory runs the jobs; the submitter shows their lines and results as
    they come, and `preloop logs` with a third, empty state directory reads
    them (-f follows a job while it runs)."""
    gate = tmp_path / "gate.fifo"
    os.mkfifo(gate)
    jobs = {
        "first": {
            "runs-on": ["self-hosted", "big"],
            "steps": [
                {"name": "greet", "run": 'echo "hello from $RUNNER_NAME"'},
                # Waits for the test to have followed the line above.
                {"run": f'read -r word < {gate}; echo "released with $word"'},
            ],
        },
        "second": {
            "runs-on": ["self-hosted", "big"],
            "needs": "first",
            "steps": [{"run": "echo second-done; echo '::warning::remote warning'"}],
        },
    }
    repo = make_repo(
        tmp_path / "repo", workflow(json.dumps({"on": "push", "jobs": jobs}, indent=1))
    )
    submitter = tmp_path / "submitter"
    elsewhere = tmp_path / "elsewhere"
    _start_runner(runners, pg_url, tmp_path / "runner-state", "far-runner")
    run = spawn([*PRELOOP, "run", "-j", "0", "--store", pg_url], _env(submitter), cwd=repo)
    runners.append(run)
    shown = _read_until(run, "hello from far-runner")
    assert "[first] hello from far-runner" in shown
    run_id = int(shown.split("run ", 1)[1].split(":", 1)[0])
    # Another machine follows the job while it waits on the gate.
    follow = spawn(
        [*PRELOOP, "logs", str(run_id), "first", "-f", "--store", pg_url], _env(elsewhere)
    )
    runners.append(follow)
    _read_until(follow, "hello from far-runner")
    with open(gate, "w") as fh:
        fh.write("go\n")
    out, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    assert "released with go" in out  # followed to the job's end
    rest, err = run.communicate(timeout=120)
    assert run.returncode == 0, (shown + rest, err)
    printed = shown + rest
    assert "[first] released with go" in printed
    assert "[second] second-done" in printed
    assert "remote warning" in printed  # the remote result's annotation, in the summary
    assert "✓ success" in printed
    # Read afterwards from a state directory that has none of it.
    assert not (elsewhere / "logs").exists()
    proc = preloop("logs", str(run_id), "--store", pg_url, cwd=tmp_path, state=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "[first] hello from far-runner" in proc.stdout
    assert "[second] second-done" in proc.stdout
    proc = preloop(
        "logs", str(run_id), "second", "--store", pg_url, "--summary", cwd=tmp_path, state=elsewhere
    )
    assert proc.returncode == 0, proc.stderr
    proc = preloop(
        "status", str(run_id), "--store", pg_url, "--json", cwd=tmp_path, state=elsewhere
    )
    doc = json.loads(proc.stdout)
    assert {j["runner"] for j in doc["jobs"]} == {"far-runner"}


def test_follow_on_the_lite_store_reads_the_files_until_the_run_ends(tmp_path: Path) -> None:
    gate = tmp_path / "gate.fifo"
    os.mkfifo(gate)
    steps = [{"run": "echo before"}, {"run": f"read -r w < {gate}; echo after-$w"}]
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            json.dumps(
                {"on": "push", "jobs": {"one": {"runs-on": "ubuntu-latest", "steps": steps}}}
            )
        ),
    )
    state = tmp_path / "state"
    run = spawn([*PRELOOP, "run"], _env(state), cwd=repo)
    try:
        shown = _read_until(run, "before")
        run_id = int(shown.split("run ", 1)[1].split(":", 1)[0])
        follow = spawn([*PRELOOP, "logs", str(run_id), "-f"], _env(state))
        _read_until(follow, "before")
        with open(gate, "w") as fh:
            fh.write("go\n")
        out, err = follow.communicate(timeout=120)
        assert follow.returncode == 0, err
        assert "[one] after-go" in out
        run.communicate(timeout=120)
        assert run.returncode == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
