"""Secrets never on disk or on screen: every string leaving a step is masked,
with the encodings GitHub's runner masks; `--secret-file`; the warning for a
value on the command line."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.run_support import make_repo, run_engine, workflow
from tests.test_run_cli import _env

from preloop.cli.secret_args import parse_secret_file, parse_secrets
from preloop.errors import UsageError
from preloop.runner.commands import WorkflowCommandParser
from preloop.runner.masking import Masker, encoded_forms

SECRET = "s3cr3t-Value:with/odd+chars&<x>\"q'"


def test_encoded_forms_are_masked() -> None:
    m = Masker()
    m.add(SECRET)
    raw = SECRET.encode()
    texts = [
        SECRET,
        json.dumps({"k": SECRET}),
        json.dumps({"k": SECRET + "é"}, ensure_ascii=False),
        "https://x.test/?token=" + __import__("urllib.parse").parse.quote(SECRET, safe=""),
        SECRET.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&apos;"),
    ]
    # base64 of the value behind 0, 1 and 2 bytes of other content (each alignment).
    for prefix in (b"", b"u", b"us", b"user:", b"user:x"):
        texts.append(base64.b64encode(prefix + raw + b"!trailer").decode())
        texts.append(base64.b64encode(prefix + raw).decode())
    for text in texts:
        masked = m.mask(text)
        assert SECRET not in masked and "***" in masked, text
        # What stays visible of a base64 text is never more than two characters
        # next to the mask: fewer than two bytes of the value.
    assert not any(len(f) < 4 for f in encoded_forms(SECRET))


def test_overlapping_values_are_masked_as_one_span() -> None:
    m = Masker()
    m.add("abcd")
    m.add("cdef")
    assert m.mask("xxabcdefyy") == "xx***yy"


def test_multiline_secret_lines_are_masked_each() -> None:
    m = Masker()
    m.add("line-one-secret\nline-two-secret")
    assert m.mask("a line-two-secret b") == "a *** b"


def test_annotation_properties_are_masked() -> None:
    m = Masker()
    m.add("hunter2-secret")
    p = WorkflowCommandParser(m, "job", "step")
    shown = p.line("::error file=src/hunter2-secret.py,line=3,title=T hunter2-secret::boom")
    assert shown is not None and "hunter2-secret" not in shown
    (ann,) = p.effects.annotations
    assert ann.file == "src/***.py" and ann.title == "T ***" and ann.line == 3


def _leak_repo(root: Path) -> Path:
    return make_repo(
        root,
        workflow(
            """\
            on: push
            jobs:
              leak:
                runs-on: ubuntu-latest
                outputs:
                  plain: ${{ steps.s.outputs.plain }}
                steps:
                  - name: deploy with ${{ secrets.TOKEN }}
                    id: s
                    run: |
                      echo "out=${{ secrets.TOKEN }}" >> "$GITHUB_OUTPUT"
                      echo "plain=visible" >> "$GITHUB_OUTPUT"
                      echo "::warning file=${{ secrets.TOKEN }}.py,line=1::look"
                      echo "summary ${{ secrets.TOKEN }}" >> "$GITHUB_STEP_SUMMARY"
                      printf '%s' "${{ secrets.TOKEN }}" | base64
                      echo "::add-mask::late-mask-value"
                      echo "late=late-mask-value" >> "$GITHUB_OUTPUT"
            """
        ),
    )


def test_secret_never_in_logs_results_or_outputs(tmp_path: Path) -> None:
    """The review's finding: the step name and step outputs were written
    unmasked into <state>/logs/<run>/<job>.json, the annotation's file= was
    printed unmasked."""
    token = "tok-3f9a-never-show-me"
    state = tmp_path / "state"
    repo = _leak_repo(tmp_path / "repo")
    outcome, h = run_engine(
        repo, f"sqlite:///{state / 'preloop.db'}", state, secrets={"TOKEN": token}
    )
    assert outcome.conclusion == "success", h.lines
    b64 = base64.b64encode(token.encode()).decode().rstrip("=")
    shown = h.all_text()
    assert token not in shown and b64[:-1] not in shown
    assert "warning: ***.py:1: look" in shown
    doc = json.dumps(outcome.to_dict())
    assert token not in doc and "late-mask-value" not in doc
    files = [p for p in state.rglob("*") if p.is_file()]
    assert any(p.name == "leak.json" for p in files)
    for path in files:
        data = path.read_bytes()
        assert token.encode() not in data, path
        assert b64[:-1].encode() not in data, path
    result = json.loads(next(p for p in files if p.name == "leak.json").read_text())
    (step,) = result["steps"]
    assert step["name"] == "deploy with ***"
    assert step["outputs"] == {"out": "***", "plain": "visible", "late": "***"}
    assert result["annotations"][0]["file"] == "***.py"
    assert "summary ***" in result["summary"]
    assert outcome.jobs[0].outputs == {"plain": "visible"}


def test_secret_file_dotenv(tmp_path: Path) -> None:
    f = tmp_path / "secrets.env"
    f.write_text(
        "# comment\n"
        "A=plain value  # trailing comment\n"
        "export B='single $quoted'\n"
        'C="two\\nlines \\"q\\""\n'
        'D="spans\n'
        'lines"\n'
        "\n"
        "E=\n"
    )
    assert parse_secret_file(f) == {
        "A": "plain value",
        "B": "single $quoted",
        "C": 'two\nlines "q"',
        "D": "spans\nlines",
        "E": "",
    }
    bad = tmp_path / "bad.env"
    bad.write_text("OK=1\nnot a line\n")
    with pytest.raises(UsageError, match=r"bad\.env:2"):
        parse_secret_file(bad)
    with pytest.raises(UsageError, match=r"missing\.env"):
        parse_secret_file(tmp_path / "missing.env")
    # Files first, then --secret, which wins.
    assert parse_secrets(["A=override"], [f], warn=False)["A"] == "override"


def test_secret_on_the_command_line_warns_once_and_secret_file_does_not(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                steps:
                  - run: echo "got ${{ secrets.ONE }} ${{ secrets.TWO }}"
            """
        ),
    )
    env = _env(state)
    argv = [sys.executable, "-m", "preloop", "run", "-j", "1"]
    inline = subprocess.run(
        [*argv, "--secret", "ONE=first-value", "--secret", "TWO=second-value"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inline.returncode == 0, inline.stderr
    assert inline.stderr.count("puts the value in the process list") == 1
    assert "got *** ***" in inline.stdout
    secret_file = tmp_path / "s.env"
    secret_file.write_text("ONE=first-value\nTWO=second-value\n")
    from_file = subprocess.run(
        [*argv, "--secret-file", str(secret_file)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert from_file.returncode == 0, from_file.stderr
    assert "process list" not in from_file.stderr
    assert "got *** ***" in from_file.stdout and "first-value" not in from_file.stdout


def test_long_lines_are_masked_too() -> None:
    m = Masker()
    m.add("deep-secret-value")
    text = "x" * 10_000 + "deep-secret-value" + "y" * 10_000
    assert m.mask(text) == "x" * 10_000 + "***" + "y" * 10_000
    assert m.mask("z" * 10_000) == "z" * 10_000
