"""`--sandbox` against the escapes a fault-and-attack review found, under real
bubblewrap, as root and as the unprivileged user `nobody`:

- root kept every capability and could `mount -o remount,rw` the read-only
  state directory and write to it;
- `/var/tmp` and `/dev/shm` were the host's;
- other runs' logs and the lite database were readable;
- host processes were visible and could be signalled.

Each probe runs a shell script inside the sandbox built by
`preloop.runner.sandbox.bubblewrap_argv` for a real job layout (an object
cache entry, a run repository borrowing from it, a job checkout borrowing from
that) and checks from the host afterwards that nothing leaked out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.run_support import git, make_repo, run_engine, workflow

from preloop.runner.sandbox import borrowed_object_dirs, bubblewrap_argv

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

NOBODY = 65534
USERS = ["root", "nobody"]


def _as(user: str) -> list[str]:
    if user == "root":
        return []
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@dataclass
class Layout:
    state: Path
    job: Path
    workspace: Path
    run_repo: Path
    cache: Path
    other_log: Path
    db: Path


def _layout(root: Path, user: str) -> Layout:
    state = root / "state"
    source = make_repo(root / "source", {"hello.txt": "hello from the snapshot\n"})
    cache = state / "snapshot-object-cache" / "k.git"
    cache.parent.mkdir(parents=True)
    git(state, "clone", "-q", "--bare", str(source), str(cache))
    run_repo = state / "snapshots" / "run-1"
    git(state, "clone", "-q", "--bare", "--shared", str(cache), str(run_repo))
    job = state / "work" / "host" / f"{os.getpid()}-1-job-{uuid.uuid4().hex[:6]}"
    job.mkdir(parents=True)
    workspace = job / "workspace"
    git(state, "clone", "-q", "--shared", str(run_repo), str(workspace))
    other_log = state / "logs" / "2" / "other.log"
    other_log.parent.mkdir(parents=True)
    other_log.write_text("other run's secret log line\n")
    db = state / "preloop.db"
    db.write_text("lite database\n")
    if user == "nobody":
        # The job's own directory is the runner's (here nobody's); the rest
        # of the state directory readable by everyone, as a shared host has it.
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(job)], check=True)
        subprocess.run(["chmod", "-R", "a+rX", str(state), str(source)], check=True)
    return Layout(state, job, workspace, run_repo, cache, other_log, db)


@pytest.fixture(params=USERS)
def user(request: pytest.FixtureRequest) -> str:
    if request.param == "nobody" and (os.geteuid() != 0 or shutil.which("setpriv") is None):
        pytest.skip("needs root and setpriv to act as nobody")
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("needs root")
    return str(request.param)


@pytest.fixture
def layout(public_tmp: Path, user: str) -> Layout:
    return _layout(public_tmp, user)


def sandboxed(
    lay: Layout, user: str, script: str, *, network: str = "host"
) -> subprocess.CompletedProcess[str]:
    argv = bubblewrap_argv(lay.job, lay.state, workspace=lay.workspace, network=network)
    if user == "nobody":
        for d in ("tmp", "var-tmp", "home"):
            os.chown(lay.job / d, NOBODY, NOBODY)
    return subprocess.run(
        [*_as(user), *argv, "sh", "-c", script],
        cwd=lay.workspace,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_job_still_works_inside(layout: Layout, user: str) -> None:
    """What the job needs is there: its checkout (objects borrowed through the
    run repository from the cache), a writable workspace, /tmp, HOME."""
    assert borrowed_object_dirs(layout.workspace) == [
        Path(os.path.realpath(layout.run_repo / "objects")),
        Path(os.path.realpath(layout.cache / "objects")),
    ]
    r = sandboxed(
        layout,
        user,
        "cat hello.txt && git log --oneline -1 >/dev/null && git cat-file -p HEAD:hello.txt"
        " && echo w > written.txt && echo t > /tmp/t && echo h > $HOME/h && echo all-ok",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("hello from the snapshot") == 2 and "all-ok" in r.stdout
    assert (layout.workspace / "written.txt").read_text() == "w\n"


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A host directory outside /tmp and /var/tmp that anybody may write to."""
    path = Path("/opt") / f"preloop-sandbox-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_no_capabilities_no_remount_no_write_outside_the_job(
    layout: Layout, user: str, host_dir: Path
) -> None:
    state = layout.state
    r = sandboxed(
        layout,
        user,
        f"""
        grep -E '^Cap(Eff|Prm)' /proc/self/status
        mount -o remount,rw {state} 2>/dev/null && echo REMOUNTED-STATE
        mount -o remount,rw / 2>/dev/null && echo REMOUNTED-ROOT
        umount {state} 2>/dev/null && echo UNMOUNTED-STATE
        touch {state}/escaped 2>/dev/null
        touch {layout.run_repo}/objects/escaped 2>/dev/null && echo WROTE-RUN-REPO
        touch {layout.cache}/objects/escaped 2>/dev/null && echo WROTE-CACHE
        touch {state.parent}/source/escaped 2>/dev/null && echo WROTE-SOURCE
        touch {host_dir}/escaped 2>/dev/null && echo WROTE-HOST
        mount -o remount,rw {host_dir} 2>/dev/null && echo REMOUNTED-HOST
        echo done
        """,
    )
    assert r.returncode == 0, r.stderr
    # A fresh exec (grep) as uid 0 gains nothing back.
    assert "CapEff:\t0000000000000000" in r.stdout
    assert "CapPrm:\t0000000000000000" in r.stdout
    for escape in ("REMOUNTED", "UNMOUNTED", "WROTE-"):
        assert escape not in r.stdout, r.stdout
    assert "done" in r.stdout
    # Whatever root wrote over the hidden state directory stayed in the sandbox.
    assert not (state / "escaped").exists()
    assert not (layout.run_repo / "objects" / "escaped").exists()
    assert not (layout.cache / "objects" / "escaped").exists()
    assert not (state.parent / "source" / "escaped").exists()
    assert not (host_dir / "escaped").exists()


