"""`preloop rerun` as a process, on both stores: GitHub's "Re-run failed jobs"
and "Re-run all jobs" on the ended run's own snapshot."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests.run_support import git, make_repo, workflow
from tests.test_run_cli import PRELOOP, _env, preloop, read_fifo

# `build` counts its runs in a file outside the workspace (vars.OUT); `test`
# fails unless the secret is good and shows what it ran on; `report` always runs.
CI = """\
    name: ci
    on: push
    jobs:
      build:
        runs-on: ubuntu-latest
        outputs:
          v: ${{ steps.s.outputs.v }}
        steps:
          - uses: actions/checkout@v4
          - id: s
            run: |
              echo "v=built-$GITHUB_RUN_ATTEMPT" >> "$GITHUB_OUTPUT"
              echo build >> "${{ vars.OUT }}/builds"
      test:
        needs: build
        runs-on: ubuntu-latest
        steps:
          - uses: actions/checkout@v4
          - run: |
              echo "seen: attempt=$GITHUB_RUN_ATTEMPT number=$GITHUB_RUN_NUMBER" \\
                "id=$GITHUB_RUN_ID/${{ github.run_id }}" \\
                "from=${{ needs.build.outputs.v }} data=$(cat data.txt)"
              test "$TOKEN" = good
            env:
              TOKEN: ${{ secrets.TOKEN }}
      report:
        needs: test
        if: always()
        runs-on: ubuntu-latest
        steps:
          - run: echo "report ${{ needs.test.result }}"
    """


@pytest.fixture(params=["lite", "pg"])
def store_args(request: pytest.FixtureRequest) -> list[str]:
    if request.param == "lite":
        return []
    return ["--store", request.getfixturevalue("pg_url")]


def _repo(tmp_path: Path) -> tuple[Path, Path, Path]:
    repo = make_repo(tmp_path / "ws", {"data.txt": "committed\n", **workflow(CI)})
    # The run's snapshot holds this uncommitted edit.
    (repo / "data.txt").write_text("submitted\n")
    out = tmp_path / "out"
    out.mkdir()
    return repo, tmp_path / "state", out


def _jobs(document: dict[str, object]) -> dict[str, object]:
    jobs = document["jobs"]
    assert isinstance(jobs, list)
    return {j["name"]: j["result"] for j in jobs}


def _seen(repo: Path, state: Path, run_id: int, store_args: list[str]) -> str:
    logs = preloop("logs", str(run_id), "test", *store_args, cwd=repo, state=state, check_code=0)
    return next(ln for ln in logs.stdout.splitlines() if ln.startswith("seen:"))


def test_rerun_failed_jobs_on_the_runs_snapshot(tmp_path: Path, store_args: list[str]) -> None:
    repo, state, out = _repo(tmp_path)
    first = preloop(
        "run", "--json", "--secret", "TOKEN=bad", "--var", f"OUT={out}", *store_args,
        cwd=repo, state=state, check_code=1,
    )  # fmt: skip
    run1 = json.loads(first.stdout)
    assert _jobs(run1) == {"build": "success", "test": "failure", "report": "success"}
    # The work tree moves on, and a commit lands: the re-run does not see either.
    (repo / "data.txt").write_text("later\n")
    git(repo, "commit", "-qam", "later")

    again = preloop(
        "rerun", str(run1["run_id"]), "--json", "--secret", "TOKEN=good", *store_args,
        cwd=repo, state=state, check_code=0,
    )  # fmt: skip
    run2 = json.loads(again.stdout)
    assert run2["run_id"] != run1["run_id"]
    assert _jobs(run2) == {"build": "success", "test": "success", "report": "success"}
    # `build` succeeded: kept with its outputs, not run again; the run number stays.
    assert (out / "builds").read_text() == "build\n"
    # `github.run_id` stays the first run's, as GitHub's attempts share it
    first_id = run1["run_id"]
    assert _seen(repo, state, run2["run_id"], store_args) == (
        f"seen: attempt=2 number=1 id={first_id}/{first_id} from=built-1 data=submitted"
    )

    # A kept job's log is the one of the run it ran in.
    kept = preloop(
        "logs", str(run2["run_id"]), "build", *store_args, cwd=repo, state=state, check_code=0
    )
    assert '▶ Run echo "v=built-$GITHUB_RUN_ATTEMPT"' in kept.stdout
    assert f"as it ended in run {run1['run_id']}: its log there" in kept.stderr

    # Re-run all jobs of the re-run: everything runs, the attempt counts on.
    whole = preloop(
        "rerun", str(run2["run_id"]), "--all", "--json", "--secret", "TOKEN=good", *store_args,
        cwd=repo, state=state, check_code=0,
    )  # fmt: skip
    run3 = json.loads(whole.stdout)
    status = preloop("status", "--json", *store_args, cwd=repo, state=state, check_code=0)
    assert [(r["id"], r["rerun_of"]) for r in json.loads(status.stdout)] == [
        (run3["run_id"], run2["run_id"]),
        (run2["run_id"], run1["run_id"]),
        (run1["run_id"], None),
    ]
    assert (out / "builds").read_text() == "build\nbuild\n"
    assert _seen(repo, state, run3["run_id"], store_args) == (
        f"seen: attempt=3 number=1 id={first_id}/{first_id} from=built-3 data=submitted"
    )
    # GitHub re-runs a run's latest attempt only.
    old = preloop("rerun", str(run1["run_id"]), "--all", *store_args, cwd=repo, state=state)
    assert old.returncode == 1, (old.stdout, old.stderr)
    assert f"was re-run already, as run {run2['run_id']}: re-run the latest" in old.stderr


def test_rerun_errors_are_one_line_and_change_nothing(
    tmp_path: Path, store_args: list[str]
) -> None:
    repo, state, out = _repo(tmp_path)
    unknown = preloop("rerun", "7", *store_args, cwd=repo, state=state, check_code=1)
    lines = unknown.stderr.strip().splitlines()
    assert len(lines) == 1 and "no run 7" in lines[0], unknown.stderr

    run1 = json.loads(
        preloop(
            "run", "--json", "--var", f"OUT={out}", *store_args, cwd=repo, state=state,
            check_code=1,
        ).stdout
    )  # fmt: skip
    # The snapshot's cache entry is evicted (nothing references it once the run ended).
    preloop("cache", "prune", "--max-bytes", "1", cwd=repo, state=state, check_code=0)
    gone = preloop("rerun", str(run1["run_id"]), *store_args, cwd=repo, state=state)
    assert gone.returncode == 1, (gone.stdout, gone.stderr)
    assert "no longer in this host's object cache" in gone.stderr
    assert "preloop run" in gone.stderr and "Traceback" not in gone.stderr
    status = preloop("status", "--json", *store_args, cwd=repo, state=state, check_code=0)
    assert [r["id"] for r in json.loads(status.stdout)] == [run1["run_id"]]
    # A run with nothing failed has nothing for a failed-jobs re-run.
    good = json.loads(
        preloop(
            "run", "--json", "--secret", "TOKEN=good", "--var", f"OUT={out}", *store_args,
            cwd=repo, state=state, check_code=0,
        ).stdout
    )  # fmt: skip
    nothing = preloop("rerun", str(good["run_id"]), *store_args, cwd=repo, state=state)
    assert nothing.returncode != 0 and "nothing to re-run (--all" in nothing.stderr


def test_a_run_whose_preloop_run_died_can_be_rerun(tmp_path: Path) -> None:
    """The re-run cancels the dead engine's run first (the recovery every
    start does), instead of refusing it as still running."""
    fifo = tmp_path / "pids.fifo"
    os.mkfifo(fifo)
    hang = f"""\
        on: push
        jobs:
          once:
            runs-on: ubuntu-latest
            steps:
              - run: |
                  if [ "$GITHUB_RUN_ATTEMPT" = 1 ]; then
                    sleep 1000 &
                    echo "$$ $!" > {fifo}
                    wait
                  fi
                  echo "attempt $GITHUB_RUN_ATTEMPT done"
        """
    repo = make_repo(tmp_path / "repo", workflow(hang))
    state = tmp_path / "state"
    first = subprocess.Popen(
        [*PRELOOP, "run", "--json"], cwd=repo, env=_env(state),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        read_fifo(fifo, [first])
        first.kill()  # a crash: nothing of preloop's cleanup runs
    finally:
        first.kill()
        first.wait()
    again = preloop("rerun", "1", "--json", cwd=repo, state=state, check_code=0)
    assert "run 1 was left unfinished" in again.stderr
    assert _jobs(json.loads(again.stdout)) == {"once": "success"}
