"""The `preloop` command: output shapes, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PRELOOP = [sys.executable, "-m", "preloop"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRELOOP, *args], capture_output=True, text=True, env=env, check=False)


def test_version() -> None:
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.startswith("preloop, version ")


def test_du_json_shape(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a" * 100)
    r = run("du", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"path", "apparent_bytes", "allocated_bytes", "files", "dirs", "symlinks"}
    assert doc["files"] == 1 and doc["dirs"] == 1
    assert doc["path"] == str(tmp_path)


def test_du_missing_path_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    r = run("du", str(missing))
    assert r.returncode == 1
    assert r.stderr == f"preloop: error: cannot size {missing}: No such file or directory\n"
    assert "Traceback" not in r.stderr


def test_usage_error_exits_2() -> None:
    r = run("du")
    assert r.returncode == 2
    assert "Missing argument 'PATH'" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_knob_names_variable(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PRELOOP_HOME": ""}
    r = run("config", env=env)
    assert r.returncode == 2
    assert r.stderr.startswith("preloop: error: PRELOOP_HOME: ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_config_json_lists_knobs() -> None:
    r = run("config", "--json")
    assert r.returncode == 0, r.stderr
    names = {row["name"] for row in json.loads(r.stdout)}
    assert {"PRELOOP_HOME", "PRELOOP_STATE_DIR"} <= names


def test_a_run_id_beyond_64_bits_is_a_one_line_usage_error(tmp_path: Path) -> None:
    """`status`, `logs` and `cancel` with a 30-digit run id: a usage error
    (exit 2) whose error is one line naming the id, never a traceback or a
    database overflow; the store is never opened."""
    import os

    huge = "123456789012345678901234567890"
    store = tmp_path / "store.db"
    env = {**os.environ, "PRELOOP_STATE_DIR": str(tmp_path / "state")}
    for command in ("status", "logs", "cancel"):
        r = run(command, "--store", f"sqlite:///{store}", huge, env=env)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == ""
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, r.stderr
        assert f"no run {huge}: run ids are positive 64-bit integers" in errors[0]
        # Besides that line, only click's usage hint.
        rest = [x for x in r.stderr.splitlines() if x and not x.startswith("Error:")]
        assert rest == [
            rest[0],
            f"Try 'preloop {command} --help' for help.",
        ] and rest[0].startswith(f"Usage: preloop {command} "), r.stderr
    assert not store.exists()