def test_private_var_tmp_and_dev_shm(layout: Layout, user: str) -> None:
    tag = f"preloop-sandbox-{uuid.uuid4().hex[:8]}"
    host_var = Path("/var/tmp") / f"{tag}-host"
    host_shm = Path("/dev/shm") / f"{tag}-host"
    host_var.write_text("host\n")
    host_shm.write_text("host\n")
    try:
        r = sandboxed(
            layout,
            user,
            f"""
            test -e {host_var} && echo SEES-HOST-VAR-TMP
            test -e {host_shm} && echo SEES-HOST-SHM
            echo in > /var/tmp/{tag} && echo in > /dev/shm/{tag} && echo wrote
            """,
        )
        assert r.returncode == 0, r.stderr
        assert "SEES-HOST" not in r.stdout and "wrote" in r.stdout
        assert not (Path("/var/tmp") / tag).exists()
        assert not (Path("/dev/shm") / tag).exists()
    finally:
        host_var.unlink()
        host_shm.unlink()


def test_other_runs_logs_and_the_database_are_hidden(layout: Layout, user: str) -> None:
    r = sandboxed(
        layout,
        user,
        f"""
        cat {layout.other_log} 2>/dev/null && echo READ-OTHER-LOG
        cat {layout.db} 2>/dev/null && echo READ-DB
        ls {layout.state}/logs 2>/dev/null | grep . && echo LISTED-LOGS
        ls {layout.state}/snapshots 2>/dev/null
        echo done
        """,
    )
    assert r.returncode == 0, r.stderr
    assert "READ-" not in r.stdout and "LISTED-LOGS" not in r.stdout
    assert "secret log line" not in r.stdout and "lite database" not in r.stdout
    # Only the job's own run repository is there (read-only, for its objects).
    assert r.stdout.split("done")[0].split() == ["run-1"]


