"""`preloop.engine` end to end on generated repositories, lite and PostgreSQL."""

from __future__ import annotations

import os
import select
import shutil
import textwrap
from pathlib import Path

import anyio
import pytest
from tests.run_support import Harness, git, make_repo, results, run_engine, workflow

from preloop.control import Lease, open_store
from preloop.engine import Engine, NothingTriggered, RunRequest
from preloop.runner.logs import job_ids_with_logs, log_path
from preloop.workflow import WorkflowError, load_workflow, plan

pytest_plugins = ["preloop.testing.control_fixtures"]


def test_needs_if_always_failure(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                steps:
                  - run: echo a-ran
              b:
                needs: a
                runs-on: ubuntu-latest
                steps:
                  - run: exit 1
              c:
                needs: b
                runs-on: ubuntu-latest
                steps:
                  - run: echo c-should-not-run
              on-failure:
                needs: b
                if: failure()
                runs-on: ubuntu-latest
                steps:
                  - run: echo on-failure-ran
              always:
                needs: [a, c]
                if: always()
                runs-on: ubuntu-latest
                steps:
                  - run: echo "always c=${{ needs.c.result }}"
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {
        "a": "success",
        "b": "failure",
        "c": "skipped",
        "on-failure": "success",
        "always": "success",
    }
    assert outcome.conclusion == "failure" and not outcome.ok
    assert "always c=skipped" in h.lines["always"]
    assert "c" not in h.started


def test_matrix_max_parallel_and_fail_fast(tmp_path: Path, store_url: str) -> None:
    counter = tmp_path / "running"
    counter.mkdir()
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            f"""\
            on: push
            jobs:
              capped:
                runs-on: ubuntu-latest
                strategy:
                  max-parallel: 1
                  matrix:
                    n: [1, 2, 3]
                steps:
                  - run: |
                      mkdir {counter}/${{{{ matrix.n }}}}
                      echo "concurrent=$(ls {counter} | wc -l)"
                      rmdir {counter}/${{{{ matrix.n }}}}
              ff:
                needs: capped
                runs-on: ubuntu-latest
                strategy:
                  max-parallel: 1
                  matrix:
                    n: [1, 2, 3]
                steps:
                  - run: exit ${{{{ matrix.n == 1 && 1 || 0 }}}}
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state", local_runners=3)
    r = results(outcome)
    assert [r["capped#0"], r["capped#1"], r["capped#2"]] == ["success"] * 3
    for leg in ("capped#0", "capped#1", "capped#2"):
        assert "concurrent=1" in h.lines[leg]
    assert r["ff#0"] == "failure"
    assert r["ff#1"] == r["ff#2"] == "cancelled"
    assert "ff#1" not in h.started and "ff#2" not in h.started


def test_outputs_between_jobs_and_job_continue_on_error(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              produce:
                runs-on: ubuntu-latest
                outputs:
                  value: ${{ steps.s.outputs.v }}
                steps:
                  - id: s
                    run: echo "v=from-produce" >> "$GITHUB_OUTPUT"
              flaky:
                runs-on: ubuntu-latest
                continue-on-error: true
                steps:
                  - run: exit 1
              consume:
                needs: [produce, flaky]
                runs-on: ubuntu-latest
                steps:
                  - run: echo "got ${{ needs.produce.outputs.value }} f=${{ needs.flaky.result }}"
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    assert r == {"produce": "success", "flaky": "failure", "consume": "success"}
    assert outcome.conclusion == "success"
    produce = next(j for j in outcome.jobs if j.id == "produce")
    assert produce.outputs == {"value": "from-produce"}
    # GitHub reports a continue-on-error job as a success to its dependents.
    assert "got from-produce f=success" in h.lines["consume"]


def test_reusable_workflow_with_outputs_and_composite_action(
    tmp_path: Path, store_url: str
) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            ".github/workflows/ci.yml": """\
                on: push
                jobs:
                  call:
                    uses: ./.github/workflows/reusable.yml
                    with:
                      who: world
                  after:
                    needs: call
                    runs-on: ubuntu-latest
                    steps:
                      - uses: actions/checkout@v4
                      - id: act
                        uses: ./.github/actions/shout
                        with:
                          text: ${{ needs.call.outputs.greeting }}
                      - run: echo "final ${{ steps.act.outputs.loud }}"
                """,
            ".github/workflows/reusable.yml": """\
                on:
                  workflow_call:
                    inputs:
                      who:
                        type: string
                        required: true
                    outputs:
                      greeting:
                        value: ${{ jobs.inner.outputs.g }}
                jobs:
                  inner:
                    runs-on: ubuntu-latest
                    outputs:
                      g: ${{ steps.x.outputs.g }}
                    steps:
                      - id: x
                        run: echo "g=hello ${{ inputs.who }}" >> "$GITHUB_OUTPUT"
                """,
            ".github/actions/shout/action.yml": """\
                inputs:
                  text:
                    required: true
                outputs:
                  loud:
                    value: ${{ steps.up.outputs.loud }}
                runs:
                  using: composite
                  steps:
                    - id: up
                      shell: bash
                      run: echo "loud=$(echo '${{ inputs.text }}' | tr a-z A-Z)" >> $GITHUB_OUTPUT
                """,
        },
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    assert r["call/inner"] == "success" and r["call"] == "success" and r["after"] == "success"
    call = next(j for j in outcome.jobs if j.id == "call")
    assert call.outputs == {"greeting": "hello world"}
    assert "final HELLO WORLD" in h.lines["after"]


def test_deferred_matrix_from_needs(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              setup:
                runs-on: ubuntu-latest
                outputs:
                  matrix: ${{ steps.m.outputs.matrix }}
                steps:
                  - id: m
                    run: echo 'matrix={"v":["x","y"]}' >> "$GITHUB_OUTPUT"
              legs:
                needs: setup
                runs-on: ubuntu-latest
                strategy:
                  matrix: ${{ fromJSON(needs.setup.outputs.matrix) }}
                steps:
                  - run: echo "leg ${{ matrix.v }}"
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    assert r["legs#0"] == r["legs#1"] == "success", r
    assert "leg x" in h.lines["legs#0"] and "leg y" in h.lines["legs#1"]
    assert outcome.conclusion == "success"


def test_checkout_of_the_runs_repository_after_another_replaced_the_workspace(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`repository: acme/tools` without `path:` replaces the workspace's
    files; a later checkout of the run's own repository (at the root or into
    `path:`) checks the snapshot out again, as GitHub's fetches it, rather
    than calling the other repository's checkout the run's."""
    tools = make_repo(tmp_path / "tools-src", {"TOOL": "t\n"})
    mirrors = tmp_path / "mirrors"
    (mirrors / "acme").mkdir(parents=True)
    git(tmp_path, "clone", "-q", "--bare", str(tools), str(mirrors / "acme" / "tools.git"))
    repo = make_repo(
        tmp_path / "widget",
        {
            **workflow(
                """\
                on: push
                jobs:
                  swap:
                    runs-on: ubuntu-latest
                    steps:
                      - uses: actions/checkout@v4
                        with: {repository: acme/tools}
                      - run: echo "other $(ls)"
                      - uses: actions/checkout@v4
                        with: {path: own}
                      - run: echo "path $(cat own/hello.txt) $(ls own | tr '\\n' ' ')"
                      - uses: actions/checkout@v4
                      - run: echo "root $(cat hello.txt) $(test -e TOOL || echo no-tool)"
                """
            ),
            "hello.txt": "hi\n",
        },
    )
    git(repo, "remote", "add", "origin", "https://github.com/acme/widget.git")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{mirrors}")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    lines = h.lines["swap"]
    assert "other TOOL" in lines, lines
    assert "path hi hello.txt" in " ".join(lines), lines
    assert "root hi no-tool" in lines, lines


def test_checkout_submodules_of_the_runs_repository(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submodules: true|recursive` checks the submodules out at the commits
    the snapshot records, as GitHub's checkout does (they were left empty):
    a relative URL from the repository's own place under
    PRELOOP_ACTIONS_URL, `https://github.com/o/n.git` from `<base>/o/n`;
    `true` leaves a submodule's own submodules empty, no input leaves them
    all empty, and a commit its URL does not have is a one-line error."""
    mirrors = tmp_path / "mirrors"
    (mirrors / "acme").mkdir(parents=True)
    deep = make_repo(tmp_path / "deep-src", {"deep.txt": "deep-file\n"})
    git(tmp_path, "clone", "-q", "--bare", str(deep), str(mirrors / "acme" / "deep"))
    lib = make_repo(tmp_path / "lib-src", {"lib.txt": "lib-file\n"})
    git(lib, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(deep), "deep")
    git(
        lib, "config", "-f", ".gitmodules", "submodule.deep.url", "https://github.com/acme/deep.git"
    )
    git(lib, "commit", "-q", "-am", "deep")
    git(tmp_path, "clone", "-q", "--bare", str(lib), str(mirrors / "acme" / "lib"))
    show = 'echo "lib=$(cat vendor/lib/lib.txt) deep=$(cat vendor/lib/deep/deep.txt)" 2>/dev/null'
    repo = make_repo(
        tmp_path / "widget",
        workflow(
            f"""\
            on: push
            jobs:
              recursive:
                runs-on: ubuntu-latest
                steps:
                  - uses: actions/checkout@v4
                    with: {{submodules: recursive}}
                  - run: {show}
              top:
                runs-on: ubuntu-latest
                steps:
                  - uses: actions/checkout@v4
                    with: {{submodules: true, path: copy}}
                  - run: {show}
                    working-directory: copy
              none:
                runs-on: ubuntu-latest
                steps:
                  - uses: actions/checkout@v4
                  - run: {show}
            """
        ),
    )
    git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "vendor/lib")
    git(repo, "config", "-f", ".gitmodules", "submodule.vendor/lib.url", "../lib.git")
    git(repo, "commit", "-q", "-am", "lib")
    git(repo, "remote", "add", "origin", "https://github.com/acme/widget.git")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{mirrors}")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", "\n".join(h.all_text().splitlines())
    assert "lib=lib-file deep=deep-file" in h.lines["recursive"], h.lines["recursive"]
    assert "lib=lib-file deep=" in h.lines["top"], h.lines["top"]
    assert "lib= deep=" in h.lines["none"], h.lines["none"]
    # A submodule commit that was never pushed: the step fails, saying why.
    sub = repo / "vendor" / "lib"
    (sub / "lib.txt").write_text("local only\n")
    git(sub, "commit", "-q", "-am", "unpushed")
    git(repo, "commit", "-q", "-am", "bump lib")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "failure"
    text = "\n".join(h.lines["recursive"])
    assert "actions/checkout: submodules could not be checked out:" in text, text
    assert "Traceback" not in h.all_text()


def test_dirty_tree_visible_and_source_untouched(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            **workflow(
                """\
                on: push
                jobs:
                  look:
                    runs-on: ubuntu-latest
                    steps:
                      - run: |
                          cat tracked.txt untracked.txt
                          test ! -e deleted.txt && echo deleted-gone
                          echo changed-by-job > tracked.txt
                          git status --porcelain
                """
            ),
            "tracked.txt": "committed\n",
            "deleted.txt": "x\n",
            ".gitignore": "ignored.txt\n",
        },
    )
    (repo / "tracked.txt").write_text("dirty edit\n")
    (repo / "untracked.txt").write_text("brand new\n")
    (repo / "ignored.txt").write_text("ignored\n")
    (repo / "deleted.txt").unlink()
    git(repo, "add", "untracked.txt")
    status_before = git(repo, "status", "--porcelain")
    head_before = git(repo, "rev-parse", "HEAD")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    lines = h.lines["look"]
    assert "dirty edit" in lines and "brand new" in lines and "deleted-gone" in lines
    assert (repo / "tracked.txt").read_text() == "dirty edit\n"
    assert git(repo, "status", "--porcelain") == status_before
    assert git(repo, "rev-parse", "HEAD") == head_before


def test_checkouts_origin_offers_its_branches_and_tags_as_githubs_remote(
    tmp_path: Path, store_url: str
) -> None:
    """`git fetch origin main --depth=1` (coveragepy's docs job), `git fetch
    --prune` and `git ls-remote origin` see the branches and tags the
    checkout names `origin/<name>` and tags, as GitHub's remote has them; a
    push stays in the job."""
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              fetch:
                runs-on: ubuntu-latest
                steps:
                  - uses: actions/checkout@v4
                  - run: |
                      mkdir -p sub && cd sub
                      git fetch -q origin main --depth=1
                      echo "fetched $(git rev-parse FETCH_HEAD)"
                      git fetch -q --prune origin
                      echo "remotes $(git branch -r | tr -d ' ' | tr '\\n' ,)"
                      echo "listed $(git ls-remote origin | cut -f2 | tr '\\n' ,)"
                      git push -q origin HEAD:refs/heads/pushed && echo pushed
            """
        ),
    )
    git(repo, "tag", "v1.0")
    git(repo, "branch", "older")
    git(repo, "commit", "-q", "--allow-empty", "-m", "two")
    git(repo, "checkout", "-q", "-b", "work")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    lines = h.lines["fetch"]
    main = git(repo, "rev-parse", "main").strip()
    assert f"fetched {main}" in lines, lines
    assert "remotes origin/main,origin/older,origin/work," in lines, lines
    listed = next(line for line in lines if line.startswith("listed "))
    for ref in ("HEAD", "refs/heads/main", "refs/heads/older", "refs/heads/work", "refs/tags/v1.0"):
        assert f"{ref}," in listed, listed
    assert "pushed" in lines
    assert "pushed" not in git(repo, "branch", "-a")


def test_checkout_has_the_pushed_branch_and_the_tags_of_its_history(
    tmp_path: Path, store_url: str
) -> None:
    # On PostgreSQL the runner fetches the snapshot from the store's bundles:
    # the tags must name commits those brought.
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              version:
                runs-on: ubuntu-latest
                steps:
                  - uses: actions/checkout@v4
                    with:
                      fetch-depth: 0
                  - run: |
                      head=$(git rev-parse HEAD)
                      echo "describe $(git describe --tags) sha $GITHUB_SHA head $head"
                      echo "branch $(git rev-parse --abbrev-ref HEAD)"
                      echo "upstream $(git rev-parse --abbrev-ref @{u})"
                      echo "remotes $(git branch -r | tr -d ' ' | tr '\\n' ,)"
                      echo "tags $(git tag -l | tr '\\n' ,)"
                      echo "annotated $(git describe 2>&1 | head -1)"
                      echo "status $(git status -sb | head -1)"
                  - uses: actions/checkout@v4
                    with:
                      path: again
                  - run: echo "again $(git describe --tags)"
                    working-directory: again
            """
        ),
    )
    git(repo, "tag", "v1.0")
    git(repo, "commit", "-q", "--allow-empty", "-m", "two")
    git(repo, "tag", "-a", "v1.1", "-m", "release 1.1")
    git(repo, "commit", "-q", "--allow-empty", "-m", "three")
    git(repo, "checkout", "-q", "-b", "elsewhere")
    git(repo, "commit", "-q", "--allow-empty", "-m", "not in main")
    git(repo, "tag", "v9-elsewhere")
    git(repo, "checkout", "-q", "-b", "feature/fast", "main")
    # origin's `feature` next to the pushed `feature/fast`: one ref would be
    # the other's directory; it is left out
    git(repo, "update-ref", "refs/remotes/origin/feature", "main")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    lines = h.lines["version"]
    # A clean work tree: the job is at HEAD itself (not a snapshot commit on
    # top), as on GitHub; only tags in HEAD's history, the annotated one
    # lightweight.
    head = git(repo, "rev-parse", "HEAD").strip()
    assert f"describe {git(repo, 'describe', '--tags').strip()} sha {head} head {head}" in lines
    assert git(repo, "describe", "--tags").startswith("v1.1-1-g")
    assert "branch feature/fast" in lines and "upstream origin/feature/fast" in lines
    # every branch, as `fetch-depth: 0` fetches them: `git diff origin/main...` works
    assert "remotes origin/elsewhere,origin/feature/fast,origin/main," in lines
    assert "tags v1.0,v1.1," in lines
    # Nothing to pull or push: the branch is where its upstream is.
    assert "status ## feature/fast...origin/feature/fast" in lines
    if not store_url.startswith("postgresql"):
        # The tag object is in the object cache here (the store's bundles carry
        # commits only: there the tag arrives lightweight).
        assert any(line.startswith("annotated v1.1-1-g") for line in lines), lines
    assert any(line.startswith("again v1.1-1-g") for line in lines)
    # A dirty work tree: the snapshot commit on top of HEAD is checked out.
    (repo / "dirty.txt").write_text("local edit\n")
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    assert any(line.startswith("describe v1.1-2-g") for line in h.lines["version"])


def test_checkout_after_a_step_moved_or_emptied_the_workspace_checks_out_again(
    tmp_path: Path, store_url: str
) -> None:
    # python-trio/trio's smoke test moves the workspace away, then checks the
    # repository out into a path of the new one; another job empties the
    # workspace and checks out into it. GitHub's checkout fetches the
    # repository again in both; preloop failed the first ("holds no git
    # checkout") and called the second satisfied with no files there.
    repo = make_repo(
        tmp_path / "repo",
        {
            **workflow(
                """\
                on: push
                jobs:
                  moved:
                    runs-on: ubuntu-latest
                    steps:
                      - run: |
                          mv "$GITHUB_WORKSPACE" "$RUNNER_TEMP/elsewhere"
                          mkdir -p "$GITHUB_WORKSPACE/kept"
                        working-directory: ${{ runner.temp }}
                      - uses: actions/checkout@v4
                        with:
                          path: git-src
                      - run: echo moved "$(cat git-src/hello.txt) $(git -C git-src rev-parse @)" *
                  emptied:
                    runs-on: ubuntu-latest
                    steps:
                      - run: rm -rf ./* ./.git ./.github && touch stray
                      - uses: actions/checkout@v4
                      - run: echo emptied "$(cat hello.txt)" "$(git rev-parse --abbrev-ref HEAD)" *
                """
            ),
            "hello.txt": "hi\n",
        },
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    head = git(repo, "rev-parse", "HEAD").strip()
    assert f"moved hi {head} git-src kept" in h.lines["moved"], h.lines["moved"]
    # The workspace's stray file is gone, as GitHub's checkout deletes what a
    # directory without a repository holds before fetching into it.
    assert "emptied hi main hello.txt" in h.lines["emptied"], h.lines["emptied"]


def test_secret_never_in_logs(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              leak:
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      echo "direct ${{ secrets.API_TOKEN }}"
                      echo "env $TOKEN"
                      echo "$TOKEN" | rev | rev
                    env:
                      TOKEN: ${{ secrets.API_TOKEN }}
            """
        ),
    )
    state = tmp_path / "state"
    secret = "tok-8c1f-very-secret"
    outcome, h = run_engine(repo, store_url, state, secrets={"API_TOKEN": secret})
    assert outcome.conclusion == "success"
    assert "direct ***" in h.lines["leak"] and "env ***" in h.lines["leak"]
    assert secret not in h.all_text()
    assert job_ids_with_logs(state, outcome.run_id) == ["leak"]
    on_disk = log_path(state, outcome.run_id, "leak").read_text()
    assert "direct ***" in on_disk and secret not in on_disk
    for path in state.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".json"):
            assert secret not in path.read_text(errors="replace"), path


def test_bad_workflow_reports_position_and_submits_nothing(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                needs: nope
                steps:
                  - run: echo hi
            """
        ),
    )
    state = tmp_path / "state"
    with pytest.raises(WorkflowError) as info:
        run_engine(repo, store_url, state)
    assert ".github/workflows/ci.yml:5:" in str(info.value)
    with open_store(store_url) as store:
        assert store.list_runs() == []
    assert not (state / "snapshots").exists() or not any((state / "snapshots").iterdir())


def test_job_selection_keeps_needs(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                steps: [{run: echo a}]
              b:
                needs: a
                runs-on: ubuntu-latest
                steps: [{run: echo b}]
              other:
                runs-on: ubuntu-latest
                steps: [{run: echo other}]
            """
        ),
    )
    outcome, _ = run_engine(repo, store_url, tmp_path / "state", job="b")
    assert results(outcome) == {"a": "success", "b": "success"}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_sandbox_private_tmp_and_readonly_coordination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = tmp_path / "coord"
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(coord))
    marker = f"preloop-sandbox-{os.getpid()}"
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            f"""\
            on: push
            jobs:
              boxed:
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      echo inside > /tmp/{marker}
                      ls {coord} | head -1
                      if touch {coord}/new 2>/dev/null; then echo coord-writable; \\
                        else echo coord-readonly; fi
                      echo ok > result.txt
                  - run: cat /tmp/{marker}
            """
        ),
    )
    outcome, h = run_engine(
        repo, f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "state", sandbox=True
    )
    assert outcome.conclusion == "success", h.lines
    assert "coord-readonly" in h.lines["boxed"] and "inside" in h.lines["boxed"]
    assert not Path(f"/tmp/{marker}").exists()


def test_untriggered_event_is_refused_before_capture(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow("on: pull_request\njobs:\n  a:\n    runs-on: x\n    steps: [{run: echo}]\n"),
    )
    state = tmp_path / "state"
    engine = Engine(
        RunRequest(workspace=repo, state_dir=state, store_url=f"sqlite:///{tmp_path}/d")
    )
    with pytest.raises(NothingTriggered, match="not triggered by 'push'"):
        anyio.run(engine.run)
    assert not (state / "snapshots").exists()


def test_env_files_continue_on_error_and_hung_step_timeout(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              steps:
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      mkdir -p tools && printf '#!/bin/sh\\necho tool-ran\\n' > tools/t1
                      chmod +x tools/t1
                      echo "LATER=set" >> "$GITHUB_ENV"
                      echo "$PWD/tools" >> "$GITHUB_PATH"
                      echo "same-step LATER=${LATER:-unset} $(command -v t1 || echo no-tool)"
                  - run: echo "next-step LATER=$LATER" && t1
                  - id: flaky
                    continue-on-error: true
                    run: exit 2
                  - name: hang
                    timeout-minutes: 0.02
                    run: |
                      sleep 1000 &
                      echo "grandchild=$!"
                      wait
                  - if: failure()
                    run: echo "flaky=${{ steps.flaky.outcome }}/${{ steps.flaky.conclusion }}"
            """
        ),
    )
    pidfds: list[int] = []
    h = Harness()
    events = h.events()
    record = events.on_job_line
    assert record is not None

    def on_line(lease: Lease, text: str) -> None:
        record(lease, text)
        if text.startswith("grandchild="):
            pidfds.append(os.pidfd_open(int(text.split("=")[1])))

    events.on_job_line = on_line
    request = RunRequest(workspace=repo, store_url=store_url, state_dir=tmp_path / "state")
    outcome = anyio.run(Engine(request, events).run)
    lines = h.lines["steps"]
    assert "same-step LATER=unset no-tool" in lines
    assert "next-step LATER=set" in lines and "tool-ran" in lines
    assert "flaky=failure/success" in lines
    assert results(outcome) == {"steps": "failure"}
    assert len(pidfds) == 1
    readable, _, _ = select.select(pidfds, [], [], 30)
    assert readable == pidfds


def test_runs_sharing_a_store_only_run_their_own_jobs(tmp_path: Path) -> None:
    wf = workflow(
        "on: push\njobs:\n  build:\n    runs-on: ubuntu-latest\n"
        "    steps:\n      - run: echo build-of-$(basename $GITHUB_WORKSPACE)\n"
    )
    other = make_repo(tmp_path / "other", wf)
    mine = make_repo(tmp_path / "mine", wf)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    # A run of another `preloop run` (submitted, its engine still capturing):
    # same labels, earlier in the FIFO, yet this engine's runners never take it.
    foreign = plan(load_workflow(other / ".github/workflows/ci.yml", root=other), "push")
    with open_store(url) as store:
        foreign_id = store.submit_run(foreign, github={})
    outcome, h = run_engine(mine, url, tmp_path / "state")
    assert outcome.run_id != foreign_id and results(outcome) == {"build": "success"}
    assert h.started == ["build"]
    with open_store(url) as store:
        assert store.get_job(foreign_id, "build").status == "queued"


def test_repository_is_owner_slash_name_without_a_github_origin(
    tmp_path: Path, store_url: str
) -> None:
    # @actions/github's context.repo throws unless GITHUB_REPOSITORY is owner/repo.
    repo = make_repo(
        tmp_path / "widget",
        workflow(
            """\
            on: push
            jobs:
              show:
                runs-on: ubuntu-latest
                steps:
                  - run: echo "repo=$GITHUB_REPOSITORY owner=${{ github.repository_owner }}"
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success"
    assert "repo=local/widget owner=local" in h.lines["show"]


def test_github_workflow_is_its_name_or_path_with_its_ref_and_sha(
    tmp_path: Path, store_url: str
) -> None:
    """`github.workflow` is the workflow's `name:`, or the file's path when it
    has none (as GitHub gives it, in concurrency groups too); `workflow_ref`
    names the file at the run's ref and `workflow_sha` is the run's commit."""
    show = """\
        on: push
        jobs:
          show:
            runs-on: ubuntu-latest
            steps:
              - run: |
                  echo "wf=${{ github.workflow }}|$GITHUB_WORKFLOW"
                  echo "ref=$GITHUB_WORKFLOW_REF|${{ github.workflow_ref }}"
                  echo "sha=${{ github.workflow_sha == github.sha }} $GITHUB_WORKFLOW_SHA"
                  echo "protected=${{ github.ref_protected }} url=${{ github.repositoryUrl }}"
        """
    repo = make_repo(
        tmp_path / "widget",
        {
            ".github/workflows/ci.yml": show,
            ".github/workflows/named.yml": "name: Named\n" + textwrap.dedent(show),
        },
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success"
    lines = [line for job_lines in h.lines.values() for line in job_lines]
    assert "wf=.github/workflows/ci.yml|.github/workflows/ci.yml" in lines, lines
    assert "wf=Named|Named" in lines
    ref = "local/widget/.github/workflows/ci.yml@refs/heads/main"
    assert f"ref={ref}|{ref}" in lines
    sha = [line for line in lines if line.startswith("sha=")]
    assert len(sha) == 2 and all(line.startswith("sha=true ") and len(line) == 49 for line in sha)
    assert "protected=false url=git://github.com/local/widget.git" in lines


def test_workflow_ref_and_sha_name_the_running_workflow_file(
    tmp_path: Path, store_url: str
) -> None:
    # github.workflow_ref / workflow_sha (and GITHUB_WORKFLOW_REF/_SHA) were
    # missing: a concurrency group or job name built from them read ''.
    repo = make_repo(
        tmp_path / "widget",
        workflow(
            """\
            on: push
            concurrency: ${{ github.workflow_ref }}
            jobs:
              show:
                name: show ${{ github.workflow_ref }}
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      echo "ref=${{ github.workflow_ref }} sha=${{ github.workflow_sha }}"
                      echo "env=$GITHUB_WORKFLOW_REF $GITHUB_WORKFLOW_SHA $GITHUB_SHA"
            """
        ),
    )
    git(repo, "remote", "add", "origin", "https://github.com/acme/widget.git")
    (repo / "dirty.txt").write_text("uncommitted\n")  # the run's sha is a snapshot commit
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    ref = "acme/widget/.github/workflows/ci.yml@refs/heads/main"
    [job] = outcome.jobs
    assert job.name == f"show {ref}"
    lines = h.lines["show"]
    sha = next(line for line in lines if line.startswith("env=")).rsplit(" ", 1)[1]
    assert sha != git(repo, "rev-parse", "HEAD").strip() and len(sha) == 40
    assert f"ref={ref} sha={sha}" in lines
    assert f"env={ref} {sha} {sha}" in lines


def test_a_job_without_a_matrix_has_githubs_default_strategy(
    tmp_path: Path, store_url: str
) -> None:
    # `strategy` was {} for a job without a matrix; GitHub gives every such
    # job fail-fast true, job-index 0, job-total 1, max-parallel 1 (a shard
    # count `${{ strategy.job-total }}` is 1, not '').
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              one:
                name: shard ${{ strategy.job-index }} of ${{ strategy.job-total }}
                runs-on: ubuntu-latest
                steps:
                  - run: echo 'strategy ${{ toJSON(strategy) }}' | tr -d ' \\n'
              legs:
                needs: one
                strategy:
                  matrix:
                    n: [a, b]
                runs-on: ubuntu-latest
                steps:
                  - run: echo "leg ${{ strategy.job-index }} of ${{ strategy.job-total }}"
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success", h.lines
    assert {j.id: j.name for j in outcome.jobs}["one"] == "shard 0 of 1"
    expected = 'strategy{"fail-fast":true,"job-index":0,"job-total":1,"max-parallel":1}'
    assert expected in h.lines["one"], h.lines["one"]
    legs = sorted(line for k, v in h.lines.items() if k.startswith("legs") for line in v)
    assert [line for line in legs if line.startswith("leg ")] == ["leg 0 of 2", "leg 1 of 2"]


def test_a_job_without_a_matrix_has_a_null_matrix_context(tmp_path: Path, store_url: str) -> None:
    """`toJSON(matrix)` is `null` in a job without a matrix (in its name and
    its steps), as on GitHub; a matrix leg's is its values."""
    repo = make_repo(
        tmp_path / "widget",
        workflow(
            """\
            on: push
            jobs:
              plain:
                name: plain ${{ toJSON(matrix) }}
                runs-on: ubuntu-latest
                steps:
                  - run: echo 'plain=${{ toJSON(matrix) }}'
              legs:
                strategy: {matrix: {x: [1]}}
                runs-on: ubuntu-latest
                steps:
                  - run: echo 'legs=${{ toJSON(matrix) }}' | tr -d ' \\n'; echo
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert outcome.conclusion == "success"
    assert sorted(j.name for j in outcome.jobs) == ["legs (1)", "plain null"]
    assert "plain=null" in h.all_text() and 'legs={"x":1}' in h.all_text()


def test_configuration_variables_are_the_vars_context_everywhere(
    tmp_path: Path, store_url: str
) -> None:
    """`--var NAME=VALUE` is `vars.NAME` when planning (`runs-on`, a
    matrix), in the scheduler (a job's `if:`) and in steps; an unset one is
    empty, as on GitHub. It was always empty: there was no way to give one."""
    files = workflow(
        """\
        on: push
        jobs:
          build:
            if: vars.BUILD == 'yes'
            runs-on: ${{ vars.RUNNER || 'ubuntu-latest' }}
            strategy:
              matrix:
                py: ${{ fromJSON(vars.PYTHONS) }}
            env:
              WHO: ${{ vars.WHO }}
            steps:
              - run: echo "py=${{ matrix.py }} who=$WHO unset=[${{ vars.UNSET }}]"
          deploy:
            if: vars.DEPLOY == 'yes'
            runs-on: ubuntu-latest
            steps: [{run: echo deployed}]
        """
    )
    repo = make_repo(tmp_path / "repo", files)
    given = {"BUILD": "yes", "RUNNER": "linux", "PYTHONS": '["3.11", "3.12"]', "WHO": "me"}
    outcome, h = run_engine(repo, store_url, tmp_path / "state", vars=given)
    assert outcome.conclusion == "success", h.all_text()
    assert results(outcome) == {"build#0": "success", "build#1": "success", "deploy": "skipped"}
    assert "py=3.11 who=me unset=[]" in h.all_text().splitlines()


def test_a_job_name_that_uses_the_run_number_is_evaluated_as_the_job_starts(
    tmp_path: Path, store_url: str
) -> None:
    """A name using `github.run_number` (or `run_id`) is the stored run's,
    not '' from planning before the run had one: `build 1`, then `build 2`."""
    repo = make_repo(
        tmp_path / "widget",
        workflow(
            """\
            on: push
            jobs:
              build:
                name: build ${{ github.run_number }}
                runs-on: ubuntu-latest
                steps: [{run: 'echo "n=${{ github.run_number }}"'}]
            """
        ),
    )
    names = []
    for _ in range(2):
        outcome, _h = run_engine(repo, store_url, tmp_path / "state")
        assert outcome.conclusion == "success"
        names += [j.name for j in outcome.jobs]
    assert names == ["build 1", "build 2"]
