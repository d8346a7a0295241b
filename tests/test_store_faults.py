"""Database faults: lost PostgreSQL connections are retried, never a traceback."""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
from tests.run_support import make_repo, workflow
from tests.test_run_cli import PRELOOP, _env, read_fifo, spawn

from preloop.control import open_store
from preloop.control.db import PgBackend, Tx


def _with_app_name(url: str, name: str) -> str:
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query), ("application_name", name)]
    return urlunsplit(parts._replace(query=urlencode(query)))


def _terminate(server_url: str, app: str) -> int:
    """pg_terminate_backend of every connection named `app`; how many."""
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (app,),
        ).fetchall()
    return len(rows)


@pytest.fixture
def app_url(pg_url: str) -> Iterator[tuple[str, str]]:
    app = f"preloop_fault_{secrets.token_hex(4)}"
    yield _with_app_name(pg_url, app), app


def test_a_transaction_whose_connection_dies_is_retried(
    app_url: tuple[str, str], pg_server_url: str
) -> None:
    url, app = app_url
    warnings: list[str] = []
    backend = PgBackend(url, outage_warn_after=0.0, warn=warnings.append)
    try:
        backend.transaction("t", lambda tx: tx.execute("CREATE TABLE t (v INTEGER)"))
        attempts = []

        def insert(tx: Tx) -> int:
            attempts.append(1)
            tx.execute("INSERT INTO t VALUES (1)")
            if len(attempts) == 1:
                assert _terminate(pg_server_url, app) >= 1
            row = tx.one("SELECT count(*) AS n FROM t")
            assert row is not None
            return int(row["n"])

        assert backend.transaction("insert", insert) == 1
        assert len(attempts) == 2
        assert backend.connection_retries >= 1
        # Between transactions too: the held connection is dead, the next one works.
        _terminate(pg_server_url, app)
        assert backend.transaction("count", lambda tx: tx.one("SELECT count(*) AS n FROM t")) == {
            "n": 1
        }
        assert any("unreachable" in w and "still trying" in w for w in warnings), warnings
        assert all("\n" not in w for w in warnings)
    finally:
        backend.close()


def test_a_lost_commit_that_committed_is_not_rerun(
    app_url: tuple[str, str], pg_server_url: str
) -> None:
    """The ambiguous case: the server committed, the answer was lost."""
    url, _ = app_url
    backend = PgBackend(url)
    try:
        backend.transaction("t", lambda tx: tx.execute("CREATE TABLE t (v INTEGER)"))
        runs: list[int] = []
        lost: list[int] = []
        from psycopg import OperationalError

        def insert(tx: Tx) -> None:
            runs.append(1)
            tx.execute("INSERT INTO t VALUES (1)")

        # Make the COMMIT go through and its answer be "lost".
        import psycopg

        real_tx = psycopg.Connection.transaction

        def lossy(self: psycopg.Connection, *a: object, **k: object) -> object:
            cm = real_tx(self, *a, **k)

            class Wrap:
                def __enter__(self_inner) -> object:
                    return cm.__enter__()

                def __exit__(self_inner, *exc: object) -> bool:
                    cm.__exit__(*exc)  # type: ignore[arg-type]
                    if exc[0] is None and runs and not lost:
                        lost.append(1)
                        self.close()
                        raise OperationalError("the connection was lost during COMMIT")
                    return False

            return Wrap()

        psycopg.Connection.transaction = lossy  # type: ignore[method-assign,assignment]
        try:
            backend.transaction("insert", insert)
        finally:
            psycopg.Connection.transaction = real_tx  # type: ignore[method-assign]
        assert lost and len(runs) == 1
        assert backend.transaction("n", lambda tx: tx.one("SELECT count(*) AS n FROM t")) == {
            "n": 1
        }
    finally:
        backend.close()


