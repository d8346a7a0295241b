"""The services' guarantees at the HTTP boundary: tokens, scopes, killed uploads,
the legacy cache protocol (GitHub's client), retention, and tool-cache refresh."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.python_support import VERSION, XY, host_python_prefix, tiny_project, tree_state

from preloop.control import open_store
from preloop.runner.checkout import sweep_work_dir, work_dir
from preloop.services import ServiceAccess, job_environment, run_services
from preloop.services.storage import LocalStorage, StorageConflict, StorageError
from preloop.services.tokens import Claims, mint
from preloop.services.toolcache import (
    adopt_job_tools,
    job_tool_cache,
    list_tool_cache,
    refresh_tool_cache,
    setup_action_hint,
)

ROOT = Path(__file__).resolve().parents[1]
ART = "/twirp/github.actions.results.api.v1.ArtifactService/"
CACHE = "/twirp/github.actions.results.api.v1.CacheService/"


@pytest.fixture(params=["disk", "pg"])
def services(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServiceAccess]:
    """The services of a run: on the local disk (lite), or over a PostgreSQL
    store (`StoreStorage`, what `preloop run` and runners use on PostgreSQL)."""
    args = (tmp_path / "state", "/repo/a", "refs/heads/feat", "refs/heads/main")
    if request.param == "disk":
        with run_services(*args) as acc:
            yield acc
        return
    with (
        open_store(request.getfixturevalue("pg_url")) as store,
        run_services(*args, store=store) as acc,
    ):
        yield acc


def _token(acc: ServiceAccess, run: str, repo: str | None = None, ref: str | None = None) -> str:
    claims = Claims(run, "job", repo or acc.repo, ref or acc.ref, acc.default_ref)
    return mint(acc.secret, claims)


def _call(
    acc: ServiceAccess, path: str, body: dict[str, Any], token: str | None
) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        acc.url.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _put(url: str, data: bytes) -> int:
    req = urllib.request.Request(url, data=data, method="PUT")
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _upload_artifact(acc: ServiceAccess, run: str, name: str, data: bytes) -> int:
    token = _token(acc, run)
    status, created = _call(acc, ART + "CreateArtifact", {"name": name, "version": 4}, token)
    assert status == 200, created
    assert _put(created["signedUploadUrl"], data) == 201
    status, done = _call(
        acc, ART + "FinalizeArtifact", {"name": name, "size": str(len(data))}, token
    )
    assert status == 200, done
    return int(done["artifactId"])


def test_a_wrong_token_is_refused(services: ServiceAccess) -> None:
    for token in (None, "not-a-jwt", mint(b"another secret", Claims("1", "j", "r", "x", "y"))):
        status, body = _call(services, ART + "ListArtifacts", {}, token)
        assert status == 401 and body["code"] == "unauthenticated", body
        status, body = _call(services, CACHE + "GetCacheEntryDownloadURL", {"key": "k"}, token)
        assert status == 401
    # a signed URL with its signature changed is refused too
    token = _token(services, "1")
    _, created = _call(services, ART + "CreateArtifact", {"name": "x", "version": 4}, token)
    assert _put(created["signedUploadUrl"].replace("sig=", "sig=0"), b"x") == 403


def test_one_runs_token_never_reads_another_runs_artifacts(services: ServiceAccess) -> None:
    ident = _upload_artifact(services, "1", "secret-stuff", b"PK\x05\x06" + b"\0" * 18)
    other = _token(services, "2")
    status, listed = _call(services, ART + "ListArtifacts", {}, other)
    assert status == 200 and listed == {"artifacts": []}
    status, _ = _call(services, ART + "GetSignedArtifactURL", {"name": "secret-stuff"}, other)
    assert status == 404
    # naming the other run in the request does not help: the token decides
    status, body = _call(
        services, ART + "ListArtifacts", {"workflowRunBackendId": "1", "idFilter": ident}, other
    )
    assert status == 403, body
    status, body = _call(services, ART + "DeleteArtifact", {"name": "secret-stuff"}, other)
    assert status == 404
    status, listed = _call(services, ART + "ListArtifacts", {}, _token(services, "1"))
    assert [a["name"] for a in listed["artifacts"]] == ["secret-stuff"]


def test_a_rerun_token_reads_the_runs_it_reruns_and_writes_only_its_own(
    services: ServiceAccess,
) -> None:
    zip_bytes = b"PK\x05\x06" + b"\0" * 18
    _upload_artifact(services, "1", "dist", zip_bytes)
    _upload_artifact(services, "1", "report", zip_bytes)
    _upload_artifact(services, "3", "unrelated", zip_bytes)
    _upload_artifact(services, "2", "report", zip_bytes)
    claims = Claims("2", "job", services.repo, services.ref, services.default_ref, earlier=("1",))
    token = mint(services.secret, claims)
    status, listed = _call(services, ART + "ListArtifacts", {"workflowRunBackendId": "2"}, token)
    assert status == 200
    # its own `report` first; run 1's `dist`, under an id of its own (ids
    # count per run on disk); run 3 is not one it re-runs
    assert [(a["name"], a["workflowRunBackendId"]) for a in listed["artifacts"]] == [
        ("report", "2"),
        ("dist", "1"),
    ]
    dist = listed["artifacts"][1]["databaseId"]
    body = {"workflowRunBackendId": "2", "idFilter": dist}
    status, by_id = _call(services, ART + "ListArtifacts", body, token)
    assert [a["name"] for a in by_id["artifacts"]] == ["dist"], by_id
    # an earlier attempt's name: refused as GitHub refuses it, until deleted
    # (upload-artifact's `overwrite: true` deletes it first)
    create = {"workflowRunBackendId": "2", "name": "dist", "version": 4}
    assert _call(services, ART + "CreateArtifact", create, token)[0] == 409
    body = {"workflowRunBackendId": "1", "name": "dist"}
    status, signed = _call(services, ART + "GetSignedArtifactURL", body, token)
    assert status == 200 and "/artifact/1/" in signed["signedUrl"], signed
    body = {"workflowRunBackendId": "3", "name": "unrelated"}
    assert _call(services, ART + "GetSignedArtifactURL", body, token)[0] == 403
    for method in ("DeleteArtifact", "CreateArtifact"):
        body = {"workflowRunBackendId": "1", "name": "dist", "version": 4}
        assert _call(services, ART + method, body, token)[0] == 403, method


def _save_cache(acc: ServiceAccess, token: str, key: str, data: bytes) -> None:
    body = {"key": key, "version": "v1"}
    status, created = _call(acc, CACHE + "CreateCacheEntry", body, token)
    assert status == 200 and created["ok"], created
    assert _put(created["signedUploadUrl"], data) == 201
    body["sizeBytes"] = str(len(data))
    status, done = _call(acc, CACHE + "FinalizeCacheEntryUpload", body, token)
    assert done["ok"], done


def test_caches_are_scoped_by_repository_and_ref(services: ServiceAccess) -> None:
    feat = _token(services, "1", ref="refs/heads/feat")
    main = _token(services, "1", ref="refs/heads/main")
    _save_cache(services, feat, "on-feat", b"feat")
    _save_cache(services, main, "on-main", b"main")

    def lookup(token: str, key: str, *restore: str) -> str | None:
        body = {"key": key, "restoreKeys": list(restore), "version": "v1"}
        _, got = _call(services, CACHE + "GetCacheEntryDownloadURL", body, token)
        if not got["ok"]:
            return None
        with urllib.request.urlopen(got["signedDownloadUrl"]) as resp:
            assert resp.read() in (b"feat", b"main")
        return str(got["matchedKey"])

    # a branch reads its own caches and the default branch's ...
    assert lookup(feat, "on-feat") == "on-feat"
    assert lookup(feat, "on-main") == "on-main"
    # (its own ref first, restore keys included, then the default branch)
    assert lookup(feat, "on-x", "on-") == "on-feat"
    # ... the default branch does not read a feature branch's, another branch neither
    assert lookup(main, "on-feat") is None
    assert lookup(main, "on-feat", "on-") == "on-main"
    other = _token(services, "1", ref="refs/heads/other")
    assert lookup(other, "on-feat") is None
    assert lookup(other, "on-feat", "on-") == "on-main"
    # another repository sees none of them
    assert lookup(_token(services, "1", repo="/repo/b"), "on-feat", "on-") is None


def test_a_killed_upload_leaves_nothing_visible(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with run_services(state, "/repo/a", "refs/heads/main", "refs/heads/main") as acc:
        token = _token(acc, "5")
        _, created = _call(acc, ART + "CreateArtifact", {"name": "half", "version": 4}, token)
        url = urllib.request.urlparse(created["signedUploadUrl"])
        # the client dies after 1 MiB of a 10 MiB body
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(
                f"PUT {url.path}?{url.query} HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {10 << 20}\r\n\r\n".encode()
            )
            sock.sendall(b"\1" * (1 << 20))
        _, listed = _call(acc, ART + "ListArtifacts", {}, token)
        assert listed == {"artifacts": []}
        status, body = _call(acc, ART + "FinalizeArtifact", {"name": "half", "size": "1"}, token)
        assert status == 400 and "did not complete" in body["msg"], body
        # a size that does not match what arrived is refused as well
        _, created = _call(acc, ART + "CreateArtifact", {"name": "short", "version": 4}, token)
        assert _put(created["signedUploadUrl"], b"12345") == 201
        status, body = _call(acc, ART + "FinalizeArtifact", {"name": "short", "size": "9"}, token)
        assert status == 400 and "5 bytes were uploaded" in body["msg"], body
        _, listed = _call(acc, ART + "ListArtifacts", {}, token)
        assert listed == {"artifacts": []}
        # a cache upload the client never finalized is not found
        _, created = _call(acc, CACHE + "CreateCacheEntry", {"key": "k", "version": "v"}, token)
        assert _put(created["signedUploadUrl"], b"tar") == 201
        _, got = _call(acc, CACHE + "GetCacheEntryDownloadURL", {"key": "k", "version": "v"}, token)
        assert got["ok"] is False
    # stopping the service removes what the dead uploads left
    run_dir = state / "artifacts" / "5"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", ".uploads"]
    assert list((run_dir / ".uploads").iterdir()) == []
    assert [p.name for p in (state / "actions-cache" / "blobs").iterdir()] == []
    assert LocalStorage(state).cache_entries() == []


def test_legacy_cache_protocol_with_githubs_client(tmp_path: Path, services: ServiceAccess) -> None:
    """actions/cache v3 and @actions/cache without ACTIONS_CACHE_SERVICE_V2:
    the REST protocol at ACTIONS_CACHE_URL (reserve, PATCH chunks, commit)."""
    work = tmp_path / "w"
    (work / "deps").mkdir(parents=True)
    (work / "deps" / "blob").write_bytes(os.urandom(3 << 20))
    env = {
        **os.environ,
        **job_environment(tmp_path / "state", services, "1", "job"),
        "NODE_PATH": str(ROOT / "node_modules"),
        "RUNNER_TEMP": str(tmp_path),
        "GITHUB_WORKSPACE": str(work),
    }
    del env["ACTIONS_CACHE_SERVICE_V2"]
    script = ROOT / "tests" / "js" / "services" / "cache.cjs"
    ops = ["restore:v3-1,v3-:deps", "save:v3-1:deps", "restore:v3-2,v3-:deps"]
    out = subprocess.run(
        ["node", str(script), *ops], cwd=work, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "restore v3-1,v3- -> miss" in out.stdout
    assert "save v3-1 -> 1" in out.stdout and "Cache service version: v1" in out.stdout
    assert "restore v3-2,v3- -> v3-1" in out.stdout


def test_artifacts_removed_after_the_retention_days(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for run in ("1", "2"):
        storage.create_artifact(run, "j", "a", None)
    old = tmp_path / "artifacts" / "1"
    for p in [old, *old.rglob("*")]:
        os.utime(p, (time.time() - 10 * 86400,) * 2)
    assert storage.remove_expired_artifacts(0) == []
    assert storage.remove_expired_artifacts(30) == []
    assert storage.remove_expired_artifacts(7) == ["1"]
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["2"]


def test_cache_entries_are_immutable(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.reserve_cache("r", "refs/heads/main", "k", "v")
    with pytest.raises(StorageConflict):
        storage.reserve_cache("r", "refs/heads/main", "k", "v")
    storage.reserve_cache("r", "refs/heads/other", "k", "v")  # another ref: its own entry


def test_tool_cache_follows_the_host(tmp_path: Path) -> None:
    """A toolchain that appears is laid out (links, the .complete marker); one
    that disappears is removed; what an action installed itself stays."""
    real = Path(sys.executable).resolve()
    version = subprocess.run(
        [str(real), "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = {"PATH": str(bindir), "HOME": str(tmp_path / "home")}
    root = tmp_path / "toolcache"
    installed = root / "Python" / "3.99.0" / "x64"
    installed.mkdir(parents=True)
    (root / "Python" / "3.99.0" / "x64.complete").write_text("")

    assert [(e.tool, e.version) for e in refresh_tool_cache(root, env)] == [("Python", "3.99.0")]
    (bindir / "python3").symlink_to(real)
    entries = refresh_tool_cache(root, env)
    assert [(e.version, e.origin) for e in entries] == [("3.99.0", "installed"), (version, "host")]
    laid = root / "Python" / version / "x64"
    assert (root / "Python" / version / "x64.complete").exists()
    assert (laid / "bin" / "python").resolve() == real or laid.resolve() == real.parent.parent
    probe = subprocess.run(
        [str(laid / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == str(tuple(int(x) for x in version.split(".")[:2]))
    (bindir / "python3").unlink()
    assert [(e.version, e.origin) for e in refresh_tool_cache(root, env)] == [
        ("3.99.0", "installed")
    ]
    assert not (root / "Python" / version).exists()
    assert list_tool_cache(root)[0].path == str(installed)


def _site(prefix: Path) -> Path:
    return prefix / "lib" / f"python{XY}" / "site-packages"


def _run(python: Path, *args: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [str(python), *args], capture_output=True, text=True, env=env, cwd=python.parent
    )
    assert out.returncode == 0, f"{python} {args}: {out.stderr}"
    return out.stdout


@pytest.mark.parametrize("kind", ["pyenv", "system"])
def test_a_jobs_pythons_are_throwaway_venvs_over_the_hosts(tmp_path: Path, kind: str) -> None:
    """Each job's tool cache holds its own venv over each host Python: pip
    (`python -m pip`, `pip`, `-e`, a wheel, pip itself) installs there, later
    steps of the job see it, the next job does not, and the host's
    interpreter stays byte for byte as it was; a distribution's
    EXTERNALLY-MANAGED interpreter installs too. Other tools are links to the
    shared cache; a job directory a dead runner left is swept with its venvs
    and nothing else."""
    prefix = host_python_prefix(tmp_path / "pyenv", system=kind == "system")
    bindir, home = tmp_path / "bin", tmp_path / "home"
    bindir.mkdir()
    env = {
        "PATH": str(bindir),
        "HOME": str(home),
        "PYENV_ROOT": str(tmp_path / ("pyenv" if kind == "pyenv" else "none")),
        "UV_PYTHON_INSTALL_DIR": str(tmp_path / "none"),
    }
    if kind == "system":  # found on PATH like /usr/bin/python3.X
        (bindir / f"python{XY}").symlink_to(prefix / "bin" / f"python{XY}")
    shared = tmp_path / "toolcache"
    (shared / "node" / "99.0.0" / "x64").mkdir(parents=True)
    (shared / "node" / "99.0.0" / "x64.complete").write_text("")
    listed = refresh_tool_cache(shared, env)
    assert [(e.tool, e.version, e.origin) for e in listed if e.tool == "Python"] == [
        ("Python", VERSION, "host")
    ]
    # A distribution the user installed in that interpreter, with a console
    # script (as pytest has): installed there, it is "already satisfied" for
    # a job's pip, which then writes no script of its own.
    site = _site(prefix)
    (site / "hello.py").write_text("import sys\ndef main():\n    print('hello', sys.prefix)\n")
    dist = site / "hello-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[console_scripts]\nhello = hello:main [extra]\n\n[other]\nnot-a-script = hello:main\n"
    )
    (dist / "RECORD").write_text("hello.py,,\nhello-1.0.dist-info/RECORD,,\n")
    before = tree_state(prefix)
    state = tmp_path / "state"
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    first = job_tool_cache(shared, work_dir(state) / f"{dead.stdout.strip()}-1-a-x" / "tool")
    second = job_tool_cache(shared, work_dir(state) / f"{os.getpid()}-1-b-y" / "tool")
    assert (first / "node").resolve() == (shared / "node").resolve()
    assert [(e.tool, e.version) for e in list_tool_cache(first)] == [
        ("node", "99.0.0"),
        ("Python", VERSION),
    ]
    hint = setup_action_hint(first, "actions/setup-python@v5", {"python-version": "2.0"})
    assert hint is not None and f"the tool cache ({shared})" in hint
    venv = first / "Python" / VERSION / "x64"
    assert (first / "Python" / VERSION / "x64.complete").exists()
    cfg = (venv / "pyvenv.cfg").read_text()
    assert f"home = {prefix / 'bin'}\n" in cfg and "include-system-site-packages = true\n" in cfg
    python, pip = venv / "bin" / "python", venv / "bin" / "pip"
    # Bytecode the interpreter would cache beside the base's own modules it
    # runs (pip's) is no install: left out, so the base compares byte for byte.
    run_env = {
        **os.environ,
        "HOME": str(home),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if kind == "system":
        refused = subprocess.run(
            [str(prefix / "bin" / f"python{XY}"), "-m", "pip", "install", "--no-index", "x"],
            capture_output=True,
            text=True,
            env=run_env,
        )
        assert "externally-managed-environment" in refused.stderr, refused.stderr
    # the base's pip, run by the venv's python
    assert f"from {_site(prefix)}/pip (python {XY})" in _run(pip, "--version", env=run_env)
    projects = tmp_path / "projects"
    tiny, other = tiny_project(projects / "tiny", "tiny"), tiny_project(projects / "other", "other")
    no_index = ["--no-index", "--no-build-isolation"]
    _run(python, "-m", "pip", "install", *no_index, "-e", str(tiny), env=run_env)
    _run(pip, "wheel", *no_index, "-w", str(projects / "dist"), str(other), env=run_env)
    wheel = projects / "dist" / "other-1.0-py3-none-any.whl"
    _run(venv / "bin" / f"pip{XY}", "install", "--no-index", str(wheel), env=run_env)
    probe = "import sys, tiny, other; print(sys.prefix, tiny.VALUE, other.VALUE)"
    assert _run(python, "-c", probe, env=run_env).split() == [str(venv), "tiny", "other"]
    assert _run(pip, "cache", "dir", env=run_env).strip() == str(home / ".cache" / "pip")
    if kind == "pyenv":
        # the base's console scripts, run by the venv's python
        assert _run(venv / "bin" / "hello", env=run_env).split() == ["hello", str(venv)]
        assert not (venv / "bin" / "not-a-script").exists()
        # `python -m pip install --upgrade pip` puts a pip of its own in the venv
        bundled = prefix / "lib" / f"python{XY}" / "ensurepip" / "_bundled"
        upgrade = ["--upgrade", "--force-reinstall", "--no-index", "--find-links", str(bundled)]
        _run(python, "-m", "pip", "install", *upgrade, "pip", env=run_env)
        assert f"from {_site(venv)}/pip (python {XY})" in _run(pip, "--version", env=run_env)
        # and `python -m venv` makes a venv of its own
        _run(python, "-m", "venv", "--without-pip", str(tmp_path / "inner"), env=run_env)
        inner = tmp_path / "inner" / "bin" / "python"
        assert _run(inner, "-c", "import sys; print(sys.prefix)", env=run_env).strip() == str(
            tmp_path / "inner"
        )
        # setup-python's LD_LIBRARY_PATH and PKG_CONFIG_PATH, and python-config, still answer
        assert sorted(p.name for p in (venv / "lib").iterdir()) == sorted(
            p.name for p in (prefix / "lib").iterdir()
        )
        config = venv / "bin" / f"python{XY}-config"
        if config.exists():
            includes = subprocess.run([str(config), "--includes"], capture_output=True, text=True)
            assert (Path(includes.stdout.split()[0].removeprefix("-I")) / "Python.h").is_file()
    else:  # a system interpreter's scripts are the system's, on PATH already
        assert not (venv / "bin" / "hello").exists()
    # the next job starts from the host's interpreter as it is
    venv2 = second / "Python" / VERSION / "x64"
    fresh = subprocess.run(
        [str(venv2 / "bin" / "python"), "-c", "import tiny"], capture_output=True, text=True
    )
    assert "No module named 'tiny'" in fresh.stderr
    assert f"from {_site(prefix)}/pip " in _run(venv2 / "bin" / "pip", "--version", env=run_env)
    _run(venv2 / "bin" / "pip", "install", "--user", "--no-index", str(wheel), env=run_env)
    user = _run(venv2 / "bin" / "python", "-c", "import other; print(other.__file__)", env=run_env)
    assert user.startswith(str(home / ".local"))
    assert tree_state(prefix) == before
    # a dead runner's job directory goes, with its venvs, and nothing they link to
    assert [p.name for p in sweep_work_dir(state)] == [first.parent.name]
    assert tree_state(prefix) == before
    assert list_tool_cache(shared) == listed
    assert (second / "Python" / VERSION / "x64.complete").exists()


def test_what_setup_python_downloads_in_a_job_reaches_the_next_job(tmp_path: Path) -> None:
    """A Python that setup-python installs in a job's own tool cache (as
    @actions/tool-cache's cacheDir does: `<arch>/`, then `<arch>.complete`),
    and a PyPy whose tool directory the shared cache did not have, are moved
    into the shared cache when the job ends: the next job gets a venv over
    that Python, its pip script runs from there, and a refresh keeps both.
    A download without its marker, one the shared cache has already, and a
    job's venv stay in the job."""
    env = {"PATH": "", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "none")}
    env["UV_PYTHON_INSTALL_DIR"] = str(tmp_path / "none")
    shared = tmp_path / "toolcache"
    refresh_tool_cache(shared, env)  # no Python on this host
    first = job_tool_cache(shared, tmp_path / "jobs" / "1" / "tool")
    assert not (first / "Python").is_symlink() and not (first / "PyPy").exists()
    # the download: a real interpreter prefix, with pip's script naming it where it is
    entry = first / "Python" / VERSION / "x64"
    entry.parent.mkdir(parents=True)
    host_python_prefix(tmp_path / "dl").rename(entry)
    (entry / "bin" / "pip").write_text(
        f"#!{entry}/bin/python{XY}\nimport runpy\nrunpy.run_module('pip', run_name='__main__')\n"
    )
    (entry.parent / "x64.complete").write_text("")
    (first / "Python" / "3.98.0" / "x64" / "bin").mkdir(parents=True)  # interrupted: no marker
    pypy = first / "PyPy" / "7.3.17" / "x64"
    (pypy / "bin").mkdir(parents=True)
    (pypy / "bin" / "pypy3").write_text("pypy\n")
    (pypy.parent / "x64.complete").write_text("")

    assert adopt_job_tools(first) == ["PyPy/7.3.17/x64", f"Python/{VERSION}/x64"]
    assert adopt_job_tools(first) == []  # nothing left to move
    assert (first / "Python" / "3.98.0" / "x64").is_dir()
    assert not (shared / "Python" / "3.98.0").exists()
    assert (shared / "PyPy" / "7.3.17" / "x64" / "bin" / "pypy3").read_text() == "pypy\n"
    installed = [(e.tool, e.version, e.origin) for e in refresh_tool_cache(shared, env)]
    assert ("Python", VERSION, "installed") in installed
    assert ("PyPy", "7.3.17", "installed") in installed
    adopted = shared / "Python" / VERSION / "x64"
    run_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    assert f"{_site(adopted)}/pip " in _run(adopted / "bin" / "pip", "--version", env=run_env)

    second = job_tool_cache(shared, tmp_path / "jobs" / "2" / "tool")
    venv = second / "Python" / VERSION / "x64"
    base = _run(venv / "bin" / "python", "-c", "import sys; print(sys.base_prefix)", env=run_env)
    assert base.strip() == str(adopted)
    assert (second / "PyPy").resolve() == shared / "PyPy"
    # a second download of what the shared cache has stays in its job
    again = second / "Python" / "3.98.0" / "x64"
    again.mkdir(parents=True)
    (again.parent / "x64.complete").write_text("")
    (shared / "Python" / "3.98.0" / "x64").mkdir(parents=True)
    assert adopt_job_tools(second) == []
    assert again.is_dir() and not (shared / "Python" / "3.98.0" / "x64.complete").exists()
    # the job's venv over an entry removed meanwhile is no install
    shutil.rmtree(shared / "Python" / VERSION)
    assert adopt_job_tools(second) == []
    assert not (shared / "Python" / VERSION).exists() and (venv / "pyvenv.cfg").exists()


