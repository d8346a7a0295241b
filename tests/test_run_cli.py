"""`preloop run`, `status`, `logs`, `cancel` and `runner` as processes."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.run_support import make_repo, workflow

PRELOOP = [sys.executable, "-m", "preloop"]


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env.update(PRELOOP_STATE_DIR=str(state), **extra)
    return env


def preloop(
    *args: str, cwd: Path, state: Path, check_code: int | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*PRELOOP, *args], cwd=cwd, env=_env(state), capture_output=True, text=True, timeout=300
    )
    if check_code is not None:
        assert proc.returncode == check_code, (proc.stdout, proc.stderr)
    return proc


def spawn(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen[str]:
    """`argv` started with its output piped as text (the caller reads or
    communicates, and kills it if the test fails first)."""
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _exited(pidfd: int, wait: float = 30.0) -> bool:
    readable, _, _ = select.select([pidfd], [], [], wait)
    return bool(readable)


def read_fifo(fifo: Path, procs: list[subprocess.Popen[str]], limit: float = 120.0) -> str:
    """Waits for a line on `fifo`, failing early if one of `procs` exits."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        data = b""
        waited = 0.0
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], 1.0)
            waited += 1.0
            if ready:
                data += os.read(fd, 4096)
            for p in procs:
                assert p.poll() is None, f"process exited early: {p.args} -> {p.returncode}"
            assert waited < limit, "no line on the fifo"
        return data.decode().strip()
    finally:
        os.close(fd)


HANG = """\
    on: push
    jobs:
      hang:
        runs-on: ubuntu-latest
        steps:
          - run: |
              sleep 1000 &
              echo "$$ $!" > {fifo}
              wait
    """


def test_run_plain_output_summary_and_exit_codes(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            name: CI
            on: push
            jobs:
              build:
                runs-on: ubuntu-latest
                steps:
                  - run: echo building
              test:
                needs: build
                runs-on: ubuntu-latest
                steps:
                  - run: echo "::warning::flaky test"
            """
        ),
    )
    state = tmp_path / "state"
    proc = preloop("run", cwd=repo, state=state, check_code=0)
    assert "[build] building" in proc.stdout
    assert "build" in proc.stdout and "✓ success" in proc.stdout
    assert "warning: flaky test" in proc.stdout
    (repo / ".github/workflows/ci.yml").write_text(
        "on: push\njobs:\n  bad:\n    runs-on: ubuntu-latest\n    steps:\n      - run: exit 7\n"
    )
    proc = preloop("run", "--json", cwd=repo, state=state, check_code=1)
    doc = json.loads(proc.stdout)
    assert doc["conclusion"] == "failure"
    assert [(j["id"], j["result"]) for j in doc["jobs"]] == [("bad", "failure")]
    assert doc["jobs"][0]["annotations"] == [
        "error: Run exit 7: process completed with exit code 7"
    ]
    status = json.loads(preloop("status", "--json", cwd=repo, state=state, check_code=0).stdout)
    assert [r["conclusion"] for r in status] == ["failure", "success"]
    logs = preloop("logs", str(doc["run_id"]), "bad", cwd=repo, state=state, check_code=0)
    assert "exit code 7" in logs.stdout
    missing = preloop("logs", "999", cwd=repo, state=state, check_code=1)
    assert "no run 999" in missing.stderr


def test_configuration_variables_from_the_command_line_and_a_file(tmp_path: Path) -> None:
    """`--var-file` then `--var` (the later wins) give `vars`, to `preloop
    plan` and `preloop run`; a malformed one is a one-line usage error."""
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              build:
                runs-on: ${{ vars.RUNNER }}
                steps:
                  - run: echo "greeting=${{ vars.GREETING }} from=${{ vars.FROM }}"
            """
        ),
    )
    (tmp_path / "vars.env").write_text("GREETING=hello from file\nFROM='the file'\n")
    state = tmp_path / "state"
    given = ["--var-file", str(tmp_path / "vars.env"), "--var", "RUNNER=ubuntu-latest"]
    plan = preloop("plan", "--json", *given, cwd=repo, state=state, check_code=0)
    assert json.loads(plan.stdout)[0]["jobs"][0]["runs_on"] == ["ubuntu-latest"]
    proc = preloop("run", *given, "--var", "GREETING=hi", cwd=repo, state=state, check_code=0)
    assert "[build] greeting=hi from=the file" in proc.stdout
    bad = preloop("run", "--var", "RUNNER", cwd=repo, state=state, check_code=2)
    assert "--var RUNNER: use NAME=VALUE" in bad.stderr and "Traceback" not in bad.stderr
    missing = preloop("plan", "--var-file", "nope.env", cwd=repo, state=state, check_code=2)
    assert "--var-file nope.env: No such file or directory" in missing.stderr