@pytest.fixture
def host_process(user: str) -> Iterator[int]:
    proc = subprocess.Popen([*_as(user), "sleep", "600"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_host_processes_are_invisible_and_unsignalable(
    layout: Layout, user: str, host_process: int
) -> None:
    r = sandboxed(
        layout,
        user,
        f"""
        test -d /proc/{host_process} && echo SEES-HOST-PID
        kill -0 {host_process} 2>/dev/null && echo CAN-SIGNAL
        kill -STOP {host_process} 2>/dev/null && echo STOPPED
        ls /proc | grep -c '^[0-9]'
        echo done
        """,
    )
    assert r.returncode == 0, r.stderr
    for escape in ("SEES-HOST-PID", "CAN-SIGNAL", "STOPPED"):
        assert escape not in r.stdout, r.stdout
    # Only the sandbox's own few processes are visible.
    assert int(r.stdout.split()[-2]) < 10
    with open(f"/proc/{host_process}/status") as fh:
        assert "State:\tS" in fh.read()  # not stopped


def test_network_none_leaves_only_loopback(layout: Layout, user: str) -> None:
    r = sandboxed(
        layout, user, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", network="none"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["lo"]
    host = sandboxed(layout, user, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert host.stdout.split() != ["lo"] or Path("/proc/net/dev").read_text().count(":") == 1


def test_preloop_run_sandbox_end_to_end_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_dir: Path
) -> None:
    """The same escapes from a real `run:` step of a sandboxed run."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(tmp_path / "coord"))
    state = tmp_path / "state"
    old_log = state / "logs" / "99" / "x.log"
    old_log.parent.mkdir(parents=True)
    old_log.write_text("old run\n")
    host = subprocess.Popen(["sleep", "600"])
    try:
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
                          grep '^CapEff' /proc/self/status
                          mount -o remount,rw {state} 2>/dev/null && echo ESCAPE-remount
                          cat {old_log} 2>/dev/null && echo ESCAPE-log
                          test -e {state}/preloop.db && echo ESCAPE-db
                          kill -0 {host.pid} 2>/dev/null && echo ESCAPE-signal
                          touch {tmp_path}/repo/escaped 2>/dev/null && echo ESCAPE-source
                          touch {host_dir}/escaped 2>/dev/null && echo ESCAPE-host
                          echo x > /var/tmp/preloop-e2e-{os.getpid()}
                          git log --oneline -1 >/dev/null && echo checkout-ok
                          py=$(ls -d "$RUNNER_TOOL_CACHE"/Python/3.*/x64 | head -n 1)
                          "$py/bin/pip" --version >/dev/null && echo pip-ok
                          "$py/bin/python" -c "import site, sys; \\
                            open(site.getsitepackages()[0] + '/probe.pth', 'w').close(); \\
                            print('venv-writable', sys.prefix)"
                """
            ),
        )
        outcome, h = run_engine(repo, f"sqlite:///{state / 'preloop.db'}", state, sandbox=True)
    finally:
        host.kill()
        host.wait()
    text = "\n".join(h.lines["boxed"])
    assert outcome.conclusion == "success", text
    assert "CapEff:\t0000000000000000" in text and "checkout-ok" in text
    assert "ESCAPE" not in text, text
    # the job's Pythons are venvs in its own directory, which it may write
    assert "pip-ok" in text and "venv-writable " + str(state / "work") in text, text
    assert not (tmp_path / "repo" / "escaped").exists()
    assert not (host_dir / "escaped").exists()
    assert not Path(f"/var/tmp/preloop-e2e-{os.getpid()}").exists()


def run_boxed_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: str, **kw: object
) -> tuple[str, str]:
    """Runs job `boxed` with `steps` (YAML lines under `steps:`) sandboxed as
    root; its conclusion and log."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(tmp_path / "coord"))
    jobs = "on: push\njobs:\n  boxed:\n    runs-on: ubuntu-latest\n    steps:\n"
    steps = textwrap.indent(textwrap.dedent(steps), " " * 6)
    repo = make_repo(tmp_path / "repo", workflow(jobs + steps))
    state = tmp_path / "state"
    outcome, h = run_engine(repo, f"sqlite:///{state / 'preloop.db'}", state, sandbox=True, **kw)
    return outcome.conclusion, "\n".join(h.lines["boxed"])


def test_sandboxed_job_sees_overrides_node_and_its_own_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--action OWNER/REPO=DIR` and PRELOOP_NODE may live where the sandbox
    hides the host (`/tmp` here): they are bound read-only into it. A step's
    `working-directory` is looked for where the step sees it."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    real_node = shutil.which("node")
    if real_node is None:
        pytest.skip("needs node")
    from preloop.actions.reference import Override

    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(tmp_path / "coord"))
    # A node installation under /tmp whose bin/node is a link elsewhere.
    (tmp_path / "node" / "bin").mkdir(parents=True)
    (tmp_path / "node" / "bin" / "node").symlink_to(real_node)
    monkeypatch.setenv("PRELOOP_NODE", str(tmp_path / "node" / "bin" / "node"))
    composite = tmp_path / "composite"
    composite.mkdir()
    (composite / "hello.sh").write_text("echo hello from the override\n")
    (composite / "action.yml").write_text(
        "name: hello\nruns:\n  using: composite\n  steps:\n"
        '    - run: bash "$GITHUB_ACTION_PATH/hello.sh"\n      shell: bash\n'
    )
    script = tmp_path / "script"
    script.mkdir()
    (script / "index.js").write_text("console.log('hello from node ' + process.version)\n")
    (script / "action.yml").write_text("name: js\nruns:\n  using: node20\n  main: index.js\n")
    conclusion, text = run_boxed_steps(
        tmp_path,
        monkeypatch,
        """\
        - uses: example/hello@v1
        - uses: example/js@v1
        # The sandbox's own /tmp, as a working directory too.
        - run: mkdir -p /tmp/wd-demo && echo made > /tmp/wd-demo/f
        - run: echo "in $PWD $(cat f)"
          working-directory: /tmp/wd-demo
        """,
        action_overrides=(
            Override("example", "hello", None, composite),
            Override("example", "js", None, script),
        ),
    )
    assert conclusion == "success", text
    assert "hello from the override" in text and "hello from node v" in text, text
    assert "in /tmp/wd-demo made" in text, text


def test_sandboxed_job_runs_a_host_tool_installed_under_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool cache links to the host's uv; one installed under /tmp (a
    venv there) is bound into the sandbox, where /tmp is the job's own."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("needs uv (the test extra installs it)")
    prefix = tmp_path / "uvvenv"
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2(uv, prefix / "bin" / "uv")
    monkeypatch.setenv("PATH", f"{prefix / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PRELOOP_TOOL_CACHE_LAYOUT", "always")
    conclusion, text = run_boxed_steps(
        tmp_path,
        monkeypatch,
        """\
        - run: |
            "$(ls -d "$RUNNER_TOOL_CACHE"/uv/*/x86_64)/uv" --version
        """,
    )
    assert conclusion == "success", text
    assert "uv 0." in text, text


def test_sandboxed_matcher_files_under_a_state_directory_in_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state directory under /tmp (PRELOOP_HOME=/tmp/...) is bound at its
    own path over the sandbox's private /tmp: a matcher file there (setup-
    python's in the action cache, one in RUNNER_TEMP) is read where it is,
    not looked for in the private /tmp (`Unable to process command
    '##[add-matcher]...' ... No such file`); one in the private /tmp still is."""
    matcher = (
        '{"problemMatcher": [{"owner": "OWNER", "pattern": '
        '[{"regexp": "^OWNER: (.+)$", "message": 1}]}]}'
    )
    conclusion, text = run_boxed_steps(
        tmp_path,
        monkeypatch,
        f"""\
        - run: |
            echo '{matcher.replace("OWNER", "temp")}' > "$RUNNER_TEMP/m.json"
            echo "::add-matcher::$RUNNER_TEMP/m.json"
            echo '{matcher.replace("OWNER", "own")}' > /tmp/m.json
            echo "::add-matcher::/tmp/m.json"
        - run: |
            echo "temp: in runner temp"
            echo "own: in private tmp"
        """,
    )
    assert str(tmp_path).startswith("/tmp/"), tmp_path
    assert conclusion == "success", text
    assert "temp: in runner temp" in text and "own: in private tmp" in text, text
    assert "Unable to process" not in text, text


