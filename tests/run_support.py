"""Generated repositories and an engine harness for the run tests."""

from __future__ import annotations

import subprocess
import textwrap
from collections import defaultdict
from pathlib import Path

import anyio

from preloop.control import Lease
from preloop.engine import Engine, EngineEvents, RunOutcome, RunRequest

GIT_ID = ["-c", "user.name=Test", "-c", "user.email=test@example.com"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


def make_repo(root: Path, files: dict[str, str], *, commit: bool = True) -> Path:
    """A git repository with `files` (dedented) committed on branch main."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    if commit:
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "init")
    return root


def workflow(text: str) -> dict[str, str]:
    return {".github/workflows/ci.yml": text}


class Harness:
    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = defaultdict(list)
        self.started: list[str] = []

    def events(self) -> EngineEvents:
        def line(lease: Lease, text: str) -> None:
            self.lines[lease.job_id].append(text)

        def start(lease: Lease) -> None:
            self.started.append(lease.job_id)

        return EngineEvents(on_job_line=line, on_job_start=start)

    def all_text(self) -> str:
        return "\n".join("\n".join(v) for v in self.lines.values())


def run_engine(
    repo: Path, store_url: str, state_dir: Path, **kw: object
) -> tuple[RunOutcome, Harness]:
    h = Harness()
    request = RunRequest(
        workspace=repo,
        store_url=store_url,
        state_dir=state_dir,
        local_runners=kw.pop("local_runners", 2),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    engine = Engine(request, h.events())
    outcome = anyio.run(engine.run)
    return outcome, h


def results(outcome: RunOutcome) -> dict[str, str | None]:
    return {j.id: j.conclusion for j in outcome.jobs}
