"""`preloop cache status|prune`: output shapes, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from preloop.snapshot import layout
from preloop.snapshot.locks import CachePin
from preloop.testing.object_cache import make_cache_entry, make_run_repository

PRELOOP = [sys.executable, "-m", "preloop"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRELOOP, *args], capture_output=True, text=True, env=env, check=False)


def populated(tmp_path: Path) -> tuple[Path, list[str]]:
    state = tmp_path / "state"
    keys = [
        make_cache_entry(state, name, payload=16384, last_use=1.7e9 + i * 60)
        for i, name in enumerate(("old", "used", "new"))
    ]
    make_run_repository(
        layout.snapshots_dir(state) / "run-7", layout.cache_repository(state, keys[1])
    )
    return state, keys


def test_status_json_lists_entries_pins_references_and_last_use(tmp_path: Path) -> None:
    state, (old, used, new) = populated(tmp_path)
    pin = CachePin.create(state, new, run_id="run-8")
    r = run("cache", "status", "--state-dir", str(state), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["cache_dir"] == str(layout.cache_dir(state))
    assert doc["max_bytes"] == 100 * 1024**3
    assert doc["references_error"] is None
    assert [e["key"] for e in doc["entries"]] == [old, used, new]
    by_key = {e["key"]: e for e in doc["entries"]}
    assert by_key[used]["referenced_by"] == ["run-7"]
    assert by_key[new]["pins"] == [pin.pin_id]
    assert by_key[old]["last_use"] == "2023-11-14T22:13:20+00:00"
    assert doc["total_bytes"] == sum(e["total_bytes"] for e in doc["entries"])
    for e in doc["entries"]:
        assert e["total_bytes"] == e["repository_bytes"] + e["last_head_bytes"] + e["index_bytes"]

    text = run("cache", "status", "--state-dir", str(state))
    assert text.returncode == 0, text.stderr
    assert "3 entries" in text.stdout and "run-7" in text.stdout


def test_prune_dry_run_then_prune_with_units(tmp_path: Path) -> None:
    state, (old, used, new) = populated(tmp_path)
    dry = run(
        "cache", "prune", "--state-dir", str(state), "--max-bytes", "1", "--dry-run", "--json"
    )
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert doc["dry_run"] is True and doc["outcome"] == "completed"
    assert [e["key"] for e in doc["evicted"]] == [old, new]
    assert doc["skipped"] == [{"key": used, "reason": "referenced", "detail": "run-7"}]
    assert all(layout.cache_repository(state, k).is_dir() for k in (old, used, new))

    big = run("cache", "prune", "--state-dir", str(state), "--max-bytes", "1GiB")
    assert big.returncode == 0 and big.stdout.startswith("under-cap:")

    real = run("cache", "prune", "--state-dir", str(state), "--max-bytes", "1")
    assert real.returncode == 0, real.stderr
    assert f"evicted {old}:" in real.stdout and f"kept {used}: referenced (run-7)" in real.stdout
    assert not layout.cache_repository(state, old).exists()
    assert layout.cache_repository(state, used).is_dir()


def test_prune_uses_the_knob_and_reports_a_bad_value(tmp_path: Path) -> None:
    state, keys = populated(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES": "0"}
    off = run("cache", "prune", "--state-dir", str(state), env=env)
    assert off.returncode == 0 and "disabled" in off.stdout
    env["PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES"] = "ten gigs"
    bad = run("cache", "prune", "--state-dir", str(state), env=env)
    assert bad.returncode == 2
    assert bad.stderr.startswith("preloop: error: PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES: ")
    assert bad.stderr.count("\n") == 1
    flag = run("cache", "prune", "--state-dir", str(state), "--max-bytes", "-5")
    assert flag.returncode == 2 and flag.stderr.startswith("preloop: error: --max-bytes: ")
    assert all(layout.cache_repository(state, k).is_dir() for k in keys)


def test_prune_abort_is_one_line_and_exit_1(tmp_path: Path) -> None:
    state, keys = populated(tmp_path)
    alternates = layout.snapshots_dir(state) / "run-7" / "objects" / "info" / "alternates"
    alternates.write_text('"broken\n')
    r = run("cache", "prune", "--state-dir", str(state), "--max-bytes", "1")
    assert r.returncode == 1
    assert r.stderr.startswith(f"preloop: error: cannot read {alternates}: line 1 ")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert all(layout.cache_repository(state, k).is_dir() for k in keys)
    j = run("cache", "prune", "--state-dir", str(state), "--max-bytes", "1", "--json")
    assert j.returncode == 1 and json.loads(j.stdout)["outcome"] == "aborted"


def test_status_reports_unknown_references_instead_of_guessing(tmp_path: Path) -> None:
    state, _ = populated(tmp_path)
    alternates = layout.snapshots_dir(state) / "run-7" / "objects" / "info" / "alternates"
    alternates.write_text('"broken\n')
    r = run("cache", "status", "--state-dir", str(state), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert str(alternates) in doc["references_error"]
    assert all(e["referenced_by"] is None for e in doc["entries"])
    text = run("cache", "status", "--state-dir", str(state))
    assert "references unknown: cannot read" in text.stdout
