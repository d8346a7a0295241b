"""The runner's services driven by GitHub's own npm clients inside `preloop run`.

`@actions/artifact`, `@actions/cache` and `@actions/tool-cache` (installed by
`npm ci` from package.json) run from `run: node ...` steps of real workflows;
the scripts are in tests/js/services/. The scheduler-facing runs go through
both stores.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tests.python_support import VERSION, XY, host_python_prefix, tiny_project_files, tree_state
from tests.run_support import git, make_repo, results, run_engine

from preloop.errors import ConfigError
from preloop.runner.checkout import work_dir
from preloop.services.toolcache import job_uses_tool_cache, list_tool_cache

pytest_plugins = ["preloop.testing.control_fixtures"]

ROOT = Path(__file__).resolve().parents[1]
NODE_MODULES = ROOT / "node_modules"
JS = ROOT / "tests" / "js" / "services"


@pytest.fixture(autouse=True)
def _npm_clients() -> None:
    if not (NODE_MODULES / "@actions" / "artifact").is_dir():
        pytest.fail("GitHub's npm clients are missing: run `npm ci` in the project root")


def _workflow(jobs: str) -> dict[str, str]:
    head = f"on: push\nenv:\n  NODE_PATH: {NODE_MODULES}\n  JS: {JS}\njobs:\n"
    return {".github/workflows/ci.yml": head + jobs}


def _preloop(state: Path, *args: str, store: str | None = None) -> subprocess.CompletedProcess[str]:
    """`preloop ARGS` on `state` (and `store`: on PostgreSQL, artifacts and
    caches are in the store)."""
    extra = ["--store", store] if store else []
    return subprocess.run(
        [sys.executable, "-m", "preloop", *args, "--state-dir", str(state), *extra],
        capture_output=True,
        text=True,
        check=False,
    )


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = (
                path.read_bytes(),
                stat.S_IMODE(path.stat().st_mode),
            )
    return out


def _data_repo(tmp_path: Path, jobs: str) -> Path:
    repo = make_repo(tmp_path / "repo", _workflow(jobs), commit=False)
    data = repo / "data"
    (data / "nested" / "deeper").mkdir(parents=True)
    (data / "readme.txt").write_text("hello artifacts\n")
    (data / "run.sh").write_text("#!/bin/sh\necho run\n")
    (data / "run.sh").chmod(0o755)
    (data / "nested" / "blob.bin").write_bytes(os.urandom(200_000))
    (data / "nested" / "deeper" / "empty").write_bytes(b"")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    return repo


def test_a_rerun_reads_the_artifacts_its_kept_jobs_uploaded(tmp_path: Path, store_url: str) -> None:
    """On GitHub a re-run is an attempt of the same run: a re-run test job
    downloads what the kept build job uploaded, and uploading a name an
    earlier attempt has is refused (409) as there. Here the re-run is a new
    run whose jobs read the runs it re-runs after their own; on disk ids
    count per run, so the listing keeps them apart (the re-run's first
    upload has the id the kept one has in its run)."""
    jobs = """
  up:
    runs-on: ubuntu-latest
    steps:
      - run: node $JS/artifacts_up.cjs dir:data:data
  down:
    needs: up
    runs-on: ubuntu-latest
    steps:
      - run: |
          test -n "${{ secrets.PASS }}"
          mkdir -p r && echo mine > r/x.txt
          node $JS/artifacts_up.cjs dir:report:r
          node $JS/artifacts_down.cjs pattern all '^data$'
          diff -r data all
          node $JS/artifacts_up.cjs dir:data:r || echo "second data refused"
"""
    repo = _data_repo(tmp_path, jobs)
    state = tmp_path / "state"
    first, _ = run_engine(repo, store_url, state)
    assert results(first) == {"up": "success", "down": "failure"}
    again, h = run_engine(repo, store_url, state, rerun=first.run_id, secrets={"PASS": "yes"})
    text = h.all_text()
    assert results(again) == {"up": "success", "down": "success"}, text
    # by id (download-artifact's pattern: list, then download each by its id)
    assert "listed data,report" in text and "downloaded data" in text
    assert "(409) Conflict" in text and "second data refused" in text


def test_artifacts_upload_then_download_in_a_dependent_job(tmp_path: Path, store_url: str) -> None:
    jobs = """
  up:
    runs-on: ubuntu-latest
    steps:
      - run: node $JS/artifacts_up.cjs basic forged
  down:
    needs: up
    runs-on: ubuntu-latest
    steps:
      - run: |
          node $JS/artifacts_down.cjs data got
          diff -r data got/data
          node $JS/artifacts_down.cjs pattern merged '^part-'
          test "$(cat merged/sub/one.txt)" = one
          test "$(cat merged/two.txt)" = "second version"
          test ! -e merged/other.txt
