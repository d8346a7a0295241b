"""Artifacts and caches between jobs on different `preloop runner`s (PostgreSQL).

Each runner is its own process with its own state directory, started inside
bubblewrap with a tmpfs over the submitter's state directory and over the
repository: it cannot see the submitter's files, and gets the snapshot, the
artifacts, the caches and the submitter gets the logs through the store
alone. GitHub's own npm clients (@actions/artifact, @actions/cache) upload on
runner A and download on runner B, through each runner's own service over
the store.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.run_support import make_repo, workflow
from tests.test_run_cli import PRELOOP, _env, read_fifo, spawn

from preloop.control import open_store

ROOT = Path(__file__).resolve().parents[1]
NODE_MODULES = ROOT / "node_modules"
JS = ROOT / "tests" / "js" / "services"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is missing")


@pytest.fixture(autouse=True)
def _npm_clients() -> None:
    if not (NODE_MODULES / "@actions" / "artifact").is_dir():
        pytest.fail("GitHub's npm clients are missing: run `npm ci` in the project root")


def _hidden(submitter: Path) -> list[str]:
    """bwrap arguments hiding `submitter`'s state directory and the
    repository beside it (`../repo`) under a tmpfs each."""
    args = ["--dev-bind", "/", "/", "--tmpfs", str(submitter)]
    repo = submitter.parent / "repo"
    if repo.is_dir():
        args += ["--tmpfs", str(repo)]
    return args


def _runner(
    url: str, submitter: Path, state: Path, name: str, label: str, *flags: str, **env: str
) -> subprocess.Popen[str]:
    argv = [*PRELOOP, "runner", "--store", url, "--name", name, "--labels", label, *flags]
    return spawn(
        ["bwrap", *_hidden(submitter), "--die-with-parent", "--", *argv], _env(state, **env)
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


DIGEST = "find . -type f | sort | xargs sha256sum | sha256sum | cut -c1-64"

PASS_ON = f"""
on: push
env:
  NODE_PATH: {NODE_MODULES}
  JS: {JS}
jobs:
  up:
    runs-on: [self-hosted, a]
    outputs:
      tree: ${{{{ steps.up.outputs.tree }}}}
      deps: ${{{{ steps.up.outputs.deps }}}}
    steps:
      - id: up
        run: |
          test ! -e @MARKER@  # the submitter's state directory is hidden
          mkdir -p made/sub deps
          head -c 3000000 /dev/urandom > made/sub/blob.bin
          echo "made on $RUNNER_NAME" > made/who.txt
          node $JS/artifacts_up.cjs dir:made:made forged
          echo "tree=$(cd made && {DIGEST})" >> "$GITHUB_OUTPUT"
          head -c 500000 /dev/urandom > deps/noise.bin
          node $JS/cache.cjs "save:deps-${{{{ github.run_id }}}}:deps"
          echo "deps=$(cd deps && {DIGEST})" >> "$GITHUB_OUTPUT"
  down:
    needs: up
    runs-on: [self-hosted, b]
    steps:
      - run: |
          test ! -e @MARKER@
          node $JS/artifacts_down.cjs made got
          test "$(cd got/made && {DIGEST})" = "${{{{ needs.up.outputs.tree }}}}"
          echo "got $(cat got/made/who.txt) on $RUNNER_NAME"
          node $JS/cache.cjs "restore:nothing,deps-:deps"
          test "$(cd deps && {DIGEST})" = "${{{{ needs.up.outputs.deps }}}}"
          node $JS/artifacts_up.cjs dir:made:got/made || echo "same name again: refused"
