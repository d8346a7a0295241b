"""Event filters: GitHub's pattern rules and trigger decisions, from the
examples of GitHub's "Workflow syntax" and "Filter pattern cheat sheet"."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from preloop.errors import UsageError
from preloop.workflow import load_workflow
from preloop.workflow.changes import event_facts, normalize_ref
from preloop.workflow.loader import EVENTS
from preloop.workflow.triggers import (
    EventFacts,
    PatternError,
    Trigger,
    check_event_name,
    evaluate_trigger,
    list_matches,
)

# (patterns, value, included?) -- GitHub's documented examples.
DOCS = [
    (["feature/*"], "feature/my-branch", True),
    (["feature/*"], "feature/your-branch", True),
    (["feature/*"], "feature/beta-a/my-branch", False),
    (["feature/**"], "feature/beta-a/my-branch", True),
    (["feature/**"], "feature/mona/the/octocat", True),
    (["main", "releases/mona-the-octocat"], "main", True),
    (["main", "releases/mona-the-octocat"], "releases/mona-the-octocat", True),
    (["main", "releases/mona-the-octocat"], "mainline", False),
    (["*"], "main", True),
    (["*"], "releases", True),
    (["*"], "all/the/branches", False),
    (["**"], "all/the/branches", True),
    (["**"], "every/tag", True),
    (["*feature"], "mona-feature", True),
    (["*feature"], "feature", True),
    (["*feature"], "ver-10-feature", True),
    (["v2*"], "v2", True),
    (["v2*"], "v2.0", True),
    (["v2*"], "v2.9", True),
    (["v2*"], "v3.0", False),
    (["v[12].[0-9]+.[0-9]+"], "v1.10.1", True),
    (["v[12].[0-9]+.[0-9]+"], "v2.0.0", True),
    (["v[12].[0-9]+.[0-9]+"], "v3.0.0", False),
    (["v[12].[0-9]+.[0-9]+"], "v1.x.0", False),
    # paths
    (["*"], "README.md", True),
    (["*"], "server.rb", True),
    (["*"], "docs/README.md", False),
    (["*.jsx?"], "page.js", True),
    (["*.jsx?"], "page.jsx", True),
    (["*.jsx?"], "page.jsxx", False),
    (["**"], "all/the/files.md", True),
    (["*.js"], "app.js", True),
    (["*.js"], "index.js", True),
    (["*.js"], "src/app.js", False),
    (["**.js"], "index.js", True),
    (["**.js"], "js/index.js", True),
    (["**.js"], "src/js/app.js", True),
    (["docs/*"], "docs/README.md", True),
    (["docs/*"], "docs/file.txt", True),
    (["docs/*"], "docs/mona/octocat.txt", False),
    (["docs/**"], "docs/README.md", True),
    (["docs/**"], "docs/mona/octocat.txt", True),
    (["docs/**/*.md"], "docs/README.md", True),
    (["docs/**/*.md"], "docs/mona/hello-world.md", True),
    (["docs/**/*.md"], "docs/a/markdown/file.md", True),
    (["**/docs/**"], "docs/hello.md", True),
    (["**/docs/**"], "dir/docs/my-file.txt", True),
    (["**/docs/**"], "space/docs/plan/space.doc", True),
    (["**/README.md"], "README.md", True),
    (["**/README.md"], "js/README.md", True),
    (["**/*src/**"], "a/src/app.js", True),
    (["**/*src/**"], "my-src/code/js/app.js", True),
    (["**/*-post.md"], "my-post.md", True),
    (["**/*-post.md"], "path/their-post.md", True),
    (["**/migrate-*.sql"], "migrate-10909.sql", True),
    (["**/migrate-*.sql"], "db/migrate-v1.0.sql", True),
    (["**/migrate-*.sql"], "db/sept/migrate-v1.sql", True),
    # negation: order matters, the last matching pattern decides
    (["*.md", "!README.md"], "hello.md", True),
    (["*.md", "!README.md"], "README.md", False),
    (["*.md", "!README.md"], "docs/hello.md", False),
    (["*.md", "!README.md", "README*"], "hello.md", True),
    (["*.md", "!README.md", "README*"], "README.md", True),
    (["*.md", "!README.md", "README*"], "README.doc", True),
    (["!README.md", "*.md"], "README.md", True),
    # cheat sheet: [CB]at, [1-2]00, `!` only special at the start, escapes
    (["[CB]at"], "Cat", True),
    (["[CB]at"], "Bat", True),
    (["[CB]at"], "Rat", False),
    (["[1-2]00"], "100", True),
    (["[1-2]00"], "300", False),
    (["a!b"], "a!b", True),
    (["\\!file"], "!file", True),
    ([".yml"], "fyml", False),
    (["Octo*"], "Octocat", True),
]


@pytest.mark.parametrize(("patterns", "value", "included"), DOCS)
def test_documented_patterns(patterns: list[str], value: str, included: bool) -> None:
    assert (list_matches(patterns, value) is not None) is included


@pytest.mark.parametrize("bad", ["[", "v[1-", "[]", "[a-Z]", "[9-0]", "[.]"])
def test_invalid_patterns_are_errors(bad: str) -> None:
    with pytest.raises(PatternError, match="filter pattern"):
        list_matches([bad], "x")


def wf(tmp_path: Path, on: str) -> object:
    path = tmp_path / ".github" / "workflows" / "w.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{on}\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps: [{{run: echo}}]\n")
    return load_workflow(path)


def decide(
    workflow: object, event: str, ref: str | None, paths: tuple[str, ...] | None = ()
) -> bool:
    return evaluate_trigger(workflow, EventFacts(event, ref, paths)).triggered  # type: ignore[arg-type]


def test_branch_and_tag_filters(tmp_path: Path) -> None:
    tags_only = wf(tmp_path, "on:\n  push:\n    tags: ['v*']")
    assert not decide(tags_only, "push", "refs/heads/main")  # a branch push: tags only
    assert decide(tags_only, "push", "refs/tags/v1.2")
    assert not decide(tags_only, "push", "refs/tags/release-1")
    trig = evaluate_trigger(tags_only, EventFacts("push", "refs/heads/main", ()))  # type: ignore[arg-type]
    assert trig.reason == "branch 'main': on.push filters tags only"

    branches = wf(tmp_path, "on:\n  push:\n    branches: [main, 'releases/**']")
    assert decide(branches, "push", "refs/heads/main")
    assert decide(branches, "push", "refs/heads/releases/1.0/rc")
    assert not decide(branches, "push", "refs/heads/feature")
    assert not decide(branches, "push", "refs/tags/v1")  # branches only: no tags

    ignore = wf(
        tmp_path, "on:\n  push:\n    branches-ignore: ['mona/octocat', 'releases/**-alpha']"
    )
    assert not decide(ignore, "push", "refs/heads/releases/beta/3-alpha")
    assert decide(ignore, "push", "refs/heads/releases/beta/3")
    assert not decide(ignore, "push", "refs/tags/v1")  # branch filters only: no tags

    negated = wf(tmp_path, "on:\n  push:\n    branches: ['releases/**', '!releases/**-alpha']")
    assert decide(negated, "push", "refs/heads/releases/10")
    assert not decide(negated, "push", "refs/heads/releases/10-alpha")

    bare = wf(tmp_path, "on: push")
    assert decide(bare, "push", "refs/heads/anything") and decide(bare, "push", "refs/tags/x")
    assert not decide(bare, "pull_request", "refs/heads/main")


def test_path_filters(tmp_path: Path) -> None:
    js = wf(tmp_path, "on:\n  push:\n    paths: ['**.js']")
    assert decide(js, "push", "refs/heads/main", ("README.md", "src/app.js"))
    assert not decide(js, "push", "refs/heads/main", ("README.md",))
    assert not decide(js, "push", "refs/heads/main", ())  # nothing changed: no run
    assert decide(js, "push", "refs/heads/main", None)  # unknown diff: GitHub runs it
    assert decide(js, "push", "refs/tags/v1", ())  # never path-filtered for tags

    docs = wf(tmp_path, "on:\n  push:\n    paths-ignore: ['docs/**']")
    assert not decide(docs, "push", "refs/heads/main", ("docs/a.md", "docs/b/c.md"))
    assert decide(docs, "push", "refs/heads/main", ("docs/a.md", "src/x.py"))

    both = wf(tmp_path, "on:\n  push:\n    paths: ['sub/project/**', '!sub/project/docs/**']")
    assert decide(both, "push", "refs/heads/main", ("sub/project/a.c",))
    assert not decide(both, "push", "refs/heads/main", ("sub/project/docs/readme.md",))

    branch_and_paths = wf(tmp_path, "on:\n  push:\n    branches: [main]\n    paths: ['src/**']")
    assert decide(branch_and_paths, "push", "refs/heads/main", ("src/a",))
    assert not decide(branch_and_paths, "push", "refs/heads/dev", ("src/a",))
    assert not decide(branch_and_paths, "push", "refs/heads/main", ("doc/a",))


def test_an_unknown_ref_skips_ref_filtered_workflows_and_still_checks_paths(
    tmp_path: Path,
) -> None:
    """A detached HEAD without --ref: branch/tag filters cannot be decided
    (not triggered, saying how to decide them); path filters still apply."""
    for on in (
        "on:\n  push:\n    branches: [main]",
        "on:\n  push:\n    branches-ignore: [dev]",
        "on:\n  push:\n    tags: ['v*']",
        "on:\n  push:\n    tags-ignore: ['v*']",
    ):
        trig = evaluate_trigger(wf(tmp_path, on), EventFacts("push", None, ("a",)))  # type: ignore[arg-type]
        assert trig == Trigger(False, "ref unknown (detached HEAD): pass --ref REF"), on
    js = wf(tmp_path, "on:\n  push:\n    paths: ['**.js']")
    assert not decide(js, "push", None, ("README.md",))
    trig = evaluate_trigger(js, EventFacts("push", None, ("src/app.js",)))  # type: ignore[arg-type]
    assert trig == Trigger(True, "'src/app.js' matches on.push.paths '**.js'")
    ignored = wf(tmp_path, "on:\n  push:\n    paths-ignore: ['docs/**']")
    assert not decide(ignored, "push", None, ("docs/a.md",))
    assert decide(wf(tmp_path, "on: push"), "push", None)


def test_pull_request_filters_and_types(tmp_path: Path) -> None:
    pr = wf(
        tmp_path,
        "on:\n  pull_request:\n    branches: [main]\n    types: [opened]\n    paths: ['src/**']",
    )
    assert decide(pr, "pull_request", "refs/heads/main", ("src/a",))
    assert not decide(pr, "pull_request", "refs/heads/dev", ("src/a",))
    labeled = EventFacts("pull_request", "refs/heads/main", ("src/a",), action="labeled")
    trig = evaluate_trigger(pr, labeled)  # type: ignore[arg-type]
    assert not trig.triggered and "activity 'labeled'" in trig.reason


def test_a_filter_with_no_value_is_there_with_no_patterns(tmp_path: Path) -> None:
    """PyCQA/flake8's main.yml: `push: {branches: [main], tags: }` runs on a
    push to main and on every tag push (GitHub's service runs it; only its
    editor parser refuses the null), never on another branch."""
    main_and_tags = wf(tmp_path, "on:\n  push:\n    branches: [main]\n    tags:\n  pull_request:")
    assert main_and_tags.on["push"] == {"branches": ("main",), "tags": None}  # type: ignore[attr-defined]
    assert decide(main_and_tags, "push", "refs/heads/main")
    assert decide(main_and_tags, "push", "refs/tags/6.1.0")
    assert not decide(main_and_tags, "push", "refs/heads/feature")
    paths = wf(tmp_path, "on:\n  pull_request:\n    paths:\n    types:")
    assert decide(paths, "pull_request", "refs/heads/x", ("a.py",))


def test_filters_of_an_event_that_takes_none_are_ignored(tmp_path: Path) -> None:
    """helm/helm .github/workflows/release.yml: `create: {tags: [v*]}`. GitHub
    takes the file and runs it on every `create`, a branch's too: `create`
    has no filters (nor `types`) to apply."""
    release = wf(tmp_path, "on:\n  create:\n    tags: ['v*']\n    types: [x]\n  push:")
    assert release.on["create"] is None  # type: ignore[attr-defined]
    assert decide(release, "create", "refs/tags/v3.17.0")
    assert decide(release, "create", "refs/heads/feature")
    labeled = EventFacts("create", "refs/heads/feature", (), action="y")
    assert evaluate_trigger(release, labeled) == Trigger(True, "on: create")  # type: ignore[arg-type]


def test_event_names_suggest_the_nearest() -> None:
    check_event_name("push", EVENTS)
    with pytest.raises(UsageError, match="did you mean 'pull_request'"):
        check_event_name("pull-request", EVENTS)
    with pytest.raises(UsageError, match="did you mean 'push'"):
        check_event_name("pusj", EVENTS)


def git(repo: Path, *args: str) -> str:
    ids = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    return subprocess.run(
        ["git", *ids, *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_changed_paths_against_the_merge_base_include_deleted_files(tmp_path: Path) -> None:
    upstream = tmp_path / "upstream.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(upstream)], check=True)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for name in ("keep.txt", "gone.txt", "docs/a.md"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(name)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    git(repo, "remote", "add", "origin", str(upstream))
    git(repo, "push", "-q", "-u", "origin", "main")
    # Committed, staged, unstaged and untracked changes; a deletion.
    git(repo, "rm", "-q", "gone.txt")
    git(repo, "commit", "-q", "-m", "two")
    (repo / "keep.txt").write_text("edited")
    (repo / "new.py").write_text("x")
    (repo / "ignored.log").write_text("x")
    (repo / ".gitignore").write_text("*.log\n")
    local = event_facts(repo, "push")
    assert local.facts.ref == "refs/heads/main"
    assert local.facts.changed_paths == (".gitignore", "gone.txt", "keep.txt", "new.py")
    assert local.base == "@{upstream}"

    deleted_only = wf(tmp_path, "on:\n  push:\n    paths: ['gone.txt']")
    assert evaluate_trigger(deleted_only, local.facts).triggered  # type: ignore[arg-type]

    # --base: counted from the merge base with that revision (here: everything).
    first = git(repo, "rev-list", "--max-parents=0", "HEAD")
    assert event_facts(repo, "push", base=first).merge_base == first
    with pytest.raises(UsageError, match="--base nope"):
        event_facts(repo, "push", base="nope")
    # --ref
    assert event_facts(repo, "push", ref="v1").facts.ref == "refs/heads/v1"
    assert normalize_ref("tags/v1") == "refs/tags/v1"
    assert event_facts(repo, "push", ref="refs/tags/v1").facts.ref == "refs/tags/v1"
    # a pull request's branch filter sees the base branch
    assert event_facts(repo, "pull_request", base="origin/main").facts.ref == "refs/heads/main"
