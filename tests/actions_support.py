"""Real actions for tests: git repositories published as bare remotes under a
directory served through `PRELOOP_ACTIONS_URL=file://<dir>` (`<dir>/<owner>/<repo>.git`).

JavaScript actions use GitHub's own `@actions/core` from the project's
`node_modules` (installed by `npm ci`): the action repository carries a
`node_modules` symlink to it, as a real action carries its node_modules.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

NODE_MODULES = Path(__file__).resolve().parent.parent / "node_modules"

_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def _git(cwd: Path, *args: str) -> str:
    import os

    out = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **_ENV},
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def publish_action(
    remotes: Path,
    slug: str,
    files: dict[str, str],
    *,
    tags: tuple[str, ...] = ("v1",),
    branch: str = "main",
    node_modules: bool = True,
) -> str:
    """Commits `files` into the work repository of `slug`, pushes `branch` and
    (force-moved) `tags` to `<remotes>/<slug>.git`; returns the commit."""
    if not (NODE_MODULES / "@actions" / "core").is_dir():
        raise RuntimeError("node_modules/@actions/core is missing: run `npm ci`")
    work = remotes / ".work" / slug
    bare = remotes / f"{slug}.git"
    if not work.is_dir():
        work.mkdir(parents=True)
        _git(work, "init", "-q", "-b", branch)
        bare.parent.mkdir(parents=True, exist_ok=True)
        _git(remotes, "init", "-q", "--bare", str(bare))
    else:
        _git(work, "checkout", "-q", "-B", branch)
    for rel, text in files.items():
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        if rel.startswith("bin/"):
            path.chmod(0o755)
    if node_modules and not (work / "node_modules").is_symlink():
        (work / "node_modules").symlink_to(NODE_MODULES)
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "--allow-empty", "-m", f"publish {slug}")
    commit = _git(work, "rev-parse", "HEAD")
    _git(work, "push", "-q", "--force", str(bare), f"HEAD:refs/heads/{branch}")
    for tag in tags:
        _git(work, "tag", "-f", "-a", tag, "-m", tag)
        _git(work, "push", "-q", "--force", str(bare), f"refs/tags/{tag}")
    return commit


#: A JavaScript action exercising the toolkit: inputs with defaults, outputs,
#: state across pre/main/post, exportVariable, addPath, setSecret, summary.
JS_ACTION = {
    "action.yml": """\
        name: greet
        description: test action
        inputs:
          who:
            description: whom to greet
            required: true
          greeting:
            default: Hello
          secret:
            default: ""
          fail:
            default: "false"
        outputs:
          message:
            description: the greeting
        runs:
          using: node20
          pre: pre.js
          main: main.js
          post: post.js
        """,
    "pre.js": """\
        const core = require('@actions/core');
        core.saveState('from-pre', 'P-' + core.getInput('who'));
        console.log('pre ran');
        """,
    "main.js": """\
        const core = require('@actions/core');
        async function main() {
          const who = core.getInput('who', { required: true });
          const greeting = core.getInput('greeting');
          console.log(`main: ${greeting} ${who} state=${core.getState('from-pre')}`);
          core.saveState('from-main', 'M-' + who);
          core.setOutput('message', `${greeting} ${who}`);
          core.exportVariable('FROM_ACTION', 'exported-' + who);
          core.addPath(process.env.GITHUB_ACTION_PATH + '/bin');
          const secret = core.getInput('secret');
          if (secret) {
            core.setSecret(secret);
            console.log(`the secret is ${secret}`);
          }
          const env = process.env;
          console.log(`env: ${env.GITHUB_ACTION_REPOSITORY}@${env.GITHUB_ACTION_REF}`);
          await core.summary.addRaw(`summary for ${who}`).write();
          if (core.getInput('fail') === 'true') core.setFailed('asked to fail');
        }
        main();
        """,
    "post.js": """\
        const core = require('@actions/core');
        console.log(`post: ${core.getState('from-pre')} ${core.getState('from-main')}`);
        """,
    "bin/hello-tool": "#!/bin/sh\necho tool-on-path\n",
}


def git_wrapper(
    bin_dir: Path, log: Path, *, before_fetch: str = "", after_clone: Path | None = None
) -> Path:
    """A `git` for PATH that logs each call's arguments (one line) to `log` and
    runs the real git. `before_fetch` is shell run before a `clone` or `fetch`
    (to hold it); `after_clone`, a shell script, runs once after the first
    `clone` (renamed to `<name>.ran` first). Returns `bin_dir`."""
    import shlex
    import shutil

    real = shutil.which("git")
    assert real is not None and not real.startswith(str(bin_dir))
    hook = ""
    if after_clone is not None:
        q, ran = shlex.quote(str(after_clone)), shlex.quote(f"{after_clone}.ran")
        once = f"if mv {q} {ran} 2>/dev/null; then sh {ran}; fi"
        hook = f'case " $* " in *" clone "*) {once};; esac\n'
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "git").write_text(
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n"
        f'case " $* " in *" clone "*|*" fetch "*) {before_fetch or ":"};; esac\n'
        f'{shlex.quote(real)} "$@"\n'
        "rc=$?\n"
        f"{hook}"
        "exit $rc\n"
    )
    (bin_dir / "git").chmod(0o755)
    return bin_dir


def git_calls(log: Path, command: str, needle: str = "") -> list[str]:
    """The logged git calls running `command` (e.g. `ls-remote`) whose
    arguments contain `needle`."""
    if not log.exists():
        return []
    return [
        line
        for line in log.read_text().splitlines()
        if f" {command} " in f" {line} " and needle in line
    ]