"""
    repo = _data_repo(tmp_path, jobs)
    state = tmp_path / "state"
    outcome, h = run_engine(repo, store_url, state)
    text = h.all_text()
    assert results(outcome) == {"up": "success", "down": "success"}, text
    assert "duplicate: refused:" in text and "(409) Conflict" in text
    assert "forged: refused:" in text and "(401)" in text
    assert "listed data,other,part-1,part-2" in text
    assert "downloaded data digestMismatch=false" in text

    listed = _preloop(state, "artifacts", str(outcome.run_id), "--json", store=store_url)
    assert listed.returncode == 0, listed.stderr
    names = {a["name"]: a for a in json.loads(listed.stdout)["artifacts"]}
    assert sorted(names) == ["data", "other", "part-1", "part-2"]
    assert names["data"]["job"] == "up" and names["data"]["digest"].startswith("sha256:")
    # the zip as GitHub stores it, extracted with file modes kept
    out = tmp_path / "downloaded"
    got = _preloop(
        state, "artifacts", str(outcome.run_id), "--download", "data", str(out), store=store_url
    )
    assert got.returncode == 0, got.stderr
    assert _tree(out) == _tree(repo / "data")
    assert _tree(out)["run.sh"][1] == 0o755
    missing = _preloop(
        state, "artifacts", str(outcome.run_id), "--download", "nope", store=store_url
    )
    assert missing.returncode == 2 and "no artifact named 'nope'" in missing.stderr
    if store_url.startswith("postgresql"):
        # on PostgreSQL they are in the store (preloop.services.store_storage)
        assert not (state / "artifacts" / str(outcome.run_id)).exists()
        assert not any((state / "service-uploads").rglob("*.data"))
        return
    # nothing half-written is left in the run's directory
    run_dir = state / "artifacts" / str(outcome.run_id)
    assert sorted(p.name for p in run_dir.iterdir() if p.suffix == ".zip") == [
        f"{names[n]['id']}.zip" for n in sorted(names, key=lambda n: names[n]["id"])
    ]
    assert not any((run_dir / ".uploads").iterdir())


def test_artifact_client_v6_zipped_and_as_it_is(tmp_path: Path, store_url: str) -> None:
    """@actions/artifact 6.x (upload-artifact v6+, download-artifact v7+)
    unzips only a download served with a zip type: a zipped artifact comes
    back extracted, a file uploaded as it is (`archive: false`) as that file."""
    jobs = """
  up:
    runs-on: ubuntu-latest
    steps:
      - run: node $JS/artifacts_v6.mjs up
  down:
    needs: up
    runs-on: ubuntu-latest
    steps:
      - run: |
          node $JS/artifacts_v6.mjs down
          echo "zipped: $(cat got/zipped/sub/a.txt)"
          echo "as it is: $(cat got/report.html/report.html)"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    state = tmp_path / "state"
    outcome, h = run_engine(repo, store_url, state)
    text = h.all_text()
    assert results(outcome) == {"up": "success", "down": "success"}, text
    lines = [ln.strip() for ln in text.splitlines()]
    assert "zipped: zipped" in lines and "as it is: <p>as it is</p>" in lines, text
    assert "downloaded report.html digestMismatch=false" in lines, text
    listed = _preloop(state, "artifacts", str(outcome.run_id), "--json", store=store_url)
    assert listed.returncode == 0, listed.stderr
    types = {a["name"]: a["mime_type"] for a in json.loads(listed.stdout)["artifacts"]}
    assert types == {"zipped": "application/zip", "report.html": "text/html"}
    # `preloop artifacts --download` gives the file as it is, too
    out = tmp_path / "downloaded"
    got = _preloop(
        state, "artifacts", str(outcome.run_id), "--download", "report.html", str(out),
        store=store_url,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert (out / "report.html").read_text() == "<p>as it is</p>\n"
    again = _preloop(
        state, "artifacts", str(outcome.run_id), "--download", "report.html", str(out),
        store=store_url,
    )  # fmt: skip
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"preloop: error: {out / 'report.html'} exists: remove it or pass another DIR"
    ], again.stderr