#: A process adopting a job's downloads that dies (exit 3) at `argv[2]`:
#: `_relocate_scripts` (after the move) or `rename` (before it).
CUT_SHORT = """
import os, sys
from pathlib import Path
import preloop.services.toolcache as toolcache

def die(*args, **kwargs):
    os._exit(3)

if sys.argv[2] == "rename":
    toolcache.os.rename = die
else:
    setattr(toolcache, sys.argv[2], die)
toolcache.adopt_job_tools(Path(sys.argv[1]))
"""


def _download(job: Path, tool: str, version: str) -> Path:
    """What @actions/tool-cache's cacheDir leaves: `<arch>/` with a script
    naming it where it is, then `<arch>.complete`."""
    entry = job / tool / version / "x64"
    (entry / "bin").mkdir(parents=True)
    (entry / "bin" / "tool").write_text(f"#!{entry}/bin/interpreter\nprint()\n")
    (entry.parent / "x64.complete").write_text("")
    return entry


def test_an_adoption_cut_short_is_finished_or_undone_later(tmp_path: Path) -> None:
    """A runner killed while it moves a job's download into the shared tool
    cache leaves a note beside the entry: the next refresh finishes an entry
    already moved (its scripts relocated, its marker written), and one killed
    before the move leaves the download in its job for the next adoption."""
    env = {"PATH": "", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "none")}
    env["UV_PYTHON_INSTALL_DIR"] = str(tmp_path / "none")
    shared = tmp_path / "toolcache"
    refresh_tool_cache(shared, env)
    first = job_tool_cache(shared, tmp_path / "jobs" / "1" / "tool")
    _download(first, "PyPy", "7.3.90")
    killed = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(first), "_relocate_scripts"], check=False
    )
    assert killed.returncode == 3
    moved = shared / "PyPy" / "7.3.90" / "x64"
    assert moved.is_dir() and not (moved.parent / "x64.complete").exists()
    assert [e.version for e in list_tool_cache(shared) if e.tool == "PyPy"] == []
    refresh_tool_cache(shared, env)
    assert (moved.parent / "x64.complete").exists()
    assert (moved / "bin" / "tool").read_text().startswith(f"#!{moved}/bin/interpreter\n")
    assert [e.version for e in list_tool_cache(shared) if e.tool == "PyPy"] == ["7.3.90"]
    assert not list((shared / ".preloop-adopting").iterdir())

    second = job_tool_cache(shared, tmp_path / "jobs" / "2" / "tool")
    left = _download(second, "GraalPy", "24.1.0")
    killed = subprocess.run([sys.executable, "-c", CUT_SHORT, str(second), "rename"], check=False)
    assert killed.returncode == 3
    assert left.is_dir() and list((shared / ".preloop-adopting").iterdir())
    assert adopt_job_tools(second) == ["GraalPy/24.1.0/x64"]
    assert not list((shared / ".preloop-adopting").iterdir())
    assert [e.version for e in list_tool_cache(shared) if e.tool == "GraalPy"] == ["24.1.0"]


