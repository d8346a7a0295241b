"""Format v1 is frozen: a fixed tree's content digest, pinned. The value was
computed by the walk before the stability check moved onto the open descriptor
(issue 17) and must never change for format v1."""

from __future__ import annotations

from pathlib import Path

import pytest

from preloop.fingerprint import fingerprint

GOLDEN = "ad2fea03f667f33497479b2077a9f800241cecf098c19662ec4258b7ba2988f0"


@pytest.fixture(autouse=True)
def _coordination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(tmp_path / "coordination"))


def build(root: Path) -> Path:
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a" / "b" / "deep.txt").write_bytes(b"deep\n")
    (root / "a" / "x.bin").write_bytes(bytes(range(256)) * 64)
    (root / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "z-empty-file").write_bytes(b"")
    (root / "link").symlink_to("a/b/deep.txt")
    return root


def test_content_digest_v1_is_unchanged(tmp_path: Path) -> None:
    root = build(tmp_path / "golden")
    result = fingerprint(root)
    assert result.roots == {str(root): GOLDEN}
    assert (result.files, result.bytes) == (4, 16407)