def test_run_ids_repeating_across_stores_keep_their_own_artifacts(tmp_path: Path) -> None:
    """Two stores sharing one state directory (another --store, a lite store
    reset) both have a run 1: each run's artifacts are its own, the second
    run's upload of the same name is no duplicate, and `preloop artifacts 1`
    shows the run of the store it is given."""
    jobs = """
  up:
    runs-on: ubuntu-latest
    steps:
      - run: |
          mkdir -p a && cp who.txt a/
          node $JS/artifacts_up.cjs one:a:a
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    state = tmp_path / "state"
    stores = {tag: f"sqlite:///{tmp_path / f'{tag}.db'}" for tag in ("first", "second")}
    for tag, url in stores.items():
        (repo / "who.txt").write_text(f"{tag}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", tag)
        outcome, h = run_engine(repo, url, state)
        assert outcome.run_id == 1
        assert results(outcome) == {"up": "success"}, h.all_text()
    for tag, url in stores.items():
        listed = _preloop(state, "artifacts", "1", "--store", url, "--json")
        assert listed.returncode == 0, listed.stderr
        assert [a["name"] for a in json.loads(listed.stdout)["artifacts"]] == ["a"]
        out = tmp_path / f"got-{tag}"
        got = _preloop(state, "artifacts", "1", "--store", url, "--download", "a", str(out))
        assert got.returncode == 0, got.stderr
        assert (out / "who.txt").read_text() == f"{tag}\n"
    # the first store's run was moved aside, not removed or mixed in
    runs = sorted(p.name for p in (state / "artifacts").iterdir() if p.name[0] != ".")
    assert len(runs) == 2 and runs[0] == "1" and runs[1].startswith("1.run-"), runs
    unknown = _preloop(state, "artifacts", "7", "--store", stores["first"])
    assert unknown.returncode != 0 and "no run 7" in unknown.stderr


def test_artifacts_of_1000_files_and_one_200_mb_file(tmp_path: Path) -> None:
    digest = "find . -type f | sort | xargs sha256sum | sha256sum | cut -c1-64"
    jobs = f"""
  up:
    runs-on: ubuntu-latest
    outputs:
      many: ${{{{ steps.d.outputs.many }}}}
      big: ${{{{ steps.d.outputs.big }}}}
    steps:
      - run: node $JS/artifacts_up.cjs bulk
      - id: d
        run: |
          echo "many=$(cd many && {digest})" >> "$GITHUB_OUTPUT"
          echo "big=$(cd big && {digest})" >> "$GITHUB_OUTPUT"
  down:
    needs: up
    runs-on: ubuntu-latest
    steps:
      - run: |
          node $JS/artifacts_down.cjs many,big got
          test "$(find got/many -type f | wc -l)" = 1000
          test "$(cd got/many && {digest})" = "${{{{ needs.up.outputs.many }}}}"
          test "$(stat -c %s got/big/blob.bin)" = 209715200
          test "$(cd got/big && {digest})" = "${{{{ needs.up.outputs.big }}}}"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    state = tmp_path / "state"
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", state)
    assert results(outcome) == {"up": "success", "down": "success"}, h.all_text()
    sizes = {a.name: a.stat().st_size for a in (state / "artifacts" / "1").glob("*.zip")}
    assert max(sizes.values()) > 200 * 1024 * 1024


def test_cache_miss_then_hit_across_runs_with_restore_keys(tmp_path: Path, store_url: str) -> None:
    jobs = """
  build:
    runs-on: ubuntu-latest
    steps:
      - run: |
          K=deps-${{ github.run_id }}
          node $JS/cache.cjs "restore:$K,deps-:deps"
          echo "had $(cat deps/v 2>/dev/null || echo none)"
          rm -rf deps && mkdir deps && echo "from run ${{ github.run_id }}" > deps/v
          head -c 300000 /dev/urandom > deps/noise.bin
          node $JS/cache.cjs "save:$K:deps"
          cp deps/noise.bin noise.saved && rm -rf deps
          node $JS/cache.cjs "restore:$K:deps" "save:$K:deps"
          cmp deps/noise.bin noise.saved
          rm -rf deps && node $JS/cache.cjs "restore:nothing-here,deps-:deps"
          echo "newest $(cat deps/v)"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    state = tmp_path / "state"
    first, h1 = run_engine(repo, store_url, state)
    t1 = h1.all_text()
    assert results(first) == {"build": "success"}, t1
    k1 = f"deps-{first.run_id}"
    assert f"restore {k1},deps- -> miss" in t1 and "had none" in t1
    assert re.search(rf"save {k1} -> [1-9]", t1)
    assert f"restore {k1} -> {k1}" in t1
    # an existing key is never overwritten (GitHub: entries are immutable)
    assert t1.count(f"save {k1} -> -1") == 1
    assert f"newest from run {first.run_id}" in t1

    second, h2 = run_engine(repo, store_url, state)
    t2 = h2.all_text()
    assert results(second) == {"build": "success"}, t2
    k2 = f"deps-{second.run_id}"
    assert k1 != k2
    # restore-keys: the prefix finds the first run's entry ...
    brief = "\n".join(ln for ln in t2.splitlines() if not ln.startswith("debug:"))
    assert f"restore {k2},deps- -> {k1}" in t2, brief
    assert f"had from run {first.run_id}" in t2, brief
    # ... and, with two entries under the prefix, the newest
    assert f"restore nothing-here,deps- -> {k2}" in t2
    status = _preloop(state, "cache", "status", "--json", store=store_url)
    assert status.returncode == 0, status.stderr
    keys = [e["key"] for e in json.loads(status.stdout)["actions_cache"]["entries"]]
    assert sorted(keys) == sorted([k1, k2])


def test_a_pull_request_run_restores_its_base_branchs_cache(tmp_path: Path) -> None:
    """`preloop run --event pull_request --base feat` reads the caches of feat
    (the base branch) before those of main (the default branch), as GitHub does,
    even when main's entry under the prefix is newer."""
    jobs = """
  build:
    runs-on: ubuntu-latest
    steps:
      - run: |
          if [ "${{ github.event_name }}" = push ]; then
            mkdir deps && echo "${{ github.ref_name }}" > deps/v
            node $JS/cache.cjs "save:k-${{ github.ref_name }}:deps"
          else
            node $JS/cache.cjs "restore:k-:deps"
            echo "restored $(cat deps/v)"
          fi
"""
    head = f"on: [push, pull_request]\nenv:\n  NODE_PATH: {NODE_MODULES}\n  JS: {JS}\njobs:\n"
    repo = make_repo(tmp_path / "repo", {".github/workflows/ci.yml": head + jobs})
    state = tmp_path / "state"
    store = f"sqlite:///{tmp_path / 'p.db'}"
    git(repo, "checkout", "-q", "-b", "feat")
    for branch in ("feat", "main"):  # main's entry is the newer one
        git(repo, "checkout", "-q", branch)
        outcome, h = run_engine(repo, store, state)
        assert results(outcome) == {"build": "success"}, h.all_text()
        assert f"save k-{branch} -> " in h.all_text()
    git(repo, "checkout", "-q", "-b", "topic", "feat")
    outcome, h = run_engine(repo, store, state, event="pull_request", base="feat")
    text = h.all_text()
    assert results(outcome) == {"build": "success"}, text
    assert "restore k- -> k-feat" in text and "restored feat" in text, text