def _dist_with_script(site: Path, name: str) -> None:
    """A distribution installed in `site` whose console script `name` prints
    the prefix of the python running it."""
    (site / f"{name}_mod.py").write_text("import sys\ndef main():\n    print(sys.prefix)\n")
    dist = site / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[console_scripts]\n{name} = {name}_mod:main\n")


def test_a_distribution_installed_on_the_host_later_gets_its_script(tmp_path: Path) -> None:
    """Each base's entry points are read once while its site-packages stays
    as it is; one installed there later is in the venvs of the jobs after."""
    prefix = host_python_prefix(tmp_path / "pyenv")
    env = {"PATH": "", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "pyenv")}
    env["UV_PYTHON_INSTALL_DIR"] = str(tmp_path / "none")
    shared = tmp_path / "toolcache"
    refresh_tool_cache(shared, env)
    _dist_with_script(_site(prefix), "early")
    first = job_tool_cache(shared, tmp_path / "jobs" / "1") / "Python" / VERSION / "x64"
    assert (first / "bin" / "early").exists() and not (first / "bin" / "late").exists()
    _dist_with_script(_site(prefix), "late")
    second = job_tool_cache(shared, tmp_path / "jobs" / "2") / "Python" / VERSION / "x64"
    assert _run(second / "bin" / "late", env=dict(os.environ)).strip() == str(second)


