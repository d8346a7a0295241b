"""Reusable workflows as GitHub runs them, end to end on both stores: `with:`
evaluated when the caller starts (`needs.*` outputs, `matrix`), typed inputs
in the callee's job-level `if`/`runs-on`/`strategy`/`concurrency`, `secrets:`
mappings and `inherit` (a callee sees only what is passed), callee outputs to
the caller's dependents."""

from __future__ import annotations

from pathlib import Path

from tests.run_support import make_repo, results, run_engine

pytest_plugins = ["preloop.testing.control_fixtures"]

CALLEE = """\
    on:
      workflow_call:
        inputs:
          flag: {type: boolean, required: true}
          count: {type: number, default: 1}
          label: {type: string, default: ubuntu-latest}
          who: {type: string, default: nobody}
        secrets:
          token: {required: false}
        outputs:
          said:
            value: ${{ jobs.speak.outputs.said }}-${{ inputs.who }}
    jobs:
      speak:
        if: ${{ inputs.flag }}
        runs-on: ${{ inputs.label }}
        concurrency: speak-${{ inputs.who }}
        outputs:
          said: ${{ steps.s.outputs.said }}
        steps:
          - id: s
            run: |
              echo "who=${{ inputs.who }} flag=${{ inputs.flag }} count=${{ inputs.count }}"
              echo "typed=${{ inputs.count == 2 }} bool=${{ inputs.flag == true }}"
              echo "token=[${{ secrets.token }}] other=[${{ secrets.OTHER }}]"
              echo "said=hi" >> "$GITHUB_OUTPUT"
      legs:
        if: ${{ !inputs.flag || inputs.count == 2 }}
        runs-on: ubuntu-latest
        strategy:
          matrix:
            n: ${{ fromJSON(format('[{0}]', inputs.count)) }}
        steps:
          - run: echo "leg ${{ matrix.n }}"
"""


def test_with_from_needs_and_matrix_typed_inputs_secrets_outputs(
    tmp_path: Path, store_url: str
) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            ".github/workflows/ci.yml": """\
                on: push
                jobs:
                  setup:
                    runs-on: ubuntu-latest
                    outputs:
                      flag: ${{ steps.o.outputs.flag }}
                      who: ${{ steps.o.outputs.who }}
                    steps:
                      - id: o
                        run: |
                          echo "flag=true" >> "$GITHUB_OUTPUT"
                          echo "who=setup" >> "$GITHUB_OUTPUT"
                  call:
                    needs: setup
                    strategy:
                      matrix:
                        n: [2]
                    uses: ./.github/workflows/callee.yml
                    with:
                      flag: ${{ needs.setup.outputs.flag }}
                      count: ${{ matrix.n }}
                      who: ${{ needs.setup.outputs.who }}-${{ matrix.n }}
                    secrets:
                      token: tok-${{ secrets.MINE }}
                  inherit:
                    needs: setup
                    uses: ./.github/workflows/callee.yml
                    with:
                      flag: false
                      count: 3
                    secrets: inherit
                  none:
                    uses: ./.github/workflows/callee.yml
                    with: {flag: true}
                  after:
                    needs: call
                    runs-on: ubuntu-latest
                    steps:
                      - run: echo "got ${{ needs.call.outputs.said }}"
                """,
            ".github/workflows/callee.yml": CALLEE,
        },
    )
    outcome, h = run_engine(
        repo, store_url, tmp_path / "state", secrets={"MINE": "m1", "OTHER": "o1"}
    )
    r = results(outcome)
    assert r["call#0/speak"] == "success", h.all_text()
    # A matrix over inputs that waited for the caller's needs (deferred).
    assert r["call#0/legs#0"] == "success"
    assert "leg 2" in "\n".join(h.lines["call#0/legs#0"])
    assert [r[k] for k in r if k.startswith("none/legs")] == ["skipped"], r
    assert r["inherit/speak"] == "skipped"
    assert r["inherit/legs#0"] == "success" and len([k for k in r if "inherit/legs#" in k]) == 1
    assert r["none/speak"] == "success"
    speak = "\n".join(h.lines["call#0/speak"])
    # with: from needs outputs and the caller's matrix, typed by the callee.
    assert "who=setup-2 flag=true count=2" in speak
    assert "typed=true bool=true" in speak
    # Only the passed secret (masked in the log), not the caller's others.
    assert "token=[***] other=[]" in speak
    # secrets: inherit passes all; no `secrets:` passes none.
    assert "token=[] other=[]" in "\n".join(h.lines["none/speak"])
    assert "leg 3" in "\n".join(h.lines["inherit/legs#0"])
    # Callee outputs (over its typed inputs) reach the caller's dependents.
    assert "got hi-setup-2" in "\n".join(h.lines["after"]), (r, h.all_text())


def test_with_value_of_the_wrong_type_fails_the_caller(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            ".github/workflows/ci.yml": """\
                on: push
                jobs:
                  setup:
                    runs-on: ubuntu-latest
                    outputs:
                      flag: ${{ steps.o.outputs.flag }}
                    steps:
                      - id: o
                        run: echo "flag=not-a-boolean" >> "$GITHUB_OUTPUT"
                  call:
                    needs: setup
                    uses: ./.github/workflows/callee.yml
                    with:
                      flag: ${{ needs.setup.outputs.flag }}
                """,
            ".github/workflows/callee.yml": CALLEE,
        },
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    assert r["call"] == "failure"
    assert r["call/speak"] == "skipped" and "call/speak" not in h.started
    assert not outcome.ok