def test_cache_evicts_least_recently_used_at_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRELOOP_ACTIONS_CACHE_MAX_BYTES", "2600000")
    jobs = """
  build:
    runs-on: ubuntu-latest
    steps:
      - run: |
          for k in a b c; do mkdir -p $k && head -c 1000000 /dev/urandom > $k/blob; done
          node $JS/cache.cjs "save:key-a:a" "save:key-b:b"
          node $JS/cache.cjs "restore:key-a:a"
          node $JS/cache.cjs "save:key-c:c"
          node $JS/cache.cjs "restore:key-b:b" "restore:key-a:a"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    state = tmp_path / "state"
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", state)
    text = h.all_text()
    assert results(outcome) == {"build": "success"}, text
    # b was used least recently when c pushed the total over the cap
    assert "restore key-b -> miss" in text and "restore key-a -> key-a" in text
    doc = json.loads(_preloop(state, "cache", "status", "--json").stdout)["actions_cache"]
    assert sorted(e["key"] for e in doc["entries"]) == ["key-a", "key-c"]
    assert doc["total_bytes"] <= 2600000 and doc["max_bytes"] == 2600000
    assert sorted(p.name for p in (state / "actions-cache" / "blobs").iterdir()) == [
        f"{e['id']}.tar" for e in sorted(doc["entries"], key=lambda e: e["id"])
    ]


def _host_pythons(state: Path) -> list[str]:
    return [e.version for e in list_tool_cache(state / "toolcache") if e.tool == "Python"]


def _newest(versions: list[str]) -> str:
    return max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))


def _find_python_action() -> dict[str, str]:
    src = JS / "find-python"
    return {
        f".github/actions/find-python/{n}": (src / n).read_text()
        for n in ("action.yml", "index.cjs")
    }


def test_tool_cache_find_python_returns_the_hosts_interpreter(
    tmp_path: Path, store_url: str
) -> None:
    """@actions/tool-cache's `find('Python', '3.x')` as setup-python calls it,
    from a `run:` step and from a JavaScript action doing what setup-python
    does with the tool cache (tests/js/services/find-python): its `3.x` step
    succeeds with the host's newest 3.x on PATH; a version the host lacks fails."""
    jobs = """
  setup:
    runs-on: ubuntu-latest
    steps:
      - run: |
          node $JS/toolcache.cjs 3.x
          node $JS/toolcache.cjs 2.0.1
          echo "tool cache at $RUNNER_TOOL_CACHE"
      - id: old
        uses: ./.github/actions/find-python
        continue-on-error: true
        with:
          python-version: "2.0"
      - id: py
        uses: ./.github/actions/find-python
        with:
          python-version: "3.x"
      - run: |
          echo "old outcome=${{ steps.old.outcome }}"
          echo "py outcome=${{ steps.py.outcome }} version=${{ steps.py.outputs.python-version }}"
          echo "python is $(command -v python) at $pythonLocation"
          test -f "$pythonLocation/pyvenv.cfg" && echo "venv at $pythonLocation"
          test "$(python -c 'import platform; print(platform.python_version())')" = \
            "${{ steps.py.outputs.python-version }}"
"""
    files = {**_workflow(jobs), **_find_python_action()}
    repo = make_repo(tmp_path / "repo", files)
    state = tmp_path / "state"
    outcome, h = run_engine(repo, store_url, state)
    text = h.all_text()
    assert results(outcome) == {"setup": "success"}, text
    lines = [ln.strip() for ln in text.splitlines()]
    found = [ln.removeprefix("found ") for ln in lines if ln.startswith("found ")]
    assert found[1] == "-"  # a version the host lacks
    path = Path(found[0])
    # the job's own tool cache (its Pythons are venvs over the shared
    # entries), in the job's directory; the last step ran its interpreter
    tool_cache = path.parent.parent.parent
    assert f"tool cache at {tool_cache}" in lines
    assert tool_cache.name == "tool" and work_dir(state) in tool_cache.parents
    assert f"venv at {path}" in lines
    version = path.parent.name
    assert version.startswith("3.")
    host = _host_pythons(state)
    listed = next(ln for ln in lines if ln.startswith("versions ")).removeprefix("versions ")
    assert sorted(listed.split(",")) == sorted(host)
    # the newest 3.x the host has, as setup-python would pick
    assert version == _newest(host)
    # the action: 2.0 failed, 3.x succeeded and put the tool cache's 3.x on PATH
    assert "old outcome=failure" in text
    assert "The version '2.0' with architecture" in text
    assert f"py outcome=success version={version}" in lines
    assert f"python is {path}/bin/python at {path}" in lines
    shown = _preloop(state, "toolcache", "--json")
    assert shown.returncode == 0, shown.stderr
    entries = json.loads(shown.stdout)["entries"]
    assert any(e["tool"] == "Python" and e["version"] == version for e in entries)


