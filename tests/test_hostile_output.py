"""Bounded resources on hostile output: the line splitter is linear and caps a
line's length (split, never dropped); job outputs over GitHub's limits are an
error naming the output, and an environment too big to start a step is a
clear step failure (it used to be an E2BIG traceback in the dependent job)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import anyio
import pytest
from tests.run_support import make_repo, run_engine, workflow

import preloop.control.types as control_types
from preloop.runner.logs import read_result
from preloop.runner.stream import MAX_LINE_CHARS, LineSplitter, run_streaming


def test_one_huge_line_is_split_into_capped_pieces_without_losing_bytes() -> None:
    """A step printing one 40 MB line: the old splitter re-scanned and kept the
    whole buffer (104 s, 232 MB); pieces are now at most MAX_LINE_CHARS."""
    pieces: list[int] = []
    digest = hashlib.sha256()

    def on_lines(texts: list[str]) -> None:
        for text in texts:
            pieces.append(len(text))
            digest.update(text.encode())

    async def main() -> None:
        await run_streaming(
            ["sh", "-c", "head -c 41943040 /dev/zero | tr '\\0' x; echo; echo after"],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            timeout=120,
            on_lines=on_lines,
        )

    anyio.run(main)
    assert max(pieces) <= MAX_LINE_CHARS
    assert sum(pieces) == 40 * 1024 * 1024 + len("after")
    expected = hashlib.sha256(b"x" * (40 * 1024 * 1024) + b"after").hexdigest()
    assert digest.hexdigest() == expected


def test_splitter_keeps_characters_whole_and_empty_lines() -> None:
    out: list[str] = []
    s = LineSplitter(out.extend, max_line=3)
    # "€" and "😀" arrive split across chunks; an invalid byte is replaced.
    for chunk in (b"ab\xe2\x82", b"\xaccd\n\nxyz", b"\xf0\x9f\x98\x80\n\xff"):
        s.feed(chunk)
    s.feed(b"tail")
    s.close()
    assert out == ["ab€", "cd", "", "xyz", "😀", "\ufffdta", "il"]


def test_job_output_over_one_megabyte_is_an_error_naming_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              big:
                runs-on: ubuntu-latest
                outputs:
                  small: ${{ steps.s.outputs.small }}
                  huge: ${{ steps.s.outputs.huge }}
                steps:
                  - id: s
                    run: |
                      echo "small=ok" >> "$GITHUB_OUTPUT"
                      printf 'huge=%s\\n' "$(head -c 1100000 /dev/zero | tr '\\0' y)" \\
                        >> "$GITHUB_OUTPUT"
              after:
                needs: big
                if: always()
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      echo "small=${{ needs.big.outputs.small }} huge=${{ needs.big.outputs.huge }}"
            """
        ),
    )
    outcome, h = run_engine(repo, f"sqlite:///{state / 'preloop.db'}", state)
    jobs = {j.id: j for j in outcome.jobs}
    assert jobs["big"].conclusion == "failure"
    assert jobs["big"].outputs == {"small": "ok"}
    assert any("job output 'huge'" in a and "1,048,576" in a for a in jobs["big"].annotations)
    assert jobs["after"].conclusion == "success"
    assert "small=ok huge=" in h.lines["after"]


def test_environment_too_big_for_a_step_is_a_clear_failure(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              make:
                runs-on: ubuntu-latest
                outputs:
                  blob: ${{ steps.s.outputs.blob }}
                steps:
                  - id: s
                    run: |
                      printf 'blob=%s\\n' "$(head -c 300000 /dev/zero | tr '\\0' z)" \\
                        >> "$GITHUB_OUTPUT"
              use:
                needs: make
                runs-on: ubuntu-latest
                steps:
                  - run: echo "${#BLOB}"
                    env:
                      BLOB: ${{ needs.make.outputs.blob }}
            """
        ),
    )
    outcome, h = run_engine(repo, f"sqlite:///{state / 'preloop.db'}", state)
    jobs = {j.id: j for j in outcome.jobs}
    assert jobs["make"].conclusion == "success"
    assert jobs["use"].conclusion == "failure"
    text = "\n".join(h.lines["use"])
    assert "environment variable BLOB" in text and "Traceback" not in text
    assert "could not run the job" not in text


def test_run_outputs_over_the_run_limit_fail_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run limit (50 MB) scaled down: the second job's outputs go over it.
    monkeypatch.setattr(control_types, "RUN_OUTPUTS_MAX_BYTES", 3000)
    state = tmp_path / "state"
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              first:
                runs-on: ubuntu-latest
                outputs: {a: "${{ steps.s.outputs.a }}"}
                steps:
                  - id: s
                    run: |
                      printf 'a=%s\\n' "$(head -c 2000 /dev/zero | tr '\\0' a)" \\
                        >> "$GITHUB_OUTPUT"
              second:
                needs: first
                runs-on: ubuntu-latest
                outputs: {b: "${{ steps.s.outputs.b }}"}
                steps:
                  - id: s
                    run: |
                      printf 'b=%s\\n' "$(head -c 2000 /dev/zero | tr '\\0' b)" \\
                        >> "$GITHUB_OUTPUT"
            """
        ),
    )
    outcome, _ = run_engine(repo, f"sqlite:///{state / 'preloop.db'}", state, local_runners=1)
    jobs = {j.id: j for j in outcome.jobs}
    assert jobs["first"].conclusion == "success"
    assert jobs["second"].conclusion == "failure" and jobs["second"].outputs == {}
    saved = read_result(state, outcome.run_id, "second")
    assert saved is not None
    assert any("job outputs 'b'" in a["message"] for a in saved["annotations"]), json.dumps(saved)