def test_nested_callers_pass_inputs_and_secrets_down(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            ".github/workflows/ci.yml": """\
                on: push
                jobs:
                  setup:
                    runs-on: ubuntu-latest
                    outputs:
                      v: ${{ steps.o.outputs.v }}
                    steps:
                      - id: o
                        run: echo "v=from-needs" >> "$GITHUB_OUTPUT"
                  outer:
                    needs: setup
                    uses: ./.github/workflows/middle.yml
                    with:
                      v: ${{ needs.setup.outputs.v }}
                    secrets:
                      s: outer-${{ secrets.TOP }}
                """,
            ".github/workflows/middle.yml": """\
                on:
                  workflow_call:
                    inputs:
                      v: {type: string, required: true}
                    secrets:
                      s: {required: true}
                jobs:
                  inner:
                    uses: ./.github/workflows/leaf.yml
                    with:
                      w: ${{ inputs.v }}-middle
                    secrets: inherit
                """,
            ".github/workflows/leaf.yml": """\
                on:
                  workflow_call:
                    inputs:
                      w: {type: string, required: true}
                jobs:
                  leaf:
                    if: ${{ inputs.w == 'from-needs-middle' }}
                    runs-on: ubuntu-latest
                    steps:
                      - run: echo "w=${{ inputs.w }} s=[${{ secrets.s }}] top=[${{ secrets.TOP }}]"
                """,
        },
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state", secrets={"TOP": "t0p"})
    r = results(outcome)
    assert r["outer/inner/leaf"] == "success", (r, h.all_text())
    text = "\n".join(h.lines["outer/inner/leaf"])
    assert "w=from-needs-middle s=[***] top=[]" in text


def test_a_callers_name_using_needs_is_its_inner_jobs_prefix(
    tmp_path: Path, store_url: str
) -> None:
    """As on GitHub, a caller's `name:` using its `needs` is evaluated with
    them when its jobs start: yarl's `📦 Build dists v${{ needs.pre-setup.
    outputs.dist-version }}` showed as `📦 Build dists v / ...`."""
    repo = make_repo(
        tmp_path / "repo",
        {
            ".github/workflows/ci.yml": """\
                on: push
                jobs:
                  setup:
                    runs-on: ubuntu-latest
                    outputs:
                      v: ${{ steps.o.outputs.v }}
                    steps:
                      - id: o
                        run: echo "v=1.2.3" >> "$GITHUB_OUTPUT"
                  call:
                    name: build v${{ needs.setup.outputs.v }}
                    needs: setup
                    uses: ./.github/workflows/callee.yml
                    with:
                      check: checked ${{ needs.setup.outputs.v }}
                """,
            ".github/workflows/callee.yml": """\
                on:
                  workflow_call:
                    inputs:
                      check: {type: string}
                jobs:
                  inner:
                    name: ${{ inputs.check }}
                    runs-on: ubuntu-latest
                    steps:
                      - run: echo hi
                """,
        },
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    names = {j.id: j.name for j in outcome.jobs}
    assert results(outcome)["call/inner"] == "success", h.all_text()
    assert names["call/inner"] == "build v1.2.3 / checked 1.2.3", names
    assert names["call"] == "build v1.2.3", names  # the caller's own row too


def test_the_jobs_token_reaches_called_workflows_whatever_is_passed(
    tmp_path: Path, store_url: str
) -> None:
    """`GITHUB_TOKEN` (`github.token`, `secrets.GITHUB_TOKEN`) is in every
    called workflow, as on GitHub, though its caller passes no `secrets:` or
    a mapping without it; other secrets still only as passed."""
    called = """\
        on:
          workflow_call:
            secrets:
              MINE: {required: false}
        jobs:
          inner:
            runs-on: ubuntu-latest
            steps:
              - run: |
                  echo "token=${{ github.token == 'tok-abcdef123' }} \\
                  secret=${{ secrets.GITHUB_TOKEN == 'tok-abcdef123' }} \\
                  other=[${{ secrets.OTHER }}] mine=[${{ secrets.MINE }}]"
        """
    files = {
        ".github/workflows/ci.yml": """\
            on: push
            jobs:
              none:
                uses: ./.github/workflows/r.yml
              mapped:
                uses: ./.github/workflows/r.yml
                secrets:
                  MINE: ${{ secrets.OTHER }}
            """,
        ".github/workflows/r.yml": called,
    }
    repo = make_repo(tmp_path / "repo", files)
    secrets = {"GITHUB_TOKEN": "tok-abcdef123", "OTHER": "o-secret"}
    outcome, h = run_engine(repo, store_url, tmp_path / "state", secrets=secrets)
    assert outcome.conclusion == "success", h.all_text()
    shown = [line for line in h.all_text().splitlines() if line.startswith("token=")]
    assert sorted(shown) == [
        "token=true secret=true other=[] mine=[***]",
        "token=true secret=true other=[] mine=[]",
    ], shown