def test_versioned_installer_scripts_are_the_venvs_own(tmp_path: Path) -> None:
    """pip's and setuptools' entry points name the Python their wheel was
    built with (pyenv's 3.10 has pip's `pip3.9`): as pip's own installer
    does, those are not written; the venv's `pipX.Y` is its own version."""
    prefix = host_python_prefix(tmp_path / "pyenv")
    env = {"PATH": "", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "pyenv")}
    env["UV_PYTHON_INSTALL_DIR"] = str(tmp_path / "none")
    shared = tmp_path / "toolcache"
    refresh_tool_cache(shared, env)
    dist = _site(prefix) / "oldtools-1.0.dist-info"
    dist.mkdir()
    (dist / "entry_points.txt").write_text(
        "[console_scripts]\npip3.9 = pip._internal.cli.main:main\n"
        "easy_install-3.8 = setuptools.command.easy_install:main\n"
        "easy_install = setuptools.command.easy_install:main\n"
    )
    bindir = job_tool_cache(shared, tmp_path / "job") / "Python" / VERSION / "x64" / "bin"
    assert sorted(p.name for p in bindir.glob("pip*")) == ["pip", "pip3", f"pip{XY}"]
    assert [p.name for p in bindir.glob("easy_install*")] == ["easy_install"]