"""


def test_artifacts_and_caches_pass_between_jobs_on_different_runners(
    tmp_path: Path, pg_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    state = tmp_path / "submitter"
    state.mkdir()
    marker = state / "only-the-submitter-sees-this"
    marker.write_text("x")
    repo = make_repo(tmp_path / "repo", workflow(PASS_ON.replace("@MARKER@", str(marker))))
    procs.append(_runner(pg_url, state, tmp_path / "ra", "ra", "a", "--once"))
    procs.append(_runner(pg_url, state, tmp_path / "rb", "rb", "b", "--once"))
    run = spawn([*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"], _env(state), cwd=repo)
    procs.append(run)
    out, err = run.communicate(timeout=300)
    jobs_logs = {p.name: p.read_text() for p in tmp_path.glob("r[ab]/logs/*/*.log")}
    assert run.returncode == 0, (out, err, jobs_logs)
    for p in procs[:2]:  # each ran its one job (--once) and exited
        rout, rerr = p.communicate(timeout=120)
        assert p.returncode == 0 and "stopped after 1 job" in rout, (rout, rerr)
        assert "Traceback" not in rerr, rerr
    doc = json.loads(out)
    assert {j["id"]: j["result"] for j in doc["jobs"]} == {"up": "success", "down": "success"}
    run_id = doc["run_id"]

    # the job logs are on each runner's own disk
    def job_log(runner_state: Path, job: str) -> str:
        found = list((runner_state / "logs").rglob(f"{job}.log"))
        assert found, list((runner_state / "logs").rglob("*"))
        return found[0].read_text()

    up, down = job_log(tmp_path / "ra", "up"), job_log(tmp_path / "rb", "down")
    assert "uploaded made" in up and "forged: refused:" in up and "(401)" in up
    assert "got made on ra on rb" in down
    assert "restore nothing,deps- -> deps-" in down
    assert "same name again: refused" in down and "(409) Conflict" in down

    # ... and the submitter reads them from the store, from any directory
    logs = subprocess.run(
        [*PRELOOP, "logs", str(run_id), "--store", pg_url],
        env=_env(state),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert logs.returncode == 0, logs.stderr
    assert "[down] got made on ra on rb" in logs.stdout
    assert "[up] uploaded made" in logs.stdout
    assert not list((state / "logs").rglob("*.log"))  # none ran on the submitter

    # the submitter reads them from the store (nothing went to its disk)
    assert not (state / "artifacts").exists()
    listed = subprocess.run(
        [*PRELOOP, "artifacts", str(run_id), "--store", pg_url, "--json"],
        env=_env(state),
        capture_output=True,
        text=True,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    [made] = json.loads(listed.stdout)["artifacts"]
    assert (made["name"], made["job"]) == ("made", "up")
    got = tmp_path / "downloaded"
    fetched = subprocess.run(
        [*PRELOOP, "artifacts", str(run_id), "--download", "made", str(got), "--store", pg_url],
        env=_env(state),
        capture_output=True,
        text=True,
        check=False,
    )
    assert fetched.returncode == 0, fetched.stderr
    assert (got / "who.txt").read_text() == "made on ra\n"
    assert (got / "sub" / "blob.bin").stat().st_size == 3000000
    status = subprocess.run(
        [*PRELOOP, "cache", "status", "--store", pg_url, "--json"],
        env=_env(state),
        capture_output=True,
        text=True,
        check=False,
    )
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)["actions_cache"]
    assert [e["key"] for e in doc["entries"]] == [f"deps-{run_id}"]
    assert doc["cache_dir"] == "the PostgreSQL store"
    # the runners left nothing staged or materialised behind
    for r in ("ra", "rb"):
        assert not any((tmp_path / r / "service-uploads").rglob("*.data"))
        assert not any((tmp_path / r / "service-blobs").rglob("*"))


# `down`'s runs-on comes from `up`'s outputs (a deferred matrix): the local
# runners of `preloop run` take every label the plan names, but not this one,
# so `down` can only go to the remote runner, whatever the timing.
MIXED = f"""
on: push
env:
  NODE_PATH: {NODE_MODULES}
  JS: {JS}
jobs:
  up:
    runs-on: [self-hosted, on-the-submitter]
    outputs:
      where: ${{{{ steps.up.outputs.where }}}}
      tree: ${{{{ steps.up.outputs.tree }}}}
    steps:
      - id: up
        run: |
          mkdir -p made deps
          head -c 1000000 /dev/urandom > made/blob.bin
          echo "made on $RUNNER_NAME" > made/who.txt
          node $JS/artifacts_up.cjs dir:made:made
          echo "tree=$(cd made && {DIGEST})" >> "$GITHUB_OUTPUT"
          echo "deps of the submitter" > deps/v
          node $JS/cache.cjs "save:mixed-${{{{ github.run_id }}}}:deps"
          echo 'where=["b"]' >> "$GITHUB_OUTPUT"
  down:
    needs: up
    strategy:
      matrix:
        where: ${{{{ fromJSON(needs.up.outputs.where) }}}}
    runs-on: [self-hosted, "${{{{ matrix.where }}}}"]
    steps:
      - run: |
          node $JS/artifacts_down.cjs made got
          test "$(cd got/made && {DIGEST})" = "${{{{ needs.up.outputs.tree }}}}"
          echo "got $(cat got/made/who.txt) on $RUNNER_NAME"
          node $JS/cache.cjs "restore:mixed-${{{{ github.run_id }}}}:deps"
          echo "cached: $(cat deps/v)"
