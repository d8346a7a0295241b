"""The services' socket listens from the start and the HTTP server (aiohttp)
starts at the first connection: a run whose steps never call the services
never imports it, and one whose `run:` step calls them is served."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.run_support import make_repo

from preloop.engine import _may_call_services
from preloop.workflow import Plan, load_workflow, plan

# In a fresh interpreter, so that whether aiohttp is imported means something.
LISTENER = """
import json, socket, sys, urllib.error, urllib.request
from pathlib import Path
from preloop.services.listener import ServiceListener
from preloop.services.storage import LocalStorage

listener = ServiceListener(LocalStorage(Path(sys.argv[1]), 1 << 30))
listener.start()
print("before", "aiohttp" in sys.modules, listener.serving, flush=True)
if sys.argv[2] == "call":
    req = urllib.request.Request(
        listener.url + "twirp/github.actions.results.api.v1.ArtifactService/ListArtifacts",
        data=b"{}", headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as exc:
        print("status", exc.code, flush=True)
    except OSError as exc:  # urllib wraps a reset met while sending
        print("refused", type(getattr(exc, "reason", exc)).__name__, flush=True)
    print("after", "aiohttp" in sys.modules, listener.serving, flush=True)
    if listener.failure is not None:  # a second caller is turned away too, at once
        try:
            socket.create_connection(("127.0.0.1", listener.port), timeout=60).recv(1)
            print("second", "closed")
        except OSError as exc:
            print("second", type(exc).__name__)
port = listener.port
listener.stop()
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    print("closed", False)
except ConnectionRefusedError:
    print("closed", True)
print("failure", type(listener.failure).__name__)
"""


def _listener(tmp_path: Path, mode: str, prelude: str = "") -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", prelude + LISTENER, str(tmp_path / "state"), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_the_server_starts_at_the_first_connection_and_serves_it(tmp_path: Path) -> None:
    assert _listener(tmp_path, "call") == [
        "before False False",
        "status 401",  # served: a call without a token
        "after True True",
        "closed True",
        "failure NoneType",
    ]


def test_a_listener_nobody_called_never_imports_the_server(tmp_path: Path) -> None:
    assert _listener(tmp_path, "quiet") == ["before False False", "closed True", "failure NoneType"]


def test_a_server_that_cannot_start_resets_the_caller_and_is_reported(tmp_path: Path) -> None:
    # The server module made unimportable: what a broken aiohttp would do.
    blocked = "import sys; sys.modules['preloop.services.server'] = None\n"
    out = _listener(tmp_path, "call", blocked)
    assert out[0] == "before False False"
    # Accepted and closed (a reset or an empty answer), not refused: the port
    # stays bound, and not left waiting.
    closed = ("RemoteDisconnected", "ConnectionResetError", "BrokenPipeError")
    assert out[1] in [f"refused {name}" for name in closed], out
    assert out[2] == "after False False"
    assert out[3] in ("second closed", "second ConnectionResetError"), out
    assert out[4:] == ["closed True", "failure ModuleNotFoundError"]


CALLS_THE_SERVICE = """
import json, os, urllib.request
url, token = os.environ["ACTIONS_RESULTS_URL"], os.environ["ACTIONS_RUNTIME_TOKEN"]
req = urllib.request.Request(
    url + "twirp/github.actions.results.api.v1.ArtifactService/ListArtifacts",
    data=b"{}",
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + token},
)
print("artifacts:", json.load(urllib.request.urlopen(req, timeout=60)))
"""


def _run_imports(repo: Path, state: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env["PRELOOP_STATE_DIR"] = str(state)
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "preloop", "run"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return r, names


def test_a_run_imports_the_server_only_when_a_step_calls_it(tmp_path: Path) -> None:
    quiet = make_repo(
        tmp_path / "quiet",
        {
            ".github/workflows/ci.yml": "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n"
            "    steps:\n      - uses: actions/checkout@v4\n      - run: echo quiet\n"
        },
    )
    r, names = _run_imports(quiet, tmp_path / "state")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "aiohttp" not in names

    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "call.py").write_text(CALLS_THE_SERVICE)
    step = f"python3 {tmp_path / 'calls' / 'call.py'}"
    calls = make_repo(
        tmp_path / "calls" / "repo",
        {
            ".github/workflows/ci.yml": textwrap.dedent(f"""\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                steps:
                  - run: {step}
            """)
        },
    )
    r, names = _run_imports(calls, tmp_path / "state")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "artifacts: {'artifacts': []}" in r.stdout
    assert "aiohttp" in names


def _plans(tmp_path: Path, steps: str, extra: str = "", before: str = "") -> list[Plan]:
    wf = tmp_path / ".github" / "workflows" / "ci.yml"
    wf.parent.mkdir(parents=True, exist_ok=True)
    job = f"  a:\n    runs-on: ubuntu-latest\n{extra}    steps:\n{steps}"
    wf.write_text("on: push\njobs:\n" + before + job)
    return [plan(load_workflow(wf, root=tmp_path), "push")]


def test_the_server_is_imported_ahead_only_for_a_job_that_may_call_it(tmp_path: Path) -> None:
    run = "      - run: echo\n"
    checkout = "      - uses: actions/checkout@v4\n"
    assert not _may_call_services(_plans(tmp_path, checkout + run))
    assert _may_call_services(_plans(tmp_path, checkout + "      - uses: actions/cache@v4\n"))
    assert _may_call_services(_plans(tmp_path, "      - uses: ./.github/actions/mine\n"))
    # A matrix computed at run time: its steps are not known yet.
    setup = (
        "  setup:\n    runs-on: ubuntu-latest\n    outputs:\n      m: ${{ steps.m.outputs.m }}\n"
        "    steps:\n      - id: m\n        run: echo m=[1] >> $GITHUB_OUTPUT\n"
    )
    deferred = (
        "    needs: setup\n    strategy:\n      matrix:\n"
        "        x: ${{ fromJSON(needs.setup.outputs.m) }}\n"
    )
    [p] = _plans(tmp_path, run, deferred, setup)
    assert [j.kind for j in p.jobs] == ["job", "deferred"]
    assert _may_call_services(_plans(tmp_path, run, deferred, setup))
