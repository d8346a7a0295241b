"""The services from real JavaScript actions (`runs.using: node20`) run by `preloop run`.

Local actions in the generated repository call GitHub's clients the way
upload-artifact, download-artifact, cache and setup-python do; they inherit the
job's environment (`preloop.services.job_environment`) like every step. This
needs JavaScript actions (`preloop.actions`); before they exist the module is
skipped as a whole.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tests.run_support import make_repo, results, run_engine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("preloop.actions") is None,
    reason="JavaScript actions (preloop.actions) are not in this build yet",
)
pytest_plugins = ["preloop.testing.control_fixtures"]

ROOT = Path(__file__).resolve().parents[1]

ACTION = """\
name: {name}
inputs:
  what: {{required: true}}
outputs:
  result: {{description: what happened}}
runs:
  using: node20
  main: index.cjs
"""

UPLOAD = """\
const core = require('@actions/core');
const {DefaultArtifactClient} = require('@actions/artifact');
(async () => {
  const dir = core.getInput('what');
  const fs = require('fs');
  const files = fs.readdirSync(dir).map(f => `${dir}/${f}`);
  const r = await new DefaultArtifactClient().uploadArtifact('from-action', files, dir);
  core.setOutput('result', String(r.id));
})().catch(e => core.setFailed(e.message));
"""

DOWNLOAD = """\
const core = require('@actions/core');
const {DefaultArtifactClient} = require('@actions/artifact');
const tc = require('@actions/tool-cache');
(async () => {
  const client = new DefaultArtifactClient();
  const {artifact} = await client.getArtifact('from-action');
  await client.downloadArtifact(artifact.id, {path: core.getInput('what')});
  core.setOutput('result', tc.find('Python', '3.x'));
})().catch(e => core.setFailed(e.message));
"""


def test_javascript_actions_upload_download_and_find_python(tmp_path: Path, store_url: str) -> None:
    files = {
        ".github/actions/up/action.yml": ACTION.format(name="up"),
        ".github/actions/up/index.cjs": UPLOAD,
        ".github/actions/down/action.yml": ACTION.format(name="down"),
        ".github/actions/down/index.cjs": DOWNLOAD,
        "payload/a.txt": "alpha\n",
        "payload/b.txt": "beta\n",
        ".github/workflows/ci.yml": f"""
on: push
env:
  NODE_PATH: {ROOT / "node_modules"}
jobs:
  up:
    runs-on: ubuntu-latest
    steps:
      - uses: ./.github/actions/up
        with: {{what: payload}}
  down:
    needs: up
    runs-on: ubuntu-latest
    steps:
      - id: d
        uses: ./.github/actions/down
        with: {{what: got}}
      - run: |
          diff -r payload got
          test -x "${{{{ steps.d.outputs.result }}}}/bin/python"
""",
    }
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {"up": "success", "down": "success"}, h.all_text()


CACHE = """\
const core = require('@actions/core');
const cache = require('@actions/cache');
(async () => {
  const [op, key, ...restoreKeys] = core.getInput('what').split(' ');
  if (op === 'save') {
    core.setOutput('result', String(await cache.saveCache(['deps'], key)));
  } else {
    core.setOutput('result', (await cache.restoreCache(['deps'], key, restoreKeys)) || 'miss');
  }
})().catch(e => core.setFailed(e.message));
"""


def test_javascript_action_saves_then_restores_a_cache(tmp_path: Path, store_url: str) -> None:
    """actions/cache's calls from a JavaScript action (`runs.using: node20`):
    a miss, a save in one job, a restore by a restore key in a dependent job."""
    files = {
        ".github/actions/cache/action.yml": ACTION.format(name="cache"),
        ".github/actions/cache/index.cjs": CACHE,
        ".github/workflows/ci.yml": f"""
on: push
env:
  NODE_PATH: {ROOT / "node_modules"}
jobs:
  save:
    runs-on: ubuntu-latest
    steps:
      - id: miss
        uses: ./.github/actions/cache
        with: {{what: restore deps-1 deps-}}
      - id: sum
        run: |
          test "${{{{ steps.miss.outputs.result }}}}" = miss
          mkdir deps && head -c 100000 /dev/urandom > deps/blob
          echo "sum=$(sha256sum deps/blob | cut -c1-64)" >> "$GITHUB_OUTPUT"
      - id: save
        uses: ./.github/actions/cache
        with: {{what: save deps-1}}
      - run: test "${{{{ steps.save.outputs.result }}}}" -gt 0
    outputs:
      sum: ${{{{ steps.sum.outputs.sum }}}}
  restore:
    needs: save
    runs-on: ubuntu-latest
    steps:
      - id: hit
        uses: ./.github/actions/cache
        with: {{what: restore deps-2 deps-}}
      - run: |
          test "${{{{ steps.hit.outputs.result }}}}" = deps-1
          test "$(sha256sum deps/blob | cut -c1-64)" = "${{{{ needs.save.outputs.sum }}}}"
""",
    }
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {"save": "success", "restore": "success"}, h.all_text()