@pytest.mark.parametrize("kind", ["pyenv", "system"])
def test_the_python_on_path_resolves_into_the_jobs_venv(tmp_path: Path, kind: str) -> None:
    """On GitHub the tool cache Python is a real install: a tool that
    resolves `python3` on PATH with realpath and reads
    `../lib/pythonX.Y/site-packages` beside it (zuban does) finds what the
    job installed. The job's venv has the interpreter's binary itself (a hard
    link or a copy), so that path stays in the venv, and it still runs as it."""
    prefix = host_python_prefix(tmp_path / "pyenv", system=kind == "system")
    env = {"PATH": "", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "pyenv")}
    env["UV_PYTHON_INSTALL_DIR"] = str(tmp_path / "none")
    if kind == "system":
        env["PATH"] = str(prefix / "bin")
    shared = tmp_path / "toolcache"
    refresh_tool_cache(shared, env)
    venv = job_tool_cache(shared, tmp_path / "job") / "Python" / VERSION / "x64"
    installed = venv / "lib" / f"python{XY}" / "site-packages" / "installed_by_job.py"
    installed.write_text("")
    for name in ("python", "python3", f"python{XY}"):
        real = Path(os.path.realpath(venv / "bin" / name))
        assert real.parent.parent == venv, f"{name} -> {real}"
        assert (real.parent.parent / installed.relative_to(venv)).exists()
    out = _run(venv / "bin" / "python3", "-c", _PREFIXES, env=dict(os.environ)).split()
    assert out == [str(venv), str(prefix), "True"]