def test_sandboxed_jobs_home_local_bin_is_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on GitHub's images, `$HOME/.local/bin` is on PATH: the sandbox's
    HOME, the job's own, not the host's."""
    conclusion, text = run_boxed_steps(
        tmp_path,
        monkeypatch,
        """\
        - run: |
            mkdir -p "$HOME/.local/bin"
            printf '#!/bin/sh\\necho boxed-user-tool\\n' > "$HOME/.local/bin/boxedtool"
            chmod +x "$HOME/.local/bin/boxedtool"
        - run: boxedtool
        """,
    )
    assert conclusion == "success", text
    assert "boxed-user-tool" in text, text


def test_preloop_run_sandbox_end_to_end_as_nobody(public_tmp: Path, host_dir: Path) -> None:
    """`preloop run --sandbox` started by an unprivileged user (bubblewrap in a
    user namespace): the same escapes fail."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as nobody")
    state = public_tmp / "state"
    victim = public_tmp / "victim"  # another local process of nobody's
    repo = make_repo(
        public_tmp / "repo",
        workflow(
            f"""\
            on: push
            jobs:
              boxed:
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      grep '^CapEff' /proc/self/status
                      cat {state}/preloop.db >/dev/null 2>&1 && echo ESCAPE-db
                      ls {state}/logs 2>/dev/null | grep . && echo ESCAPE-logs
                      kill -0 "$(cat {victim})" 2>/dev/null && echo ESCAPE-signal
                      touch {host_dir}/escaped 2>/dev/null && echo ESCAPE-host
                      echo x > /var/tmp/preloop-e2e-nobody-{os.getpid()}
                      git log --oneline -1 >/dev/null && echo checkout-ok
            """
        ),
    )
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(public_tmp)], check=True)
    sleeper = subprocess.Popen([*_as("nobody"), "sleep", "600"])
    victim.write_text(str(sleeper.pid))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(public_tmp),
        "PRELOOP_STATE_DIR": str(state),
        "PRELOOP_COORDINATION_DIR": str(public_tmp / "coord"),
    }
    try:
        proc = subprocess.run(
            [*_as("nobody"), sys.executable, "-m", "preloop", "run", "-j", "1", "--sandbox"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "CapEff:\t0000000000000000" in proc.stdout and "checkout-ok" in proc.stdout
    assert "ESCAPE" not in proc.stdout, proc.stdout
    assert not (host_dir / "escaped").exists()
    assert not Path(f"/var/tmp/preloop-e2e-nobody-{os.getpid()}").exists()