@pytest.mark.parametrize("layout", ["auto", "always"])
def test_only_jobs_that_may_read_the_tool_cache_get_it_laid_out(
    tmp_path: Path, store_url: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of `run:` steps that never name the tool cache gets an empty
    directory (no venv per host Python); one that names it, or runs an
    action, gets the layout; with PRELOOP_TOOL_CACHE_LAYOUT=always, every
    job does."""
    monkeypatch.setenv("PRELOOP_TOOL_CACHE_LAYOUT", layout)
    jobs = """
  plain:
    runs-on: ubuntu-latest
    steps:
      - run: |
          d=$(printenv RUNNER_TOOL""_CACHE)
          echo "plain dir=$(basename "$d") entries=$(ls -A "$d" | wc -l)"
  named:
    runs-on: ubuntu-latest
    steps:
      - run: echo "named pythons=$(ls "$RUNNER_TOOL_CACHE/Python" | wc -l)"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    text = h.all_text()
    assert results(outcome) == {"plain": "success", "named": "success"}, text
    lines = [ln.strip() for ln in text.splitlines()]
    plain = next(ln for ln in lines if ln.startswith("plain dir=tool entries="))
    entries = int(plain.removeprefix("plain dir=tool entries="))
    assert (entries == 0) == (layout == "auto"), text
    named = next(ln for ln in lines if ln.startswith("named pythons="))
    assert int(named.removeprefix("named pythons=")) >= 1, text


@pytest.mark.parametrize(
    ("spec", "uses"),
    [
        ({"steps": [{"run": "make test"}]}, False),
        ({"steps": [{"run": "make"}, {"uses": "actions/setup-python@v5"}]}, True),
        ({"steps": [{"uses": "./.github/actions/build"}]}, True),
        ({"steps": [{"uses": "actions/checkout@v4"}, {"run": "make test"}]}, False),
        ({"steps": [{"uses": "actions/cache/restore@v4", "with": {"path": "~/.npm"}}]}, False),
        (
            {"steps": [{"uses": "actions/cache@v4", "with": {"path": "${{ runner.tool_cache }}"}}]},
            True,
        ),
        ({"steps": [{"uses": "actions/checkout@v4"}, {"uses": "astral-sh/setup-uv@v6"}]}, True),
        ({"steps": [{"uses": "docker://alpine:3"}]}, True),
        ({"steps": [{"run": 'ls "$RUNNER_TOOL_CACHE"'}]}, True),
        ({"steps": [{"run": "ls", "env": {"D": "${{ runner.tool_cache }}"}}]}, True),
        ({"steps": [{"run": "ls /opt/hostedtoolcache"}]}, True),
        ({"steps": [{"run": "node -e \"require('@actions/tool-cache')\""}]}, True),
        ({"steps": [{"run": "x"}], "env": {"T": "$AGENT_TOOLSDIRECTORY"}}, True),
        ({"steps": [{"run": "x"}], "defaults": {"run": {"working-directory": "tool_cache"}}}, True),
    ],
)
def test_job_uses_tool_cache(spec: dict[str, object], uses: bool) -> None:
    assert job_uses_tool_cache(spec) is uses


def test_every_job_uses_the_tool_cache_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELOOP_TOOL_CACHE_LAYOUT", "always")
    assert job_uses_tool_cache({"steps": [{"run": "node ci/find-python.cjs"}]})
    monkeypatch.setenv("PRELOOP_TOOL_CACHE_LAYOUT", "sometimes")
    with pytest.raises(ConfigError, match="PRELOOP_TOOL_CACHE_LAYOUT"):
        job_uses_tool_cache({"steps": []})


def _shared_python(state: Path, prefix: Path) -> Path:
    """`prefix` as a complete x64 Python of `state`'s shared tool cache (as a
    setup action leaves one); its `Python/<version>` directory."""
    entry = state / "toolcache" / "Python" / VERSION
    entry.mkdir(parents=True)
    (entry / "x64").symlink_to(prefix)
    (entry / "x64.complete").write_text("")
    return entry


def test_a_jobs_pip_installs_stay_in_the_job(tmp_path: Path) -> None:
    """A Python that a setup action installed in the shared tool cache (here
    a pyenv-style prefix of this test's own) is, in each job, a venv over it:
    the first job's `python -m pip install -e` and `pip install` of a wheel
    are there for its later steps (with `pip cache dir` and `python -m venv`
    working), the second job does not see them, and the installed Python is
    byte for byte what it was."""
    prefix = host_python_prefix(tmp_path / "pyenv")
    state = tmp_path / "state"
    entry = _shared_python(state, prefix)
    before = tree_state(prefix)
    setup = f"""
      - uses: ./.github/actions/find-python
        with:
          python-version: "{VERSION}"
"""
    jobs = f"""
  first:
    runs-on: ubuntu-latest
    steps:{setup}
      - run: python -m pip install --no-index --no-build-isolation -e ./tiny
      - run: |
          pip wheel --no-index --no-build-isolation -w "$RUNNER_TEMP/dist" ./other
          pip install --no-index "$RUNNER_TEMP/dist/other-1.0-py3-none-any.whl"
      - run: |
          cd "$RUNNER_TEMP"  # not the checkout, whose tiny/ and other/ import as packages
          python -c "import sys, tiny, other; print('installed', tiny.VALUE, other.VALUE)"
          python -c "import sys; print('prefix', sys.prefix)"
          echo "pip is $(command -v pip): $(pip --version)"
          echo "pip cache $(pip cache dir)"
          python -m venv --without-pip "$RUNNER_TEMP/inner"
          "$RUNNER_TEMP/inner/bin/python" -c "import sys; print('inner', sys.prefix)"
  second:
    needs: first
    runs-on: ubuntu-latest
    steps:{setup}
      - run: |
          cd "$RUNNER_TEMP"
          for m in tiny other; do
            python -c "import $m" 2>/dev/null && echo "second sees $m" || echo "second: no $m"
          done
"""
    files = {
        **_workflow(jobs),
        **_find_python_action(),
        **tiny_project_files("tiny", "tiny/"),
        **tiny_project_files("other", "other/"),
    }
    files[".github/workflows/ci.yml"] = files[".github/workflows/ci.yml"].replace(
        "env:\n",
        "env:\n"
        "  PIP_DISABLE_PIP_VERSION_CHECK: '1'\n"
        f"  PIP_CACHE_DIR: {tmp_path / 'pip-cache'}\n"
        # bytecode the interpreter caches beside the base's modules it runs
        # (pip's) is no install: left out, so the base compares byte for byte
        "  PYTHONDONTWRITEBYTECODE: '1'\n",
        1,
    )
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", state)
    text = h.all_text()
    assert results(outcome) == {"first": "success", "second": "success"}, text
    lines = [ln.strip() for ln in text.splitlines()]
    assert "installed tiny other" in lines, text
    # the installs went to the job's venv: not into the Python under it, nor the next job
    assert tree_state(prefix) == before
    assert "second: no tiny" in lines and "second: no other" in lines, text
    venv = Path(next(ln for ln in lines if ln.startswith("prefix ")).removeprefix("prefix "))
    # the job's own tool cache, in its directory under the state's work dir
    assert (
        venv.parts[-3:] == ("Python", VERSION, "x64") and venv.parent.parent.parent.name == "tool"
    )
    assert work_dir(state) in venv.parents
    site = f"{prefix}/lib/python{XY}/site-packages/pip (python {XY})"
    assert f"pip is {venv}/bin/pip: pip " in text and site in text, text
    assert f"pip cache {tmp_path / 'pip-cache'}" in lines, text
    inner = next(ln for ln in lines if ln.startswith("inner ")).removeprefix("inner ")
    assert inner.endswith("/temp/inner") and work_dir(state) in Path(inner).parents, text
    # the shared cache still lists the installed Python, as it was
    shared = list_tool_cache(state / "toolcache")
    assert [(e.path, e.origin) for e in shared if e.version == VERSION] == [
        (str(entry / "x64"), "installed")
    ]


def test_a_python_container_job_runs_with_that_python_in_its_own_venv(tmp_path: Path) -> None:
    """`container: python:X.Y` (hypercorn's tox jobs, no setup-python): on
    GitHub `python` and `pip` are the image's, and installs go with the
    container. Here the job's tool cache Python of that version is first on
    PATH: the wheel `pip install` writes lands in the job's venv, never in the
    Python under it. An image version the host lacks says so."""
    prefix = host_python_prefix(tmp_path / "pyenv")
    state = tmp_path / "state"
    _shared_python(state, prefix)
    before = tree_state(prefix)
    jobs = f"""
  tox:
    runs-on: ubuntu-latest
    container: python:${{{{ matrix.python }}}}
    strategy:
      matrix:
        python: ["{XY}", "{XY}-slim"]
    steps:
      - run: |
          pip wheel --no-index --no-build-isolation -w "$RUNNER_TEMP/dist" ./tiny
          pip install --no-index "$RUNNER_TEMP/dist/tiny-1.0-py3-none-any.whl"
          cd "$RUNNER_TEMP"
          python -c "import sys, tiny; print('prefix', sys.prefix, tiny.VALUE)"
  missing:
    runs-on: ubuntu-latest
    container: {{image: "python:2.1"}}
    steps:
      - run: echo on the host
"""
    files = {**_workflow(jobs), **tiny_project_files("tiny", "tiny/")}
    files[".github/workflows/ci.yml"] = files[".github/workflows/ci.yml"].replace(
        "env:\n",
        "env:\n  PIP_DISABLE_PIP_VERSION_CHECK: '1'\n  PYTHONDONTWRITEBYTECODE: '1'\n"
        f"  PIP_CACHE_DIR: {tmp_path / 'pip-cache'}\n",
        1,
    )
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", state)
    text = h.all_text()
    assert set(results(outcome).values()) == {"success"}, text
    prefixes = [ln.split()[1:] for ln in text.splitlines() if ln.strip().startswith("prefix ")]
    assert len(prefixes) == 2, text
    for venv, value in prefixes:
        assert Path(venv).parts[-3:] == ("Python", VERSION, "x64"), text
        assert work_dir(state) in Path(venv).parents and value == "tiny", text
    assert tree_state(prefix) == before
    assert "first on PATH in place of that image" in text, text
    assert "this host has no Python 2.1 for it" in text, text


def test_a_download_in_a_jobs_tool_cache_is_there_for_the_job_after(tmp_path: Path) -> None:
    """What a job installs in its own tool cache as setup-python does (a
    Python the host lacks, a PyPy) is in the shared cache once the job
    ended, before the job that needs it starts: that one finds both."""
    state = tmp_path / "state"
    python = os.path.realpath(sys.executable)
    jobs = f"""
  first:
    runs-on: ubuntu-latest
    steps:
      - run: |
          for dir in Python/3.99.1 PyPy/7.3.99; do
            mkdir -p "$RUNNER_TOOL_CACHE/$dir/x64/bin"
            ln -s {python} "$RUNNER_TOOL_CACHE/$dir/x64/bin/python"
            touch "$RUNNER_TOOL_CACHE/$dir/x64.complete"
          done
  second:
    needs: first
    runs-on: ubuntu-latest
    steps:
      - run: |
          cat "$RUNNER_TOOL_CACHE/Python/3.99.1/x64/pyvenv.cfg"
          "$RUNNER_TOOL_CACHE/PyPy/7.3.99/x64/bin/python" -c "print('pypy', 'found')"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", state)
    text = h.all_text()
    assert results(outcome) == {"first": "success", "second": "success"}, text
    assert "include-system-site-packages = true" in text and "pypy found" in text, text
    entries = list_tool_cache(state / "toolcache")
    assert {(e.tool, e.version, e.origin) for e in entries} >= {
        ("Python", "3.99.1", "installed"),
        ("PyPy", "7.3.99", "installed"),
    }


#: Where an offline copy of actions/setup-python may be: a bare repository at
#: `<dir>/actions+setup-python/repo` (the layout of this machine's mirrors).
SETUP_PYTHON_MIRROR = Path(os.environ.get("PRELOOP_TEST_ACTION_MIRRORS", "/work/.mirror"))
needs_setup_python = pytest.mark.skipif(
    not (SETUP_PYTHON_MIRROR / "actions+setup-python" / "repo").is_dir(),
    reason="no offline copy of actions/setup-python (set PRELOOP_TEST_ACTION_MIRRORS)",
)


def _serve_setup_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`uses: actions/setup-python@...` from the offline copy (PRELOOP_ACTIONS_URL)."""
    mirrors = tmp_path / "mirrors" / "actions"
    mirrors.mkdir(parents=True)
    (mirrors / "setup-python").symlink_to(SETUP_PYTHON_MIRROR / "actions+setup-python" / "repo")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path / 'mirrors'}")