def test_bad_workflow_file_line_col_nothing_submitted(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    stepz: []\n"),
    )
    state = tmp_path / "state"
    proc = preloop("run", cwd=repo, state=state, check_code=1)
    assert ".github/workflows/ci.yml:5:5" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    status = json.loads(preloop("status", "--json", cwd=repo, state=state, check_code=0).stdout)
    assert status == []


@pytest.mark.parametrize(("signum", "by"), [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_sigint_cancels_and_leaves_no_process(tmp_path: Path, signum: int, by: str) -> None:
    """Ctrl-C, or SIGTERM (`timeout`, a supervisor), which the run's cancel
    reason names: not a Ctrl-C nobody pressed."""
    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    repo = make_repo(tmp_path / "repo", workflow(HANG.format(fifo=fifo)))
    state = tmp_path / "state"
    proc = spawn([*PRELOOP, "run", "--json"], _env(state), cwd=repo)
    try:
        shell_pid, grandchild = (int(x) for x in read_fifo(fifo, [proc]).split())
        pidfds = [os.pidfd_open(shell_pid), os.pidfd_open(grandchild)]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert all(_exited(fd) for fd in pidfds)
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["cancel_reason"] == f"cancelled by {by}"
    assert [(j["id"], j["result"]) for j in doc["jobs"]] == [("hang", "cancelled")]
    status = json.loads(
        preloop("status", str(doc["run_id"]), "--json", cwd=repo, state=state).stdout
    )
    assert status["status"] == "completed"


def test_cancel_command_stops_a_running_job(tmp_path: Path) -> None:
    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    repo = make_repo(tmp_path / "repo", workflow(HANG.format(fifo=fifo)))
    state = tmp_path / "state"
    proc = spawn([*PRELOOP, "run", "--json"], _env(state), cwd=repo)
    try:
        _, grandchild = (int(x) for x in read_fifo(fifo, [proc]).split())
        pidfd = os.pidfd_open(grandchild)
        runs = json.loads(preloop("status", "--json", cwd=repo, state=state).stdout)
        out = preloop("cancel", str(runs[0]["id"]), cwd=repo, state=state, check_code=0)
        assert "cancel requested" in out.stdout
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert _exited(pidfd)
    doc = json.loads(stdout)
    assert doc["conclusion"] == "cancelled"
    assert doc["cancel_reason"] == "cancelled by the user (preloop cancel)"


@pytest.fixture
def runners(pg_url: str, tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _start_runner(
    procs: list[subprocess.Popen[str]],
    pg_url: str,
    state: Path,
    name: str,
    *extra: str,
) -> subprocess.Popen[str]:
    p = spawn(
        [*PRELOOP, "runner", "--store", pg_url, "--name", name, "--labels", "big", *extra],
        _env(state),
    )
    procs.append(p)
    return p


def test_two_runners_share_one_run_on_postgresql(
    tmp_path: Path, pg_url: str, runners: list[subprocess.Popen[str]]
) -> None:
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # Each job waits for the other to have started: they can only both finish
    # if two runners hold them at the same time.
    script = (
        f"touch {barrier}/${{{{ github.job }}}}\n"
        f'until [ "$(ls {barrier} | wc -l)" -ge 2 ]; do sleep 0.05; done\n'
        'echo "ran on $RUNNER_NAME"\n'
    )
    jobs = {
        name: {
            "runs-on": ["self-hosted", "big"],
            "timeout-minutes": 2,
            "steps": [{"run": script}],
        }
        for name in ("one", "two")
    }
    repo = make_repo(
        tmp_path / "repo", workflow(json.dumps({"on": "push", "jobs": jobs}, indent=1))
    )
    state = tmp_path / "state"
    a = _start_runner(runners, pg_url, state, "runner-a")
    b = _start_runner(runners, pg_url, state, "runner-b")
    proc = preloop("run", "-j", "0", "--store", pg_url, "--json", cwd=repo, state=state)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    doc = json.loads(proc.stdout)
    assert {j["runner"] for j in doc["jobs"]} == {"runner-a", "runner-b"}
    for p in (a, b):
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert "stopped after 1 job\n" in out


def test_one_runner_with_capacity_runs_jobs_side_by_side(
    tmp_path: Path, pg_url: str, runners: list[subprocess.Popen[str]]
) -> None:
    """`preloop runner --capacity 2`: one process holds both jobs at once (each
    waits for the other to start), then a third after a slot frees."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    script = (
        f"touch {barrier}/${{{{ github.job }}}}\n"
        f'until [ "$(ls {barrier} | wc -l)" -ge 2 ]; do sleep 0.05; done\n'
    )
    jobs: dict[str, object] = {
        name: {"runs-on": ["self-hosted", "big"], "timeout-minutes": 2, "steps": [{"run": script}]}
        for name in ("one", "two")
    }
    jobs["three"] = {
        "runs-on": ["self-hosted", "big"],
        "needs": ["one"],
        "steps": [{"run": "echo third"}],
    }
    repo = make_repo(
        tmp_path / "repo", workflow(json.dumps({"on": "push", "jobs": jobs}, indent=1))
    )
    state = tmp_path / "state"
    slots = _start_runner(runners, pg_url, state, "slots", "--capacity", "2")
    proc = preloop("run", "-j", "0", "--store", pg_url, "--json", cwd=repo, state=state)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    doc = json.loads(proc.stdout)
    assert {j["runner"] for j in doc["jobs"]} == {"slots"}
    assert doc["conclusion"] == "success" and len(doc["jobs"]) == 3
    slots.send_signal(signal.SIGTERM)
    out, err = slots.communicate(timeout=60)
    assert slots.returncode == 0, err
    assert "stopped after 3 jobs" in out


def test_runner_sigterm_cancels_its_job_and_exits_zero(
    tmp_path: Path, pg_url: str, runners: list[subprocess.Popen[str]]
) -> None:
    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    repo = make_repo(tmp_path / "repo", workflow(HANG.format(fifo=fifo)))
    state = tmp_path / "state"
    runner = _start_runner(runners, pg_url, state, "runner-x")
    run = spawn([*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"], _env(state), cwd=repo)
    runners.append(run)
    shell_pid, grandchild = (int(x) for x in read_fifo(fifo, [runner, run]).split())
    pidfds = [os.pidfd_open(shell_pid), os.pidfd_open(grandchild)]
    runner.send_signal(signal.SIGTERM)
    _, err = runner.communicate(timeout=60)
    assert runner.returncode == 0, err
    assert all(_exited(fd) for fd in pidfds)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1, err
    doc = json.loads(out)
    assert [(j["id"], j["result"]) for j in doc["jobs"]] == [("hang", "cancelled")]
    assert doc["conclusion"] == "cancelled"


def test_terminal_gets_live_progress_and_summary(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            "on: push\njobs:\n  only:\n    runs-on: ubuntu-latest\n"
            "    steps:\n      - run: echo from-the-step\n"
        ),
    )
    primary, secondary = os.openpty()
    env = _env(tmp_path / "state", COLUMNS="100", TERM="xterm")
    proc = subprocess.Popen(
        [*PRELOOP, "run"], cwd=repo, env=env, stdout=secondary, stderr=secondary
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.wait(timeout=120) == 0, text
    # The panel re-renders on every state change, so even a job shorter than the
    # refresh period is shown running, then done.
    assert "running 1" in text and "done 1" in text, text
    assert "[only] from-the-step" in text, text
    assert "success" in text and "preloop logs" in text, text


def test_killed_run_is_recovered_by_the_next_run(tmp_path: Path) -> None:
    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    files = {
        ".github/workflows/hang.yml": HANG.format(fifo=fifo),
        ".github/workflows/quick.yml": (
            "on: push\njobs:\n  quick:\n    runs-on: ubuntu-latest\n"
            "    steps:\n      - run: echo quick\n"
        ),
    }
    repo = make_repo(tmp_path / "repo", files)
    state = tmp_path / "state"
    first = subprocess.Popen(
        [*PRELOOP, "run", "-f", ".github/workflows/hang.yml", "--json"],
        cwd=repo,
        env=_env(state),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        shell_pid, grandchild = (int(x) for x in read_fifo(fifo, [first]).split())
        pidfds = [os.pidfd_open(shell_pid), os.pidfd_open(grandchild)]
        first.kill()  # a crash: nothing of preloop's cleanup runs
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not _exited(pidfds[1], 0.0)  # the step outlived its `preloop run`
    second = preloop("run", "-f", ".github/workflows/quick.yml", cwd=repo, state=state)
    assert second.returncode == 0, second.stderr
    assert "run 1 was left unfinished" in second.stderr
    assert all(_exited(fd) for fd in pidfds)
    status = json.loads(preloop("status", "1", "--json", cwd=repo, state=state).stdout)
    assert status["status"] == "completed"
    assert [(j["id"], j["result"]) for j in status["jobs"]] == [("hang", "cancelled")]
    # Both run repositories are gone (the dead run's by the recovery).
    assert [p.name for p in (state / "snapshots").iterdir() if not p.name.startswith(".")] == []