CHAIN = """\
    on: push
    jobs:
      a:
        runs-on: {runs_on}
        outputs: {{v: "${{{{ steps.s.outputs.v }}}}"}}
        steps:
          - id: s
            run: |
              echo a > {fifo}
              until [ -e {go}/a ]; do sleep 0.02; done
              echo v=1 >> "$GITHUB_OUTPUT"
      b:
        needs: a
        runs-on: {runs_on}
        outputs: {{v: "${{{{ steps.s.outputs.v }}}}"}}
        steps:
          - id: s
            run: |
              echo b > {fifo}
              until [ -e {go}/b ]; do sleep 0.02; done
              echo "v=$(( ${{{{ needs.a.outputs.v }}}} + 1 ))" >> "$GITHUB_OUTPUT"
      c:
        needs: b
        runs-on: {runs_on}
        steps:
          - run: |
              echo c > {fifo}
              until [ -e {go}/c ]; do sleep 0.02; done
              test "${{{{ needs.b.outputs.v }}}}" = 2
    """


@pytest.mark.parametrize("where", ["local", "remote"])
def test_run_survives_three_rounds_of_terminated_connections(
    tmp_path: Path, app_url: tuple[str, str], pg_server_url: str, where: str
) -> None:
    url, app = app_url
    fifo = tmp_path / "steps.fifo"
    os.mkfifo(fifo)
    go = tmp_path / "go"
    go.mkdir()
    runs_on = '["self-hosted", "big"]' if where == "remote" else "ubuntu-latest"
    repo = make_repo(
        tmp_path / "repo",
        workflow(CHAIN.format(runs_on=runs_on, fifo=fifo, go=go)),
    )
    state = tmp_path / "state"
    procs: list[subprocess.Popen[str]] = []
    try:
        if where == "remote":
            procs.append(
                spawn(
                    [*PRELOOP, "runner", "--store", url, "--name", "r1", "--labels", "big"],
                    _env(state / "runner"),
                )
            )
        args = ["run", "--store", url, "--json"] + (["-j", "0"] if where == "remote" else [])
        run = spawn([*PRELOOP, *args], _env(state), cwd=repo)
        procs.append(run)
        for job in ("a", "b", "c"):
            assert read_fifo(fifo, procs) == job
            assert _terminate(pg_server_url, app) >= 1
            (go / job).touch()
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, (out, err)
        assert "Traceback" not in err and "OperationalError" not in err, err
        doc = json.loads(out)
        assert doc["conclusion"] == "success"
        assert {j["id"]: j["result"] for j in doc["jobs"]} == {
            "a": "success",
            "b": "success",
            "c": "success",
        }
        if where == "remote":
            runner = procs[0]
            runner.terminate()
            rout, rerr = runner.communicate(timeout=60)
            assert runner.returncode == 0, rerr
            assert "Traceback" not in rerr, rerr
            assert "stopped after 3 jobs" in rout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_lease_knob_sets_lease_and_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    from preloop.runner import RunnerOptions

    monkeypatch.setenv("PRELOOP_LEASE_SECONDS", "3")
    opts = RunnerOptions(name="r", labels=[], state_dir=Path("/nonexistent"))
    assert opts.lease_seconds == 3 and opts.heartbeat_every == 1.0
    monkeypatch.delenv("PRELOOP_LEASE_SECONDS")
    opts = RunnerOptions(name="r", labels=[], state_dir=Path("/nonexistent"))
    assert opts.lease_seconds == 60 and opts.heartbeat_every == 2.0


def test_runner_once_and_max_jobs(tmp_path: Path, pg_url: str) -> None:
    jobs = {
        name: {"runs-on": ["self-hosted", "big"], "steps": [{"run": f"echo {name}"}]}
        for name in ("one", "two", "three", "four")
    }
    repo = make_repo(tmp_path / "repo", workflow(json.dumps({"on": "push", "jobs": jobs})))
    state = tmp_path / "state"
    run = spawn([*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"], _env(state), cwd=repo)
    try:
        for flags, ran in (
            (["--once"], 1),
            (["--capacity", "2", "--max-jobs", "1"], 1),  # claims no more than it may run
            (["--max-jobs", "2"], 2),
        ):
            proc = subprocess.run(
                [*PRELOOP, "runner", "--store", pg_url, "--labels", "big", *flags],
                env=_env(tmp_path / "runner"),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, proc.stderr
            assert f"stopped after {ran} job{'s' if ran > 1 else ''}\n" in proc.stdout
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert json.loads(out)["conclusion"] == "success"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _gone(pid: int, wait: float = 30.0) -> bool:
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], wait)[0])
    finally:
        os.close(fd)