@needs_setup_python
def test_the_real_setup_python_finds_the_hosts_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """actions/setup-python@v5 itself, fetched by `preloop run` from a local
    mirror (PRELOOP_ACTIONS_URL=file://...): `3.x` succeeds without a download
    and puts the host's newest 3.x on PATH, as the job's own venv over it
    (with `cache: pip`, which runs that venv's `pip cache dir`); `2.0` fails
    and the log names the versions the host has."""
    _serve_setup_python(tmp_path, monkeypatch)
    jobs = """
  setup:
    runs-on: ubuntu-latest
    steps:
      - id: old
        uses: actions/setup-python@v5
        continue-on-error: true
        with:
          python-version: "2.0"
      - id: py
        uses: actions/setup-python@v5
        with:
          python-version: "3.x"
          cache: pip
      - run: |
          echo "old outcome=${{ steps.old.outcome }}"
          echo "py outcome=${{ steps.py.outcome }} version=${{ steps.py.outputs.python-version }}"
          echo "python is $(command -v python)"
          echo "tool cache $RUNNER_TOOL_CACHE"
          python -c "import sys; print('prefixes', sys.prefix, sys.base_prefix)"
          echo "pip is $(command -v pip): $(pip --version)"
          echo "lib $LD_LIBRARY_PATH pkgconfig $PKG_CONFIG_PATH"
          mkdir -p "$PIP_CACHE_DIR" && echo x > "$PIP_CACHE_DIR/x"  # what setup-python saves
"""
    files = {**_workflow(jobs), "requirements.txt": ""}
    files[".github/workflows/ci.yml"] = files[".github/workflows/ci.yml"].replace(
        "env:\n", f"env:\n  PIP_CACHE_DIR: {tmp_path / 'pip-cache'}\n", 1
    )
    repo = make_repo(tmp_path / "repo", files)
    state = tmp_path / "state"
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", state)
    text = h.all_text()
    assert results(outcome) == {"setup": "success"}, text
    host = _host_pythons(state)
    version = _newest(host)
    lines = [ln.strip() for ln in text.splitlines()]
    assert "old outcome=failure" in lines, text
    assert f"py outcome=success version={version}" in lines, text
    # the job's own tool cache, whose Python is a venv over the shared entry
    tool_cache = Path(next(ln for ln in lines if ln.startswith("tool cache ")).split()[-1])
    assert tool_cache.name == "tool" and work_dir(state) in tool_cache.parents, text
    venv = tool_cache / "Python" / version / "x64"
    assert f"python is {venv}/bin/python" in lines, text
    prefixes = next(ln for ln in lines if ln.startswith("prefixes ")).split()
    assert prefixes[1] == str(venv) and prefixes[2] != str(venv), text
    assert f"pip is {venv}/bin/pip: pip " in text, text
    assert f"(python {'.'.join(version.split('.')[:2])})" in text, text
    assert f"lib {venv}/lib pkgconfig {venv}/lib/pkgconfig" in lines, text
    # setup-python ran the venv's `pip cache dir` to restore, and again to save
    assert f"{venv}/bin/pip cache dir" in text and "pip cache is not found" in text, text
    assert "Cache saved with the key: setup-python-" in text, text
    # a setup step asking for a version the host lacks names the versions it has
    hint = next(ln for ln in lines if "has no Python matching '2.0'" in ln)
    assert all(v in hint for v in host) and str(state / "toolcache") in hint
    assert "matching '3.x'" not in text