_PREFIXES = (
    "import sys, os, installed_by_job; "
    "print(sys.prefix, sys.base_prefix, os.path.exists(sys._base_executable))"
)


def _old_python() -> Path | None:
    """A CPython before 3.11 on this host (pyenv's), or None."""
    versions = Path(os.path.expanduser("~/.pyenv/versions"))
    for exe in sorted(versions.glob("3.*/bin/python3")):
        out = subprocess.run(
            [str(exe), "-c", "import sys; print(sys.version_info < (3, 11))"],
            capture_output=True,
            text=True,
        )
        if out.stdout.strip() == "True":
            return exe.parent.parent
    return None


def test_a_venv_made_in_a_job_outlives_the_job(tmp_path: Path) -> None:
    """Before 3.11, `python -m venv` run by a venv's python points the new
    venv's `home` at that venv: a `.venv` a job makes (kept with
    actions/cache, or under $HOME) must point at the base interpreter, not
    into the job's directory, which goes with the job."""
    base = _old_python()
    if base is None:
        pytest.skip("no CPython before 3.11 under ~/.pyenv/versions")
    version = base.name
    shared = tmp_path / "shared"
    (shared / "Python" / version).mkdir(parents=True)
    (shared / "Python" / version / "x64").symlink_to(base)
    (shared / "Python" / version / "x64.complete").write_text("")
    job = job_tool_cache(shared, tmp_path / "job" / "tool")
    kept = tmp_path / "kept-venv"
    python = job / "Python" / version / "x64" / "bin" / "python"
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(kept)], check=True)
    shutil.rmtree(tmp_path / "job")  # the job ended
    out = subprocess.run(
        [str(kept / "bin" / "python"), "-c", "print('alive')"], capture_output=True
    )
    assert out.stdout.strip() == b"alive", (kept / "pyvenv.cfg").read_text()