"""


def test_a_local_job_and_a_remote_job_of_one_run_share_artifacts(
    tmp_path: Path, pg_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    """`preloop run -j 1` on PostgreSQL keeps its local job's artifact and
    cache in the store, where a remote runner's job of the run finds them."""
    state = tmp_path / "submitter"
    repo = make_repo(tmp_path / "repo", workflow(MIXED))
    runner = _runner(pg_url, state, tmp_path / "rb", "rb", "b", "--once")
    procs.append(runner)
    run = spawn([*PRELOOP, "run", "-j", "1", "--store", pg_url, "--json"], _env(state), cwd=repo)
    procs.append(run)
    out, err = run.communicate(timeout=300)
    logs = {p.name: p.read_text() for p in tmp_path.glob("rb/logs/*/*.log")}
    assert run.returncode == 0, (out, err, logs)
    rout, rerr = runner.communicate(timeout=120)
    assert runner.returncode == 0 and "stopped after 1 job" in rout, (rout, rerr)
    [down] = logs.values()
    assert "got made on " in down and " on rb" in down and "made on rb" not in down
    assert "cached: deps of the submitter" in down
    assert not (state / "artifacts").exists() and not (state / "actions-cache").exists()


# A client that dies mid-upload: one block staged, never committed nor finalized.
STAGE_ONE_BLOCK = """
import json, os, urllib.request
url, token = os.environ["ACTIONS_RESULTS_URL"], os.environ["ACTIONS_RUNTIME_TOKEN"]
req = urllib.request.Request(
    url + "twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact",
    data=json.dumps({"name": "half", "version": 4}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + token},
)
signed = json.load(urllib.request.urlopen(req))["signedUploadUrl"]
block = signed + "&comp=block&blockid=YjA="
put = urllib.request.Request(block, data=b"x" * 100000, method="PUT")
assert urllib.request.urlopen(put).status == 201
"""

STAGE_AND_HANG = """
on: push
jobs:
  up:
    runs-on: [self-hosted, a]
    steps:
      - run: |
          python3 {script}
          echo staged > {fifo}
          sleep 1000
"""


def test_a_runner_killed_mid_upload_leaves_nothing_visible(
    tmp_path: Path, pg_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    state = tmp_path / "submitter"
    fifo = tmp_path / "staged.fifo"
    os.mkfifo(fifo)
    script = tmp_path / "stage.py"
    script.write_text(STAGE_ONE_BLOCK)
    repo = make_repo(tmp_path / "repo", workflow(STAGE_AND_HANG.format(script=script, fifo=fifo)))
    # the lease is the claimer's: a short one, so the dead runner's job fails soon
    runner = _runner(pg_url, state, tmp_path / "ra", "ra", "a", PRELOOP_LEASE_SECONDS="3")
    procs.append(runner)
    run = spawn(
        [*PRELOOP, "run", "-j", "0", "--store", pg_url, "--json"],
        _env(state, PRELOOP_LEASE_SECONDS="3"),
        cwd=repo,
    )
    procs.append(run)
    assert read_fifo(fifo, [runner, run]) == "staged"
    # blocks are staged on the runner's disk, nothing is in the store yet
    assert list((tmp_path / "ra" / "service-uploads").rglob("*"))
    os.kill(runner.pid, signal.SIGKILL)  # bwrap, and with it the runner
    runner.wait()
    out, err = run.communicate(timeout=120)
    doc = json.loads(out)
    assert doc["jobs"][0]["result"] == "failure", (out, err)
    listed = subprocess.run(
        [*PRELOOP, "artifacts", str(doc["run_id"]), "--store", pg_url, "--json"],
        env=_env(state),
        capture_output=True,
        text=True,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["artifacts"] == []
    with open_store(pg_url) as store:
        rows = store.backend.transaction(
            "t", lambda tx: tx.execute("SELECT kind FROM preloop_blobs")
        )
    assert [r["kind"] for r in rows if r["kind"] == "artifact"] == []
