"""Snapshots through the store (`PRELOOP_SNAPSHOT_TRANSPORT=store`): bundles
published by `preloop run`, fetched by runners that do not see the
submitter's state directory, held while their run lasts, evicted at the cap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from tests.run_support import make_repo, workflow
from tests.test_run_cli import PRELOOP, _env, read_fifo, spawn

from preloop.control import Store, open_store
from preloop.runner.checkout import CheckoutTemplates, SnapshotLocation
from preloop.snapshot import Snapshot, capture_workspace
from preloop.snapshot.bundles import BUNDLE_KIND, HOLD_GRACE, BundleRow, SnapshotBundles
from preloop.snapshot.holders import release_run_repository
from preloop.snapshot.layout import cache_repository, run_repository
from preloop.snapshot.transport import FetchError, fetch_snapshot, publish_snapshot
from preloop.testing.control_fixtures import store  # noqa: F401  (fixture)
from preloop.testing.plans import PlanBuilder

_BWRAP = shutil.which("bwrap")
_FILES = {
    f"src/module{i:03}.txt": "".join(f"line {j} of {i}\n" for j in range(60)) for i in range(150)
}


def _repo(root: Path, workflow_text: str = "") -> Path:
    files = dict(_FILES)
    if workflow_text:
        files.update(workflow(workflow_text))
    return make_repo(root, files)


def _edit_one_line(repo: Path) -> None:
    path = repo / "src/module007.txt"
    path.write_text(path.read_text().replace("line 3 of 7\n", "line 3 of 7, edited\n"))


def _capture(state: Path, repo: Path, run_key: str) -> Snapshot:
    return anyio.run(capture_workspace, state, repo, run_key)


def _bundles(db: Store) -> list[dict[str, object]]:
    """Every stored bundle, oldest first, with its blob's size."""
    return db.backend.transaction(
        "test",
        lambda tx: tx.execute(
            "SELECT u.digest, u.tip, u.parent, u.depth, b.size FROM preloop_bundles u "
            "JOIN preloop_blobs b ON b.digest = u.digest ORDER BY u.created_at"
        ),
    )


def _run_pins(db: Store) -> int:
    row = db.backend.transaction(
        "test",
        lambda tx: tx.one("SELECT COUNT(*) AS n FROM preloop_blob_pins WHERE holder LIKE 'run:%'"),
    )
    assert row is not None
    return int(row["n"])


# ------------------------------------------------------------ publish / fetch