def test_setup_action_hint_names_the_versions_the_host_has(tmp_path: Path) -> None:
    root = tmp_path / "tc"
    for version in ("3.12.1", "3.11.7"):
        (root / "Python" / version / "x64").mkdir(parents=True)
        (root / "Python" / version / "x64.complete").write_text("")
    hint = setup_action_hint(root, "actions/setup-python@v5", {"python-version": "3.9"})
    assert hint is not None and "no Python matching '3.9'" in hint
    assert "Python 3.12.1, 3.11.7" in hint and "pyenv install 3.9" in hint
    for spec in ("3.11", "3.x", "3", "3.12.1"):
        assert setup_action_hint(root, "actions/setup-python@v5", {"python-version": spec}) is None
    assert setup_action_hint(root, "actions/setup-python@v5", {}) is None
    # readme_renderer's `check-latest: true` failed offline on the versions
    # manifest (getaddrinfo ENOTFOUND) with no word on the host's 3.12.1.
    latest = {"python-version": "3.12", "check-latest": "true"}
    hint = setup_action_hint(root, "actions/setup-python@v7", latest)
    assert hint is not None and "`check-latest: true` asks the network" in hint
    assert "has Python 3.12.1" in hint
    latest["check-latest"] = "false"
    assert setup_action_hint(root, "actions/setup-python@v7", latest) is None
    # sqlalchemy's `architecture: arm64` on an x64 host: that one is missing.
    arm = {"python-version": "3.12", "architecture": "arm64"}
    hint = setup_action_hint(root, "actions/setup-python@v7", arm)
    assert hint is not None and "no arm64 Python matching '3.12'" in hint, hint
    assert "Python 3.12.1 (x64), 3.11.7 (x64)" in hint and "runs on an arm64 host" in hint
    arm["architecture"] = "x64"
    assert setup_action_hint(root, "actions/setup-python@v7", arm) is None
    assert setup_action_hint(root, "actions/cache@v4", {"python-version": "3.9"}) is None
    node = setup_action_hint(root, "actions/setup-node@v4", {"node-version": "22"})
    assert node is not None and "has no node at all" in node and "ask for one" not in node
    assert "node 22 first on PATH" in node and "pyenv" not in node
    go = setup_action_hint(root, "actions/setup-go@v5", {"go-version": "1.22"})
    assert go is not None and "Go 1.22 toolchain" in go
    uv = setup_action_hint(root, "astral-sh/setup-uv@v6", {"version": "0.5.1"})
    assert uv is not None and "uv==0.5.1" in uv
    wild = setup_action_hint(root, "actions/setup-python@v5", {"python-version": "2.x"})
    assert wild is not None and "`uv python install 2`" in wild


def test_setup_action_hint_reads_setup_pythons_dev_free_threaded_and_pypy_forms(
    tmp_path: Path,
) -> None:
    """tomli's `3.15-dev`, fastapi's `3.14t`, arrow's `pypy-3.11`: a failed
    setup-python asking for one the host lacks said only `getaddrinfo
    ENOTFOUND` (no hint: the spec was no plain version)."""
    root = tmp_path / "tc"
    for version in ("3.14.0", "3.13.1"):
        (root / "Python" / version / "x64").mkdir(parents=True)
        (root / "Python" / version / "x64.complete").write_text("")

    def hint(spec: str) -> str | None:
        return setup_action_hint(root, "actions/setup-python@v6", {"python-version": spec})

    dev = hint("3.15-dev")
    assert dev is not None and "no Python matching '3.15-dev'" in dev
    assert "Python 3.14.0, 3.13.1" in dev and "pyenv install 3.15" in dev
    assert hint("3.14-dev") is None  # there: the step failed for another reason
    ft = hint("3.14t")
    assert ft is not None and "no free-threaded Python matching '3.14t'" in ft
    assert "uv python install 3.14t" in ft
    for spec in ("pypy3.11", "pypy-3.11", "graalpy-24.2"):
        other = hint(spec)
        assert other is not None and f"matching {spec!r}" in other, spec
    assert "has no PyPy at all" in (hint("pypy3.11") or "")
    # installing one on the host would not help: only setup-python's download does
    assert "downloads PyPy itself" in (hint("pypy-3.10") or "")
    assert "Install" not in (hint("pypy-3.10") or "")
    assert "downloads GraalPy itself" in (hint("graalpy-24.2") or "")
    (root / "PyPy" / "7.3.20" / "x64").mkdir(parents=True)
    (root / "PyPy" / "7.3.20" / "x64.complete").write_text("")
    assert hint("pypy3.11") is None  # which Python a PyPy is: not told by its directory
    # A free-threaded build alone does not meet a plain version (review).
    (root / "Python" / "3.15.0" / "x64-freethreaded").mkdir(parents=True)
    (root / "Python" / "3.15.0" / "x64-freethreaded.complete").write_text("")
    assert hint("3.15t") is None
    plain = hint("3.15")
    assert plain is not None and "no Python matching '3.15'" in plain


def test_uploads_of_a_dead_service_are_swept_a_day_later(tmp_path: Path) -> None:
    dead = LocalStorage(tmp_path)
    dead.create_artifact("3", "j", "a", None)
    dead.reserve_cache("r", "refs/heads/main", "k", "v")
    # the process dies: nothing closes `dead`
    leftovers = [
        *tmp_path.glob("artifacts/3/.uploads/*"),
        *tmp_path.glob("actions-cache/uploads/*"),
    ]
    assert leftovers
    fresh = LocalStorage(tmp_path)
    assert fresh.sweep_abandoned_uploads() == 0  # too young: maybe a live service's
    for p in leftovers:
        os.utime(p, (time.time() - 2 * 86400,) * 2)
    assert fresh.sweep_abandoned_uploads(older_than=86400) == len(leftovers)
    assert list(tmp_path.glob("artifacts/3/.uploads/*")) == []
    assert list(tmp_path.glob("actions-cache/uploads/*")) == []