@needs_setup_python
def test_uv_takes_the_python_setup_python_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool cache's Python is a venv, which uv passes over when it needs
    an interpreter: with the base's python, python3 and pythonX.Y on PATH
    right after the venv's bin, `uv venv` and `uv venv -p X.Y` make the
    version setup-python set up, not the next Python on PATH, and `uv pip`
    in a project still uses the project's .venv."""
    from uv import find_uv_bin

    from preloop.services.toolcache import refresh_tool_cache

    _serve_setup_python(tmp_path, monkeypatch)
    # A host Python other than the one uv would find on PATH without the fix.
    on_path = subprocess.run(
        ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    host = [e.version for e in refresh_tool_cache(tmp_path / "probe") if e.tool == "Python"]
    others = sorted(
        {".".join(v.split(".")[:2]) for v in host if v.startswith("3.")} - {on_path},
        key=lambda v: tuple(int(x) for x in v.split(".")),
    )
    assert others, f"this test needs a host Python 3.x other than {on_path}: {host}"
    wanted = others[-1]  # the newest: uv supports it for longest
    jobs = f"""
  uv:
    runs-on: ubuntu-latest
    env:
      UV_PYTHON_DOWNLOADS: never
      UV_CACHE_DIR: {tmp_path / "uv-cache"}
    steps:
      - uses: actions/setup-python@v5
        with:
          python-version: "{wanted}"
      - run: |
          {find_uv_bin()} venv -q "$RUNNER_TEMP/v"
          "$RUNNER_TEMP/v/bin/python" -c "import sys; print('uv made %d.%d' % sys.version_info[:2])"
          echo "UV_PYTHON [${{UV_PYTHON-}}]"
          {find_uv_bin()} venv -q -p {wanted} "$RUNNER_TEMP/w"  # as tox-uv asks
          made=$("$RUNNER_TEMP/w/bin/python" -c "import sys; print('%d.%d' % sys.version_info[:2])")
          echo "uv -p made $made"
          grep '^home = ' "$RUNNER_TEMP/w/pyvenv.cfg"
          echo "python{wanted} is $(command -v python{wanted})"
          echo "python is $(command -v python)"
          # `uv pip` in a project with its own .venv uses that one
          mkdir "$RUNNER_TEMP/project" && cd "$RUNNER_TEMP/project" && {find_uv_bin()} venv -q
          echo "uv pip uses $({find_uv_bin()} python find)"
"""
    repo = make_repo(tmp_path / "repo", _workflow(jobs))
    outcome, h = run_engine(repo, f"sqlite:///{tmp_path / 'p.db'}", tmp_path / "state")
    text = h.all_text()
    assert results(outcome) == {"uv": "success"}, text
    lines = [ln.strip() for ln in text.splitlines()]
    assert f"uv made {wanted}" in lines and f"uv -p made {wanted}" in lines, text
    assert "UV_PYTHON []" in lines, text  # it would outrank a project's .venv
    # A venv uv made outlives the job (actions/cache): its home is no job's.
    home = Path(next(ln for ln in lines if ln.startswith("home = ")).split(" = ")[1])
    assert home.is_relative_to(tmp_path / "state" / "toolcache"), text
    assert not home.is_relative_to(work_dir(tmp_path / "state")), text
    # the shell still finds the venv's own python and pythonX.Y first
    venv_python = next(ln for ln in lines if ln.startswith("python is ")).split()[-1]
    assert venv_python.endswith("/x64/bin/python") and f"/Python/{wanted}." in venv_python, text
    assert f"python{wanted} is {venv_python}{wanted}" in lines, text
    temp = venv_python.split("/tool/Python/")[0] + "/temp"
    assert f"uv pip uses {temp}/project/.venv/bin/python" in lines, text