def test_an_edit_uploads_a_thin_bundle_and_a_runner_fetches_the_chain(
    tmp_path: Path, pg_url: str
) -> None:
    repo = _repo(tmp_path / "repo")
    submitter = tmp_path / "submitter"
    runner_state = tmp_path / "runner"
    # One event loop for the whole test, as in `preloop run`.
    with open_store(pg_url) as db, start_blocking_portal() as portal:
        bundles = SnapshotBundles(db)
        first = _capture(submitter, repo, "run-a")
        one = portal.call(
            publish_snapshot, bundles, first.repository, first.cache_key, first.commit, "run-a"
        )
        assert one.uploaded is not None and len(one.chain) == 1
        _edit_one_line(repo)
        second = _capture(submitter, repo, "run-b")
        two = portal.call(
            publish_snapshot, bundles, second.repository, second.cache_key, second.commit, "run-b"
        )
        assert two.uploaded is not None
        assert two.chain == (*one.chain, two.uploaded.digest)
        # The edit's bundle: one blob and the trees above it, not the snapshot.
        assert two.uploaded.size <= 4096 < one.uploaded.size
        rows = _bundles(db)
        assert [r["parent"] for r in rows] == [None, one.chain[0]]
        assert rows[-1]["size"] == two.uploaded.size
        assert _run_pins(db) == 3  # run-a: 1, run-b: 2

        # A runner that sees nothing of the submitter: the location's path is not here.
        location = SnapshotLocation(
            str(tmp_path / "elsewhere"), "snapshot", second.commit, "store",
            second.cache_key, two.chain,
        )  # fmt: skip
        templates = CheckoutTemplates(runner_state / "work", store=db, state_dir=runner_state)
        dest = tmp_path / "job" / "workspace"
        dest.parent.mkdir()
        portal.call(templates.checkout, location, dest, "run 2 job 'a'")
        assert "line 3 of 7, edited\n" in (dest / "src/module007.txt").read_text()
        assert (cache_repository(runner_state, second.cache_key)).is_dir()
        templates.close()
        assert not list((runner_state / "snapshots").glob("fetched-*"))

        # A third run after another edit: the runner fetches only the new bundle.
        (repo / "src/module008.txt").write_text("replaced\n")
        third = _capture(submitter, repo, "run-c")
        three = portal.call(
            publish_snapshot, bundles, third.repository, third.cache_key, third.commit, "run-c"
        )
        assert three.chain[:2] == two.chain and len(three.chain) == 3
        name = portal.call(
            fetch_snapshot, bundles, runner_state, third.cache_key, three.chain, third.commit, "x"
        )
        shown = subprocess.run(
            ["git", "--git-dir", run_repository(runner_state, name),
             "show", "snapshot:src/module008.txt"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert shown.stdout == "replaced\n"
        release_run_repository(runner_state, name)

        for key in ("run-a", "run-b", "run-c"):
            bundles.release(key)
        assert _run_pins(db) == 0


def test_a_bundle_gone_from_the_store_is_a_one_line_error_naming_it(
    tmp_path: Path, pg_url: str
) -> None:
    with open_store(pg_url) as db, pytest.raises(FetchError) as caught:
        anyio.run(
            fetch_snapshot,
            SnapshotBundles(db),
            tmp_path / "runner",
            "repo-0123456789abcdef",
            ("f" * 64,),
            "a" * 40,
            "run 7 job 'build'",
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("run 7 job 'build': snapshot bundle ffffffffffff")
    assert "resubmit the run with `preloop run`" in message


# -------------------------------------------------------------------- eviction


def _put(bundles: SnapshotBundles, name: str, parent: str | None, depth: int, size: int) -> str:
    info = bundles.blobs.put_bytes(name.encode() * size, BUNDLE_KIND)
    row = BundleRow(info.digest, "repo-0123456789abcdef", name * 40, parent, depth, time.time())
    # Recorded under a throwaway hold, released at once: the bundle is unheld.
    bundles.hold("setup", row.repo_key, [info.digest], row)
    bundles.release("setup")
    return info.digest


def test_eviction_at_the_cap_never_removes_a_held_chain_nor_leaves_orphans(
    store: Store,  # noqa: F811
) -> None:
    bundles = SnapshotBundles(store)
    # An old unheld chain d <- e, then the chain a <- b <- c a run holds, and
    # f built on b (unheld): oldest first.
    d = _put(bundles, "d", None, 0, 1000)
    e = _put(bundles, "e", d, 1, 1000)
    a = _put(bundles, "a", None, 0, 1000)
    b = _put(bundles, "b", a, 1, 1000)
    c = _put(bundles, "c", b, 2, 1000)
    f = _put(bundles, "f", b, 2, 1000)
    bundles.hold("run-1", "repo-0123456789abcdef", [a, b, c])

    removed = bundles.evict(1)  # a cap nothing fits under
    assert removed == [e, d, f]  # dependents before what they build on
    assert {r["digest"] for r in _bundles(store)} == {a, b, c}
    for digest in (a, b, c):
        assert bundles.blobs.has(digest)

    assert bundles.release("run-1") == 3
    assert bundles.evict(1) == [c, b, a]
    assert _bundles(store) == [] and bundles.blobs.total_bytes(BUNDLE_KIND) == 0


def test_the_reaper_releases_holds_whose_runs_ended_without_it(
    store: Store,  # noqa: F811
) -> None:
    bundles = SnapshotBundles(store)
    digest = _put(bundles, "x", None, 0, 10)
    plan = PlanBuilder()
    plan.job("a")
    store.submit_run(plan.plan(), github={"preloop_engine": {"run_key": "live"}})
    bundles.hold("live", "repo-0123456789abcdef", [digest])
    bundles.hold("dead", "repo-0123456789abcdef", [digest])
    assert bundles.release_ended() == []  # both younger than the grace
    later = time.time() + HOLD_GRACE + 1
    assert bundles.release_ended(now=later) == ["dead"]  # "live" has an unfinished run
    assert bundles.blobs.holders(digest) == ["run:live"]


# ------------------------------------------------------------ `preloop` itself


_CHECK = """
on: push
jobs:
  check:
    runs-on: [self-hosted, remote]
    steps:
      - run: grep -qx "line 3 of 7" src/module007.txt
"""


def _bwrapped_runner(pg_url: str, hidden: Path, state: Path) -> subprocess.Popen[str]:
    """A runner whose filesystem has an empty tmpfs over `hidden` (the
    submitter's state directory) and its own state directory."""
    assert _BWRAP is not None
    return subprocess.Popen(
        [
            _BWRAP, "--dev-bind", "/", "/", "--tmpfs", str(hidden), "--die-with-parent",
            *PRELOOP, "runner", "--store", pg_url, "--labels", "remote", "--once",
        ],
        env=_env(state),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _run_remote(repo: Path, state: Path, pg_url: str, runner_state: Path) -> str:
    run = spawn([*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"], _env(state), cwd=repo)
    runner = _bwrapped_runner(pg_url, state, runner_state)
    try:
        rout, rerr = runner.communicate(timeout=180)
        assert runner.returncode == 0, rerr
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, (out, err, rout, rerr)
        assert json.loads(out)["conclusion"] == "success"
        return rout
    finally:
        for proc in (run, runner):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.skipif(_BWRAP is None, reason="bubblewrap (bwrap) is not installed")
def test_a_runner_that_cannot_see_the_submitter_runs_its_jobs_from_the_store(
    tmp_path: Path, pg_url: str
) -> None:
    repo = _repo(tmp_path / "repo", _CHECK)
    state = tmp_path / "submitter-state"
    runner_state = tmp_path / "runner-state"
    _run_remote(repo, state, pg_url, runner_state)
    assert list((runner_state / "snapshot-object-cache").glob("*.git"))
    # One line edited, and the job checks that the runner sees the edit.
    _edit_one_line(repo)
    ci = repo / ".github/workflows/ci.yml"
    ci.write_text(ci.read_text().replace('"line 3 of 7"', '"line 3 of 7, edited"'))
    _run_remote(repo, state, pg_url, runner_state)
    with open_store(pg_url) as db:
        rows = _bundles(db)
        assert len(rows) == 2 and rows[1]["parent"] == rows[0]["digest"]
        assert int(str(rows[1]["size"])) <= 4096  # the one-line edit (and the workflow's)
        assert _run_pins(db) == 0  # both runs released their chains
    # The runners removed the run repositories they fetched.
    assert not list((runner_state / "snapshots").glob("fetched-*"))


def test_path_transport_still_works_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    repo = _repo(tmp_path / "repo", _CHECK.replace("[self-hosted, remote]", "ubuntu-latest"))
    state = tmp_path / "state"
    run = spawn(
        [*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"],
        _env(state, PRELOOP_SNAPSHOT_TRANSPORT="path"),
        cwd=repo,
    )
    try:
        runner = subprocess.run(
            [*PRELOOP, "runner", "--store", pg_url, "--once"],
            env=_env(tmp_path / "runner"),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert runner.returncode == 0, runner.stderr
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, (out, err)
        assert json.loads(out)["conclusion"] == "success"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    with open_store(pg_url) as db:
        assert _bundles(db) == []
        context = db.run_context(db.list_runs()[0].id)
        assert context["github"]["preloop_snapshot"]["transport"] == "path"


def test_the_lite_store_keeps_paths_and_refuses_the_store_transport(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", _CHECK.replace("[self-hosted, remote]", "ubuntu-latest"))
    state = tmp_path / "state"
    ok = subprocess.run(
        [*PRELOOP, "run", "-j", "1", "--json"],
        cwd=repo, env=_env(state), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    with open_store(f"sqlite:///{state / 'preloop.db'}") as db:
        assert _bundles(db) == []
        context = db.run_context(db.list_runs()[0].id)
        assert context["github"]["preloop_snapshot"]["transport"] == "path"
    refused = subprocess.run(
        [*PRELOOP, "run", "-j", "1"],
        cwd=repo,
        env=_env(state, PRELOOP_SNAPSHOT_TRANSPORT="store"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preloop: error: PRELOOP_SNAPSHOT_TRANSPORT")
    assert "Traceback" not in refused.stderr
    assert not (state / "snapshots").exists() or not [
        p for p in (state / "snapshots").iterdir() if not p.name.startswith(".")
    ]


def test_a_bad_transport_value_is_a_one_line_error(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", _CHECK)
    proc = subprocess.run(
        [*PRELOOP, "run"],
        cwd=repo,
        env=_env(tmp_path / "state", PRELOOP_SNAPSHOT_TRANSPORT="nfs"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "PRELOOP_SNAPSHOT_TRANSPORT" in proc.stderr


def test_a_killed_preloop_run_leaves_a_hold_the_next_run_releases(
    tmp_path: Path, pg_url: str
) -> None:
    fifo = tmp_path / "started.fifo"
    os.mkfifo(fifo)
    text = (
        "on: push\njobs:\n  hang:\n    runs-on: ubuntu-latest\n    steps:\n"
        f"      - run: |\n          echo started > {fifo}\n          sleep 1000\n"
    )
    repo = _repo(tmp_path / "repo", text)
    state = tmp_path / "state"
    run = subprocess.Popen(
        [*PRELOOP, "run", "-j", "1", "--store", pg_url],
        cwd=repo,
        env=_env(state),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert read_fifo(fifo, [run]) == "started"
        run.kill()
        run.wait()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    with open_store(pg_url) as db:
        assert _run_pins(db) == 1  # its chain (one full bundle) is still held
    (repo / ".github/workflows/ci.yml").write_text(
        "on: push\njobs:\n  ok:\n    runs-on: ubuntu-latest\n    steps:\n      - run: 'true'\n"
    )
    again = subprocess.run(
        [*PRELOOP, "run", "-j", "1", "--store", pg_url],
        cwd=repo, env=_env(state), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "its processes were killed and the run cancelled" in again.stderr
    with open_store(pg_url) as db:
        assert _run_pins(db) == 0  # the dead run's hold and this run's are released
        holds = db.backend.transaction(
            "test", lambda tx: tx.execute("SELECT run_key FROM preloop_bundle_holds")
        )
        assert holds == []