def test_an_artifact_goes_when_its_retention_days_pass(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for name, expires in (("short", "2026-01-01T00:00:00.000Z"), ("kept", None)):
        upload = storage.create_artifact("4", "j", name, expires)
        target = storage._uploads[upload].target
        target.write_bytes(b"zip")
        storage.finalize_artifact("4", "j", name, 3, "")
    now = time.mktime((2026, 6, 1, 0, 0, 0, 0, 0, 0))
    assert storage.remove_expired_artifacts(0, now=now) == []
    assert [r.name for r in storage.list_artifacts("4")] == ["kept"]


def _cache_client(tmp_path: Path, acc: ServiceAccess, ref: str, *ops: str, v2: bool = True) -> str:
    """GitHub's @actions/cache in a job on `ref` (tests/js/services/cache.cjs):
    the lines it prints, one per operation (its debug lines left out)."""
    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    # only a pull request's run has a base branch
    base = acc.base_ref if ref.startswith("refs/pull/") else ""
    scoped = dataclasses.replace(acc, ref=ref, base_ref=base)
    env = {
        **os.environ,
        **job_environment(tmp_path / "state", scoped, "1", "job"),
        "NODE_PATH": str(ROOT / "node_modules"),
        "RUNNER_TEMP": str(tmp_path),
        "GITHUB_WORKSPACE": str(work),
    }
    if not v2:
        del env["ACTIONS_CACHE_SERVICE_V2"]
    script = ROOT / "tests" / "js" / "services" / "cache.cjs"
    out = subprocess.run(
        ["node", str(script), *ops], cwd=work, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return "\n".join(ln for ln in out.stdout.splitlines() if ln.startswith(("save ", "restore ")))


def test_a_pull_request_reads_its_base_branchs_caches(tmp_path: Path) -> None:
    """GitHub's order: the run's own ref, the pull request's base branch, the
    default branch; in each, the exact key, the key as a prefix, then each
    restore key (newest first). Both protocols, with GitHub's client."""
    pr, base, main = "refs/pull/1/merge", "refs/heads/feat", "refs/heads/main"
    (tmp_path / "w" / "deps").mkdir(parents=True)
    (tmp_path / "w" / "deps" / "f").write_text("x")
    with run_services(tmp_path / "state", "/repo/a", pr, main, base) as acc:
        _cache_client(tmp_path, acc, base, "save:pfx-feat:deps", "save:only-feat:deps")
        # saved after the base branch's: the newest under the prefix, but read last
        _cache_client(tmp_path, acc, main, "save:pfx-main:deps", "save:only-main:deps")
        _cache_client(tmp_path, acc, pr, "save:deps-linux-1:deps", "save:other-1:deps")
        for v2 in (True, False):
            out = _cache_client(
                tmp_path,
                acc,
                pr,
                "restore:only-feat:deps",
                "restore:only-main:deps",
                "restore:pfx-:deps",
                "restore:deps-linux,other-:deps",
                "restore:nothing,only-:deps",
                v2=v2,
            )
            assert out.splitlines() == [
                "restore only-feat -> only-feat",
                "restore only-main -> only-main",
                "restore pfx- -> pfx-feat",  # the key as a prefix, base branch first
                "restore deps-linux,other- -> deps-linux-1",  # the key before restore-keys
                "restore nothing,only- -> only-feat",
            ], (v2, out)
        # a push to another branch reads only its own caches and the default branch's
        out = _cache_client(tmp_path, acc, "refs/heads/x", "restore:pfx-:deps")
        assert out == "restore pfx- -> pfx-main"


def test_blocks_commit_in_list_order_whatever_order_they_arrived(tmp_path: Path) -> None:
    """Blocks sent in order become the file by a rename (the same inode as the
    data file they were written into); out of order, at the same time, retried
    or cut short, the commit still joins exactly the listed blocks' last bytes."""
    storage = LocalStorage(tmp_path)
    unknown = 1 << 40  # a block without Content-Length: no region reserved

    async def body(data: bytes, *gates: asyncio.Event) -> AsyncIterator[bytes]:
        half = len(data) // 2
        yield data[:half]
        if gates:
            gates[0].set()  # the first half is written: let the other block run
            await gates[1].wait()
        yield data[half:]

    async def broken(data: bytes) -> AsyncIterator[bytes]:
        yield data
        raise ConnectionResetError

    def new_upload(name: str) -> tuple[str, Path]:
        upload = storage.create_artifact("9", "j", name, None)
        return upload, storage._uploads[upload].target

    async def scenario() -> None:
        a, b, c = (bytes([n]) * (300_000 + n) for n in (1, 2, 3))
        # in order, with lengths known: renamed into place
        upload, target = new_upload("in-order")
        data = storage._uploads[upload].data
        for block, chunk in (("QQ==", a), ("Qg==", b), ("Qw==", c)):
            await storage.write_block(upload, block, body(chunk), len(chunk))
        inode = data.stat().st_ino
        assert storage.commit_blocks(upload, ["QQ==", "Qg==", "Qw=="]) == len(a + b + c)
        assert target.read_bytes() == a + b + c and target.stat().st_ino == inode
        # out of order: joined by copying
        upload, target = new_upload("out-of-order")
        for block, chunk in (("Qw==", c), ("QQ==", a), ("Qg==", b)):
            await storage.write_block(upload, block, body(chunk), len(chunk))
        storage.commit_blocks(upload, ["QQ==", "Qg==", "Qw=="])
        assert target.read_bytes() == a + b + c
        # two of unknown length at once, one cut short and sent again, one retried
        upload, target = new_upload("concurrent")
        first_half, go_on = asyncio.Event(), asyncio.Event()

        async def second() -> None:
            await first_half.wait()
            await storage.write_block(upload, "Qg==", body(b), unknown)
            go_on.set()

        await asyncio.gather(
            storage.write_block(upload, "QQ==", body(a, first_half, go_on), unknown), second()
        )
        with pytest.raises(ConnectionResetError):
            await storage.write_block(upload, "Qw==", broken(c[:1000]), len(c))
        await storage.write_block(upload, "Qw==", body(c), len(c))
        await storage.write_block(upload, "QQ==", body(b"again"), 5)
        assert storage.commit_blocks(upload, ["QQ==", "Qg==", "Qw=="]) == 5 + len(b + c)
        assert target.read_bytes() == b"again" + b + c
        with pytest.raises(StorageError, match="never uploaded"):
            storage.commit_blocks(upload, ["QQ==", "RA=="])

    asyncio.run(scenario())