def test_sigkilled_runner_leaves_no_step_process_and_its_dir_is_swept(
    tmp_path: Path, pg_url: str
) -> None:
    from preloop.runner.checkout import work_dir

    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    text = (
        "on: push\njobs:\n  hang:\n    runs-on: [self-hosted, big]\n    steps:\n"
        f'      - run: |\n          sleep 1000 &\n          echo "$$ $!" > {fifo}\n'
        "          wait\n"
    )
    repo = make_repo(tmp_path / "repo", workflow(text))
    state = tmp_path / "state"
    rstate = tmp_path / "runner-state"
    runner = spawn([*PRELOOP, "runner", "--store", pg_url, "--labels", "big"], _env(rstate))
    run = spawn(
        [*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"],
        _env(state, PRELOOP_LEASE_SECONDS="3"),
        cwd=repo,
    )
    try:
        pids = [int(p) for p in read_fifo(fifo, [runner, run]).split()]
        job_dirs = list(work_dir(rstate).glob(f"{runner.pid}-*"))
        assert job_dirs
        runner.kill()
        runner.wait()
        for pid in pids:
            assert _gone(pid), f"step process {pid} outlived its SIGKILLed runner"
        # What the next runner on the host does at startup: the dead one's
        # job directory goes (no process uses it any more).
        from preloop.runner.checkout import sweep_work_dir

        sweep_work_dir(rstate)
        assert not any(d.exists() for d in job_dirs)
    finally:
        for p in (runner, run):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_sweep_kills_leftovers_by_tracking_id_and_spares_dirs_in_use(tmp_path: Path) -> None:
    from preloop.runner.checkout import sweep_work_dir, work_dir
    from preloop.runner.watchdog import TRACKING_FILE

    dead = subprocess.Popen(["true"])
    dead.wait()
    root = work_dir(tmp_path)
    tracked = root / f"{dead.pid}-1-a-x"
    used = root / f"{dead.pid}-1-b-y"
    live = root / f"{os.getpid()}-1-c-z"
    for d in (tracked, used, live):
        d.mkdir(parents=True)
    (tracked / TRACKING_FILE).write_text("preloop_k_t1")
    (used / TRACKING_FILE).write_text("preloop_k_t2")
    leftover = subprocess.Popen(
        ["sleep", "1000"], cwd=tracked, env={**os.environ, "RUNNER_TRACKING_ID": "preloop_k_t1"}
    )
    untagged = subprocess.Popen(["sleep", "1000"], cwd=used, env=dict(os.environ))
    try:
        removed = sweep_work_dir(tmp_path)
        assert leftover.wait(timeout=10) < 0  # killed by its tracking id
        assert removed == [tracked]
        assert used.exists() and live.exists()  # a process works in it / its runner lives
        untagged.kill()
        untagged.wait()
        assert sweep_work_dir(tmp_path) == [used]
    finally:
        for p in (leftover, untagged):
            if p.poll() is None:
                p.kill()
                p.wait()


LEGS = 12

RACE = """\
    on: push
    jobs:
      leg:
        runs-on: [self-hosted, big]
        strategy:
          matrix:
            i: {legs}
        steps:
          - run: |
              echo "start ${{{{ matrix.i }}}} $RUNNER_NAME $(date +%s%N)" >> {log}
              echo "${{{{ matrix.i }}}}" > {fifo}
              echo "end ${{{{ matrix.i }}}} $RUNNER_NAME $(date +%s%N)" >> {log}
    """


def test_a_job_is_never_executed_twice_at_the_same_moment(
    tmp_path: Path, app_url: tuple[str, str], pg_server_url: str
) -> None:
    """Three runners (two slots each) race for twelve legs while every
    preloop connection is terminated three times: each leg runs exactly once,
    on one runner, and no two executions of a leg overlap."""
    url, app = app_url
    fifo = tmp_path / "starts.fifo"
    os.mkfifo(fifo)
    log = tmp_path / "executions.log"
    repo = make_repo(
        tmp_path / "repo",
        workflow(RACE.format(legs=list(range(1, LEGS + 1)), log=log, fifo=fifo)),
    )
    # Held open read-write: no writer ever blocks on a reader that went away.
    reader = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    procs: list[subprocess.Popen[str]] = []
    try:
        runner_args = ["--store", url, "--labels", "big", "--capacity", "2"]
        for n in range(3):
            procs.append(
                spawn(
                    [*PRELOOP, "runner", "--name", f"r{n}", *runner_args],
                    _env(tmp_path / f"runner{n}"),
                )
            )
        run = spawn(
            [*PRELOOP, "run", "-j", "0", "--store", url, "--json"],
            _env(tmp_path / "state"),
            cwd=repo,
        )
        procs.append(run)
        started = 0
        buffered = b""
        cuts = 0
        while started < LEGS:
            ready, _, _ = select.select([reader], [], [], 1.0)
            for p in procs:
                assert p.poll() is None, f"exited early: {p.args} -> {p.communicate()}"
            if not ready:
                continue
            buffered += os.read(reader, 4096)
            lines = buffered.split(b"\n")
            buffered = lines.pop()
            for _ in lines:
                started += 1
                if started in (2, 6, 10):
                    cuts += _terminate(pg_server_url, app)
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, (out, err)
        assert cuts >= 3
        assert "Traceback" not in err, err
        doc = json.loads(out)
        assert doc["conclusion"] == "success"
        assert len(doc["jobs"]) == LEGS
        executions: dict[str, list[tuple[str, str, int]]] = {}
        for line in log.read_text().splitlines():
            what, leg, runner, ns = line.split()
            executions.setdefault(leg, []).append((what, runner, int(ns)))
        assert sorted(executions, key=int) == [str(i) for i in range(1, LEGS + 1)]
        for leg, events in executions.items():
            # Exactly one execution, whole, on one runner.
            assert [e[0] for e in events] == ["start", "end"], (leg, events)
            assert events[0][1] == events[1][1], (leg, events)
        for p in procs[:3]:
            p.terminate()
            _, rerr = p.communicate(timeout=60)
            assert p.returncode == 0, rerr
            assert "Traceback" not in rerr, rerr
    finally:
        os.close(reader)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_threads_that_end_give_their_connection_back(pg_url: str) -> None:
    """Each thread keeps its own connection; a long-lived process whose
    worker threads come and go (anyio retires idle ones) must not run the
    pool (16) dry: the connections of ended threads are given back."""
    import threading

    with open_store(pg_url) as store:
        for _ in range(40):
            t = threading.Thread(target=store.list_runs)
            t.start()
            t.join()
        done = threading.Event()

        def last() -> None:
            store.list_runs()
            done.set()

        threading.Thread(target=last, daemon=True).start()
        assert done.wait(60), "a new thread found no free connection in the pool"


@pytest.mark.parametrize("with_results", [False, True])
def test_a_claim_whose_answer_was_lost_is_not_claimed_twice(
    pg_url: str, with_results: bool
) -> None:
    """The claim statement commits and its answer is lost: the retry returns
    the jobs that claim took (it once claimed the next ones, and the first
    stayed `running` with nobody running it until its lease failed it)."""
    import psycopg

    from preloop.testing.plans import PlanBuilder

    with open_store(pg_url) as store:
        b = PlanBuilder()
        b.matrix("j", 4)  # a leg's end leaves its unit open: the one-statement path
        run_id = store.submit_run(b.plan())
        results = []
        if with_results:
            first = store.claim_jobs("r", [], limit=1)
            results = [(first[0], "success", None)]
        real = psycopg.Cursor.execute
        lost: list[str] = []

        def lossy(self: psycopg.Cursor, query: object, *a: object, **k: object) -> object:
            out = real(self, query, *a, **k)  # type: ignore[arg-type]
            if "preloop_complete_claim" in str(query) and not lost:
                lost.append(str(query))
                self.connection.close()  # committed (autocommit); the answer is lost
                raise psycopg.OperationalError("the connection was lost")
            return out

        psycopg.Cursor.execute = lossy  # type: ignore[method-assign,assignment]
        try:
            done, leases = store.complete_and_claim(results, "r", [], limit=1)
        finally:
            psycopg.Cursor.execute = real  # type: ignore[method-assign]
        assert lost
        want = "j#1" if with_results else "j#0"
        assert [lease.job_id for lease in leases] == [want]
        jobs = {j.id: j.status for j in store.list_jobs(run_id)}
        running = sorted(k for k, v in jobs.items() if v == "running")
        assert running == [want], jobs  # nothing else was claimed behind the runner's back
        if with_results:
            assert [d.job_id for d in done] == ["j#0"] and jobs["j#0"] == "completed"
