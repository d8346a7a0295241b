"""The runner's tool cache, laid out from the host's toolchains.

GitHub's `setup-*` actions look in `$RUNNER_TOOL_CACHE/<Tool>/<version>/<arch>/`
(with an `<arch>.complete` marker beside it, `@actions/tool-cache`'s `find`)
before downloading anything. `refresh_tool_cache(root)` finds the host's
toolchains and lays each out there as links, never copies:

- `Python`: interpreters on PATH (`python3`, `python3.X`; pyenv shims are
  skipped), pyenv's (`$PYENV_ROOT/versions/*`, default `~/.pyenv`) and uv's
  (`$UV_PYTHON_INSTALL_DIR`, default `~/.local/share/uv/python/*`). A prefix
  that holds its own `bin/python` (pyenv, uv) is linked whole; a system
  interpreter gets a directory whose `bin/` links `python`, `python3` and
  `python3.X` to it (the interpreter finds its prefix through the link);
- `node` (setup-node), `go` (setup-go: the GOROOT), `uv` (astral-sh/setup-uv,
  which names the architecture `x86_64`/`aarch64` and wants `uv` and `uvx` in
  the version directory itself) and `Java_Temurin-Hotspot_jdk` (setup-java's
  Temurin JDK: the JAVA_HOME).

Each entry preloop made is listed in `<root>/.preloop-host.json`, with the
probe result of each interpreter keyed by its path, size and mtime, so a
refresh is a handful of `stat`s when nothing changed; an entry whose
toolchain disappeared is removed, and entries that setup actions installed
themselves (a download on GitHub's side) are never touched.

A job does not use that shared cache directly: `job_tool_cache(shared, dest)`
lays out the job's own `RUNNER_TOOL_CACHE` in its directory, where each
`Python` entry is a fresh virtual environment over the shared one (what a
job's `pip install` writes lands there and goes with the job, never in the
host's interpreter) and every other tool directory the shared cache has is a
link to it (a download of node, go, ... lands in the shared cache). A
download into one of the job's own directories (`Python`, or a tool the
shared cache had no directory for: `PyPy`, `GraalPy`) is moved into the
shared cache when the job ends (`adopt_job_tools`), so later jobs find it
rather than download it again; like every entry a setup action installed,
a refresh never removes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from preloop.fs import write_text_atomic

__all__ = [
    "ToolEntry",
    "adopt_job_tools",
    "container_python",
    "default_tool_cache",
    "job_tool_cache",
    "job_uses_tool_cache",
    "list_tool_cache",
    "refresh_now_and_then",
    "refresh_tool_cache",
    "shared_tool_cache",
]

MANIFEST = ".preloop-host.json"
_PROBE_TIMEOUT = 10.0
_PY_PROBE = (
    "import sys, json; print(json.dumps([list(sys.version_info[:3]), "
    "sys.version_info.releaselevel, sys.prefix, sys.implementation.name]))"
)
_VERSION = re.compile(r"^\d+\.\d+\.\d+$")
_PYTHON3 = re.compile(r"python3(\.\d+)?")
_log = logging.getLogger(__name__)


def tool_arch() -> str:
    """The `<arch>` directory name: node's `os.arch()`, which the actions use."""
    machine = platform.machine().lower()
    return {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        machine, machine
    )


def default_tool_cache(state_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """`$RUNNER_TOOL_CACHE` when set, else `<state>/toolcache`."""
    env = os.environ if env is None else env
    given = env.get("RUNNER_TOOL_CACHE")
    return Path(given).expanduser().absolute() if given else Path(state_dir) / "toolcache"


@dataclass(frozen=True, slots=True)
class ToolEntry:
    """One laid-out version: `path` is `<root>/<tool>/<version>/<arch>`."""

    tool: str
    version: str
    arch: str
    path: str
    source: str  # the host directory or interpreter it links to
    origin: str  # "host" (preloop's link) or "installed" (put there by an action)


@dataclass(frozen=True, slots=True)
class _Found:
    tool: str
    version: str
    target: str  # link the <arch> dir to this directory ...
    binaries: tuple[tuple[str, str], ...] = ()  # ... or build bin/ with these links


def _probe_key(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _run(argv: list[str]) -> str | None:
    try:
        res = subprocess.run(
            argv, capture_output=True, text=True, timeout=_PROBE_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


class _Prober:
    """Runs each interpreter at most once per (path, size, mtime)."""

    def __init__(self, cache: dict[str, object]) -> None:
        self.old = cache
        self.new: dict[str, object] = {}

    def get(self, path: Path, argv: list[str]) -> object:
        key = _probe_key(path)
        if key is None:
            return None
        value = self.old[key] if key in self.old else _run(argv)
        self.new[key] = value
        return value


def _path_dirs(env: Mapping[str, str]) -> Iterator[Path]:
    seen: set[str] = set()
    for raw in env.get("PATH", "").split(os.pathsep):
        if not raw or raw in seen or "shims" in Path(raw).parts:
            continue  # pyenv/asdf shims are dispatchers, not interpreters
        seen.add(raw)
        yield Path(raw)


def _pythons(env: Mapping[str, str], prober: _Prober) -> Iterator[_Found]:
    candidates: list[Path] = []
    for d in _path_dirs(env):
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(d)):
                # startswith first: a refresh runs for every job, over every PATH entry
                if name.startswith("python3") and _PYTHON3.fullmatch(name):
                    candidates.append(d / name)
    roots = [
        Path(env.get("PYENV_ROOT") or Path(env.get("HOME", "~")) / ".pyenv").expanduser()
        / "versions",
        Path(
            env.get("UV_PYTHON_INSTALL_DIR")
            or Path(env.get("XDG_DATA_HOME") or Path(env.get("HOME", "~")) / ".local/share")
            / "uv/python"
        ).expanduser(),
    ]
    for root in roots:
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(root)):
                exe = root / name / "bin" / "python3"
                if exe.exists():
                    candidates.append(exe)
    seen: set[str] = set()
    for exe in candidates:
        if not os.access(exe, os.X_OK):
            continue
        real = str(exe.resolve())
        if real in seen:
            continue
        seen.add(real)
        out = prober.get(exe, [str(exe), "-c", _PY_PROBE])
        if not isinstance(out, str):
            continue
        try:
            (major, minor, micro), level, prefix, impl = json.loads(out)
        except (ValueError, TypeError):
            continue
        if impl != "cpython" or level != "final":
            continue
        version = f"{major}.{minor}.{micro}"
        if (Path(prefix) / "bin" / "python").resolve() == Path(real):
            yield _Found("Python", version, prefix)
        else:
            names = ("python", "python3", f"python{major}.{minor}")
            yield _Found("Python", version, "", tuple((n, real) for n in names))


def _node(env: Mapping[str, str], prober: _Prober) -> Iterator[_Found]:
    exe = shutil.which("node", path=env.get("PATH"))
    if not exe:
        return
    out = prober.get(Path(exe), [exe, "--version"])
    if isinstance(out, str) and re.fullmatch(r"v\d+\.\d+\.\d+", out.strip()):
        real = Path(exe).resolve()
        links = [("node", str(real))]
        for extra in ("npm", "npx", "corepack"):
            other = shutil.which(extra, path=env.get("PATH"))
            if other:
                links.append((extra, other))
        yield _Found("node", out.strip()[1:], "", tuple(links))


def _go(env: Mapping[str, str], prober: _Prober) -> Iterator[_Found]:
    exe = shutil.which("go", path=env.get("PATH"))
    if not exe:
        return
    out = prober.get(Path(exe), [exe, "env", "GOROOT", "GOVERSION"])
    if isinstance(out, str):
        lines = out.split()
        if len(lines) == 2 and (m := re.fullmatch(r"go(\d+\.\d+(?:\.\d+)?)", lines[1])):
            version = m.group(1) if m.group(1).count(".") == 2 else m.group(1) + ".0"
            yield _Found("go", version, lines[0])


def _uv(env: Mapping[str, str], prober: _Prober) -> Iterator[_Found]:
    exe = shutil.which("uv", path=env.get("PATH"))
    if not exe:
        return
    out = prober.get(Path(exe), [exe, "--version"])
    if isinstance(out, str) and (m := re.match(r"uv (\d+\.\d+\.\d+)", out.strip())):
        real = str(Path(exe).resolve())
        links = [("uv", real)]
        uvx = shutil.which("uvx", path=env.get("PATH"))
        if uvx:
            links.append(("uvx", str(Path(uvx).resolve())))
        # setup-uv puts the version directory itself on PATH (no bin/)
        yield _Found("uv", m.group(1), "", tuple(links))


def _java(env: Mapping[str, str], prober: _Prober) -> Iterator[_Found]:
    exe = shutil.which("java", path=env.get("PATH"))
    if not exe:
        return
    home = Path(exe).resolve().parent.parent
    release = home / "release"
    try:
        text = release.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    m = re.search(r'^JAVA_VERSION="(\d+)(?:\.(\d+))?(?:\.(\d+))?', text, re.M)
    if m and (home / "bin" / "javac").exists():
        version = ".".join(x or "0" for x in m.groups())
        yield _Found("Java_Temurin-Hotspot_jdk", version, str(home))


def _discover(env: Mapping[str, str], prober: _Prober) -> list[_Found]:
    found: dict[tuple[str, str], _Found] = {}
    for finder in (_pythons, _node, _go, _uv, _java):
        for f in finder(env, prober):
            found.setdefault((f.tool, f.version), f)  # first on PATH wins
    return list(found.values())


def _read_manifest(root: Path) -> dict[str, Any]:
    """`root`'s manifest of the entries preloop laid out for the host and of
    its probes; empty when there is none (or it is not one)."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


@contextlib.contextmanager
def _locked(root: Path, *, shared: bool = False) -> Iterator[None]:
    """A refresh and `adopt_job_tools` hold it exclusively; jobs laying out
    their tool cache from `root` hold it shared, so that none sees an entry
    half re-laid or half moved in."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".preloop-host.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _describe(f: _Found) -> str:
    return f.target or json.dumps(list(f.binaries))


def _arch_for(tool: str, arch: str) -> str:
    """astral-sh/setup-uv names architectures as uv's release files do."""
    if tool == "uv":
        return {"x64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    return arch


def _lay_out(root: Path, arch: str, f: _Found) -> None:
    version_dir = root / f.tool / f.version
    version_dir.mkdir(parents=True, exist_ok=True)
    dest = version_dir / arch
    marker = version_dir / f"{arch}.complete"
    marker.unlink(missing_ok=True)
    _remove(dest)
    if f.target:
        os.symlink(f.target, dest)
    else:
        bindir = dest if f.tool == "uv" else dest / "bin"
        bindir.mkdir(parents=True)
        for name, target in f.binaries:
            os.symlink(target, bindir / name)
    marker.write_text("")


def refresh_tool_cache(root: Path, env: Mapping[str, str] | None = None) -> list[ToolEntry]:
    """Brings `root` in line with the host's toolchains (see the module
    docstring) and returns what it holds. Safe to call from several
    processes: one refresh at a time per tool cache."""
    env = os.environ if env is None else env
    root = Path(root)
    arch = tool_arch()
    with _locked(root):
        _finish_adoptions(root)
        manifest_path = root / MANIFEST
        manifest = _read_manifest(root)
        prober = _Prober(dict(manifest.get("probes") or {}))
        found = _discover(env, prober)
        old: dict[str, str] = dict(manifest.get("entries") or {})
        new: dict[str, str] = {}
        for f in found:
            rel = f"{f.tool}/{f.version}/{_arch_for(f.tool, arch)}"
            desc = _describe(f)
            dest = root / rel
            ours = rel in old
            if not ours and (dest.exists() or dest.is_symlink()):
                # installed there by a setup action (or moved there from a
                # job's own directory by adopt_job_tools): leave it alone
                continue
            complete = (root / f"{rel}.complete").exists()
            if not ours or old[rel] != desc or not complete or not dest.exists():
                _lay_out(root, _arch_for(f.tool, arch), f)
            new[rel] = desc
        for tool, _ in SETUP_ACTIONS.values():
            # A job's tool cache links each tool directory present here: one
            # that exists before a setup action first downloads that tool is
            # where the download lands, for every later job too.
            (root / tool).mkdir(exist_ok=True)
        for rel in set(old) - set(new):  # the toolchain left the host
            (root / f"{rel}.complete").unlink(missing_ok=True)
            _remove(root / rel)
            with contextlib.suppress(OSError):
                (root / rel).parent.rmdir()
        write_text_atomic(
            manifest_path, json.dumps({"entries": new, "probes": prober.new}, indent=1)
        )
    return list_tool_cache(root)


#: Seconds a process goes without looking at the host's toolchains again: a
#: refresh stats every PATH entry and interpreter (a few ms, under the lock
#: every job's layout takes too); a toolchain installed on the host is seen
#: by the jobs that start this long after.
REFRESH_EVERY = 2.0
_refreshed: dict[Path, float] = {}
_refreshed_lock = threading.Lock()


def refresh_now_and_then(root: Path) -> None:
    """`refresh_tool_cache(root)` before a job, unless this process did it
    less than REFRESH_EVERY seconds ago and `root` is still there."""
    root = Path(root)
    with _refreshed_lock:
        last = _refreshed.get(root)
    recent = last is not None and time.monotonic() - last < REFRESH_EVERY
    if recent and (root / MANIFEST).exists():
        return
    refresh_tool_cache(root)
    with _refreshed_lock:
        _refreshed[root] = time.monotonic()


def _versions(root: Path) -> Iterable[tuple[str, str, str]]:
    with contextlib.suppress(OSError):
        for tool in sorted(os.listdir(root)):
            if tool.startswith(".") or not (root / tool).is_dir():
                continue
            for version in sorted(os.listdir(root / tool)):
                if not _VERSION.match(version.split("-")[0].split("+")[0]):
                    continue
                for name in sorted(os.listdir(root / tool / version)):
                    if name.endswith(".complete"):
                        arch = name[: -len(".complete")]
                        if (root / tool / version / arch).exists():
                            yield tool, version, arch


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def list_tool_cache(root: Path) -> list[ToolEntry]:
    """Every complete `<tool>/<version>/<arch>` in `root`, newest version first per tool."""
    root = Path(root)
    ours = set(_read_manifest(root).get("entries") or {})
    entries = []
    for tool, version, arch in _versions(root):
        rel = f"{tool}/{version}/{arch}"
        path = root / rel
        source = os.readlink(path) if path.is_symlink() else str(path)
        if not path.is_symlink() and (path / "bin" / "python").is_symlink():
            source = str(Path(os.readlink(path / "bin" / "python")))
        elif not path.is_symlink():
            links = sorted(
                (path / "bin").iterdir() if (path / "bin").is_dir() else path.iterdir(),
                key=lambda p: (p.name != tool.lower(), p.name),
            )
            first = links[0] if links else None
            if first is not None and first.is_symlink():
                source = os.readlink(first)
        entries.append(
            ToolEntry(
                tool, version, arch, str(path), source, "host" if rel in ours else "installed"
            )
        )
    entries.sort(key=lambda e: (e.tool.lower(), [-x for x in _version_key(e.version)]))
    return entries


#: In a job's tool cache: a link to the shared tool cache it was laid out from.
SHARED_LINK = ".preloop-shared"
_PYTHON = "Python"
_LIB_DIR = re.compile(r"python\d+\.\d+t?")
# pip's own console scripts import its entry point, which moved between pip
# versions (pip._internal, .main, .cli.main); running the package the way
# `python -m pip` does works with whichever pip the base interpreter has.
_PIP_SCRIPT = """\
# -*- coding: utf-8 -*-
# The base interpreter's pip, run by this environment's python: what it
# installs lands in this environment (written by preloop; pip replaces it
# when it installs itself here).
import runpy
if __name__ == "__main__":
    runpy.run_module("pip", run_name="__main__")
"""


# pip's (distlib's) console-script template.
_ENTRY_SCRIPT = """\
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {name}
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit({call}())
"""
_SCRIPT_NAME = re.compile(r"[\w.+-]+")
_VERSIONED_INSTALLER = re.compile(r"pip\d+(\.\d+)?|easy_install-\d+\.\d+")


_SH_SHEBANG = """\
#!/bin/sh
'''exec' "PYTHON" "$0" "$@"
' '''
"""


def _shebang(python: str) -> str:
    """pip's (distlib's) rule: a path too long for a shebang line everywhere,
    or with a space in it, is run through /bin/sh instead."""
    if len(python) + 3 <= 127 and " " not in python:
        return f"#!{python}\n"
    return _SH_SHEBANG.replace("PYTHON", python)


def _write(path: str, text: str, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _entry_points(site: str) -> tuple[tuple[str, str, str], ...]:
    """`(script, module, attribute)` of every console and GUI script the
    distributions installed in the directory `site` declare."""
    try:
        mtime = os.stat(site).st_mtime_ns
        listed = os.listdir(site)
    except OSError:
        return ()
    dists = tuple(sorted(n for n in listed if n.endswith((".dist-info", ".egg-info"))))
    return _read_entry_points(site, mtime, dists)


@functools.lru_cache(maxsize=64)
def _read_entry_points(
    site: str, mtime_ns: int, dists: tuple[str, ...]
) -> tuple[tuple[str, str, str], ...]:
    """`_entry_points`, read once per state of `site`: installing, upgrading
    or removing a distribution changes its metadata directories (their names
    carry the version) and the directory's mtime. Every job lays out a venv
    over each base; reading each distribution's metadata again for each job
    would cost more than the rest of that layout."""
    from importlib.metadata import distributions

    found = []
    for dist in distributions(path=[site]):
        for ep in dist.entry_points:
            if ep.group not in ("console_scripts", "gui_scripts"):
                continue
            # EntryPoint's pattern (`module:attr [extras]`) keeps the module
            # and attribute to dotted names: nothing else reaches the script.
            match = ep.pattern.match(ep.value)
            if match and match["attr"] and _SCRIPT_NAME.fullmatch(ep.name):
                found.append((ep.name, match["module"], match["attr"]))
    return tuple(found)


def _console_scripts(site: str, bindir: str) -> None:
    """The base's console scripts, run by the venv's python. A distribution
    installed in the base counts as installed here (system site packages
    are visible), so `pip install pytest` answers "already satisfied" and
    makes no script: without these, `pytest` would be found further down
    PATH (a pyenv shim, another Python) or not at all. pip writes its own
    over one of these when it installs that distribution here."""
    shebang = _shebang(f"{bindir}/python")
    for script, module, attribute in _entry_points(site):
        if _VERSIONED_INSTALLER.fullmatch(script):
            # pip's own installer drops these (their names carry the Python
            # the wheel was built with: pip3.9 in a 3.10) and writes its own:
            # here `pip` and `pipX.Y` are already written.
            continue
        text = _ENTRY_SCRIPT.format(module=module, name=attribute.split(".")[0], call=attribute)
        with contextlib.suppress(FileExistsError):  # python*, pip*: already written
            _write(f"{bindir}/{script}", shebang + text, 0o755)


def _interpreter(entry: str, xy: str, t: str) -> str | None:
    for name in ("python", f"python{xy}{t}", f"python{xy.split('.')[0]}"):
        exe = os.path.realpath(f"{entry}/bin/{name}")
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return exe
    return None


def _own_interpreter(exe: str, dest: str) -> None:
    """The venv's `bin/python`: the base's interpreter binary, as a hard link
    (a copy where the file system or its owner refuses one: `venv --copies`),
    never a symlink. On GitHub the tool cache Python on PATH is a real
    install: what resolves `python3` on PATH with realpath(3) and looks
    beside it for `../lib/pythonX.Y/site-packages` (zuban does, to find the
    packages a job installed) must land in this venv, not in the user's base
    interpreter. Python finds the venv's `pyvenv.cfg` beside the binary either way."""
    try:
        os.link(exe, dest)
    except OSError:
        shutil.copy2(exe, dest)


def _python_venv(entry: str, dest: str, version: str, arch: str) -> bool:
    """Writes at `dest` the virtual environment `python -m venv
    --system-site-packages --without-pip` would make over the interpreter of
    the tool cache entry `entry` (see CPython's Lib/venv/__init__.py),
    without running anything, plus what setup-python and builds expect of a
    tool cache Python: `pip` scripts running the base's pip with this
    environment's python, the console scripts of the base's other
    distributions, the base's `lib/` entries (libpython, pkgconfig:
    setup-python points LD_LIBRARY_PATH and PKG_CONFIG_PATH there) and its
    `pythonX.Y-config` scripts. False when `entry` has no interpreter."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return False
    major, xy = m[1], f"{m[1]}.{m[2]}"
    t = "t" if arch.endswith("-freethreaded") else ""
    exe = _interpreter(entry, xy, t)
    if exe is None:
        return False
    prefix = os.path.realpath(entry)
    own = exe.startswith(prefix + os.sep)  # a whole prefix: pyenv's, uv's, a download
    bindir, lib = f"{dest}/bin", f"{dest}/lib"
    for d in (dest, bindir, lib, f"{lib}/python{xy}{t}", f"{lib}/python{xy}{t}/site-packages"):
        os.mkdir(d)
    os.symlink("lib", f"{dest}/lib64")  # as CPython's venv does on 64-bit POSIX
    _write(
        f"{dest}/pyvenv.cfg",
        f"home = {os.path.dirname(exe)}\n"
        "include-system-site-packages = true\n"
        f"version = {xy}.{m[3] or 0}\n"
        f"executable = {exe}\n"
        f"command = {exe} -m venv --system-site-packages --without-pip {dest}\n",
    )
    if (int(major), int(m[2])) < (3, 11):
        # Before 3.11 a venv's sys._base_executable is its own python, so a
        # `python -m venv .venv` made with it points `home` into this job's
        # directory, and a .venv that outlives the job (actions/cache, $HOME)
        # breaks with it; 3.11 derives it from `home` here.
        _write(
            f"{lib}/python{xy}{t}/site-packages/_preloop_base_executable.pth",
            f"import sys; sys._base_executable = {exe!r}\n",
        )
    _own_interpreter(exe, f"{bindir}/python")
    for name in [f"python{major}", f"python{xy}"] + ([f"python{xy}t"] if t else []):
        # more names of that same file: a hard link costs a fraction of a
        # new symlink's inode, and reads the same
        os.link(f"{bindir}/python", f"{bindir}/{name}", follow_symlinks=False)
    _write(f"{bindir}/pip", _shebang(f"{bindir}/python") + _PIP_SCRIPT, 0o755)
    for name in (f"pip{major}", f"pip{xy}"):
        os.link(f"{bindir}/pip", f"{bindir}/{name}")  # pip replaces each name on its own
    # A link to pythonX.Y-config would name this directory as the prefix
    # (the script derives it from its own path), whose include/ is empty:
    # the base's own script gives the base's headers and libraries.
    config = f"{os.path.dirname(exe)}/python{xy}{t}-config"
    if os.path.exists(config):
        _write(f"{bindir}/python{xy}{t}-config", f'#!/bin/sh\nexec "{config}" "$@"\n', 0o755)
        for name in ("python3-config", "python-config") if own else ():
            if os.path.exists(f"{prefix}/bin/{name}"):
                os.link(f"{bindir}/python{xy}{t}-config", f"{bindir}/{name}")
    if own:  # a system interpreter's lib/ is the system's: nothing of it is the tool's
        # (and its scripts are in /usr/bin, on PATH anyway)
        _console_scripts(f"{prefix}/lib/python{xy}{t}/site-packages", bindir)
        try:
            names = os.listdir(f"{prefix}/lib")
        except FileNotFoundError:
            names = []
        for name in names:
            if not _LIB_DIR.fullmatch(name):
                os.symlink(f"{prefix}/lib/{name}", f"{lib}/{name}")
    return True


def uv_base_bin(location: str, tool_cache: str) -> str | None:
    """For the tool cache Python at `location` (a `pythonLocation` set by
    setup-python) of the job's tool cache `tool_cache`, a venv uv passes over:
    a directory holding its base interpreter under `python`, `python3` and
    `pythonX.Y`, for PATH after the venv's own `bin`. It is kept in the shared
    tool cache: a venv uv makes from it names it as its `home`, and one kept
    beyond the job (actions/cache) must still find it, as one made on GitHub
    finds its tool cache's Python. None when `location` is not such a venv."""
    venv = Path(location)
    if not venv.is_relative_to(tool_cache) or not (venv / "bin/python").exists():
        return None
    try:
        cfg = dict(
            line.split(" = ", 1)
            for line in (venv / "pyvenv.cfg").read_text(encoding="utf-8").splitlines()
            if " = " in line
        )
    except OSError:
        return None
    exe, m = cfg.get("executable", ""), re.match(r"(\d+)\.(\d+)", cfg.get("version", ""))
    if not os.path.isabs(exe) or m is None:
        return None
    base_bin = shared_tool_cache(Path(tool_cache)) / ".uv-base" / f"{venv.parent.name}-{venv.name}"
    base_bin.mkdir(parents=True, exist_ok=True)
    for alias in {"python", f"python{m[1]}", f"python{m[1]}.{m[2]}", os.path.basename(exe)}:
        link = base_bin / alias
        with contextlib.suppress(OSError):
            if os.readlink(link) == exe:
                continue
        # Missing, dangling or another interpreter's (a state directory shared
        # by hosts, a re-pointed entry): replaced at once, never absent.
        tmp = base_bin / f".{alias}.{os.getpid()}.{threading.get_ident()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(exe, tmp)
        os.replace(tmp, link)
    return str(base_bin)


def job_tool_cache(shared: Path, dest: Path) -> Path:
    """Lays out a job's own tool cache at `dest` (a new directory, removed
    with the job) over the shared tool cache `shared`, and returns `dest`.

    Each complete `Python/<version>/<arch>` of `shared` (the host's and those
    setup actions installed there alike) becomes a virtual environment over
    it. On GitHub every job starts from a pristine tool cache Python; here
    the shared entry is the user's own interpreter (pyenv's, uv's, the
    system's), which a job's `pip install` must never change nor hand on to
    other jobs; a Debian interpreter's EXTERNALLY-MANAGED marker does not
    apply in a venv, so `pip install` works as it does on GitHub. Python 2
    has no venv: its entries are linked as they are. Every other tool
    directory is a link to the shared one, so setup actions that download
    that tool fill the shared cache; what they download into the job's own
    directories is moved there by `adopt_job_tools` when the job ends.

    Written by hand, no `python -m venv` per version per job: some 30
    files, links and directories per interpreter (more with many console
    scripts), about 1 ms where creating a file costs ~25 µs; `python -m
    venv` would take tens of ms each. On a file system where creating
    costs far more (this machine's /tmp: 0.4-0.8 ms) it shows per job."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    os.symlink(shared, dest / SHARED_LINK)
    with _locked(Path(shared), shared=True):
        for tool in sorted(os.listdir(shared)):
            if tool.startswith("."):
                continue
            if tool != _PYTHON:
                os.symlink(shared / tool, dest / tool)
                continue
            for version in sorted(os.listdir(shared / tool)):
                _job_python(shared / tool / version, dest / tool / version, version)
    return dest


# What names the tool cache in a step: `$RUNNER_TOOL_CACHE`, `${{
# runner.tool_cache }}`, `$AGENT_TOOLSDIRECTORY`, a hosted runner's
# `/opt/hostedtoolcache` path.
_NAMES_TOOL_CACHE = re.compile(r"tool[-_]?cache|toolsdirectory", re.IGNORECASE)


# GitHub's actions that never read the tool cache (their inputs are still
# searched for a name of it, as every step's are: a cache `path:` may be one).
_NO_TOOL_CACHE_ACTIONS = frozenset(
    {
        "actions/checkout",
        "actions/upload-artifact",
        "actions/download-artifact",
        "actions/cache",
        "actions/cache/restore",
        "actions/cache/save",
    }
)


def _action_name(uses: str) -> str:
    """`owner/repo[/path]` of a `uses:` value, lowercased, without its ref."""
    return uses.split("@", 1)[0].strip().lower()


def job_uses_tool_cache(spec: Mapping[str, Any]) -> bool:
    """Whether the job of step spec `spec` may read its tool cache: it runs
    an action other than checkout, artifacts and cache (setup actions look
    there; a local or composite action may run one), or one of its steps,
    its `env` or its `defaults` names the tool cache. Any other job (`run:`
    steps after `actions/checkout`, the usual test job without a setup
    action) is given an empty directory instead of `job_tool_cache`'s
    layout: some 30 creates per host interpreter, 10-150 ms a job where
    creating an inode is slow, for jobs that never look. A script a step
    runs is not read: where one reads `RUNNER_TOOL_CACHE` itself
    (`@actions/tool-cache` from a `node` script), PRELOOP_TOOL_CACHE_LAYOUT
    =always lays out every job's."""
    from preloop import config

    if config.get("PRELOOP_TOOL_CACHE_LAYOUT") == "always":
        return True
    if "python" in json.dumps(spec.get("container"), default=str).lower():
        return True  # `container: python:3.12`: see container_python
    steps = spec.get("steps") or []
    for step in steps:
        uses = step.get("uses") if isinstance(step, Mapping) else None
        if uses and _action_name(str(uses)) not in _NO_TOOL_CACHE_ACTIONS:
            return True
    text = json.dumps([steps, spec.get("env"), spec.get("defaults")], default=str)
    return _NAMES_TOOL_CACHE.search(text) is not None


#: Docker Hub's official Python image, any variant (`python:3.12`,
#: `python:3.12.4-slim-bookworm`, `docker.io/library/python:3.13`).
_PYTHON_IMAGE = re.compile(r"(?:docker\.io/)?(?:library/)?python:(\d+\.\d+(?:\.\d+)?)(?:-[\w.-]+)?")


def container_python(image: str, tool_cache: Path) -> tuple[str, Path | None] | None:
    """For a job's `container:` image that is Python's official image:
    `(version, venv)`, the version its tag names and the newest Python of
    the job's tool cache `tool_cache` that matches it (a venv, see
    `job_tool_cache`; None when the host has no such version). None for any
    other image. GitHub runs such a job's steps in that image, where
    `python` and `pip` are that version and what they install goes with the
    container: the job's own venv is the nearest thing on this host."""
    m = _PYTHON_IMAGE.fullmatch(image.strip())
    if m is None:
        return None
    arch = tool_arch()
    for e in list_tool_cache(tool_cache):
        if e.tool == _PYTHON and e.arch == arch and _matches(e.version, m[1]):
            return m[1], Path(e.path)
    return m[1], None


def _job_python(shared: Path, dest: Path, version: str) -> None:
    try:
        names = os.listdir(shared)
    except NotADirectoryError:
        return
    for name in names:
        if not name.endswith(".complete"):
            continue
        arch = name[: -len(".complete")]
        entry = shared / arch
        if not entry.exists():
            continue
        dest.mkdir(parents=True, exist_ok=True)
        major = re.match(r"\d+", version)
        if major is not None and int(major[0]) < 3:
            os.symlink(entry, dest / arch)
        elif not _python_venv(str(entry), str(dest / arch), version, arch):
            continue
        (dest / name).touch()


def _job_installs(job: Path) -> Iterator[tuple[str, str, str]]:
    """`(tool, version, arch)` of each complete entry a setup action wrote in
    the job's tool cache `job` itself: in a real tool directory (a link is
    the shared cache's own), a real `<arch>` directory (Python 2's entries
    are links to the shared ones) holding no `pyvenv.cfg`. A venv is never a
    setup action's install: it is what `job_tool_cache` made over a shared
    entry (or one a step made), and only means something beside its base."""
    for tool in os.listdir(job):
        tool_dir = job / tool
        if tool.startswith(".") or tool_dir.is_symlink() or not tool_dir.is_dir():
            continue
        for version in os.listdir(tool_dir):
            version_dir = tool_dir / version
            if version_dir.is_symlink() or not version_dir.is_dir():
                continue
            for name in os.listdir(version_dir):
                arch = name.removesuffix(".complete")
                entry = version_dir / arch
                if (
                    arch != name
                    and not entry.is_symlink()
                    and entry.is_dir()
                    and not (entry / "pyvenv.cfg").exists()
                ):
                    yield tool, version, arch


def _relocate_scripts(entry: Path, olds: Iterable[str], new: str) -> None:
    """Rewrites the shebangs of `entry/bin`'s scripts that name the entry by
    its old path (pip's, which setup-python's install writes with
    `ensurepip`; PyPy's `bin/` is on a later job's PATH as it is) to name it
    by the new one. In the first three lines only: a long path is run
    through /bin/sh, named on the second line (pip's `exec` form)."""
    bindir = entry / "bin"
    if not bindir.is_dir():
        return
    for script in bindir.iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        with open(script, "rb") as f:
            if f.read(2) != b"#!":
                continue
            f.seek(0)
            text = b"".join(f.readline() for _ in range(3))
            rest = f.read()
        fixed = text
        for old in olds:
            fixed = fixed.replace(old.encode() + b"/", new.encode() + b"/")
        if fixed == text:
            continue
        tmp = script.with_name(f".{script.name}.preloop-tmp")
        tmp.write_bytes(fixed + rest)
        os.chmod(tmp, script.stat().st_mode & 0o7777)
        os.replace(tmp, script)


#: Where `adopt_job_tools` notes each entry it is moving in (the entry and
#: the job paths its scripts may name): written before the move, removed after
#: the marker, so that an adoption a crash cut short is finished (or its entry
#: removed) by the next refresh or adoption rather than left without a marker,
#: which nothing uses and no later adoption replaces. One directory, so the
#: refresh before every job looks at it with one `listdir`.
_ADOPTING = ".preloop-adopting"


def _adoption_note(root: Path, rel: str) -> Path:
    return root / _ADOPTING / rel.replace("/", "%")


def _finish_adoptions(root: Path) -> None:
    """Under `root`'s exclusive lock: completes each adoption a crash cut
    short (its scripts relocated again, which is idempotent, then its marker)
    and drops the note of one cut short before its move."""
    notes = root / _ADOPTING
    try:
        names = os.listdir(notes)
    except FileNotFoundError:
        return
    for name in names:
        note = notes / name
        if not name.startswith("."):  # not a note cut short while written
            try:
                noted = json.loads(note.read_text())
                dest = root / noted["entry"]
                marker = dest.with_name(f"{dest.name}.complete")
                if dest.is_dir() and not dest.is_symlink() and not marker.exists():
                    try:
                        _relocate_scripts(dest, [str(o) for o in noted["olds"]], str(dest))
                        marker.touch()
                    except OSError as exc:
                        _log.warning(
                            "tool cache: removing %s, cut short while adopted: %s", dest, exc
                        )
                        _remove(dest)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                _log.warning("tool cache: dropping the unreadable adoption note %s: %s", note, exc)
        note.unlink(missing_ok=True)


def adopt_job_tools(job: Path) -> list[str]:
    """Moves into the shared tool cache what setup actions installed in the
    job's tool cache `job` itself (see `_job_installs`; a download into a
    linked tool directory is there already) and returns the `<tool>/<version>/
    <arch>` it moved. An entry the shared cache has (complete or not) or
    that a refresh laid out for the host stays in the job, to go with it, as
    does one without its `.complete` marker (an interrupted download).

    Under the shared cache's lock, so that no refresh nor job layout sees
    half an entry: the `<arch>` directory is renamed there (no copy: both
    are under the state directory; on another filesystem it stays in the
    job), its scripts' shebangs rewritten, and its marker written last. A
    note (in `.preloop-adopting/`) lasts from before the move to after the
    marker: a crash in between leaves it for the next refresh or adoption to
    finish. Called again, it finds nothing left to move. Never raises for a failure (a
    warning is logged): the job's result does not depend on it. For a job
    that ended, before its directory is removed."""
    job = Path(job)
    shared = shared_tool_cache(job)
    if shared == job:
        return []  # not a job's tool cache, or the job never got one
    adopted: list[str] = []
    try:
        found = sorted(_job_installs(job))
        if not found:
            return adopted  # the usual job: no lock to wait for
        with _locked(shared):
            _finish_adoptions(shared)
            host = set(_read_manifest(shared).get("entries") or {})
            for tool, version, arch in found:
                rel = f"{tool}/{version}/{arch}"
                src, dest = job / rel, shared / rel
                marker = dest.with_name(f"{arch}.complete")
                if rel in host or dest.exists() or dest.is_symlink() or marker.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                olds = {str(src), os.path.realpath(src)}
                note = _adoption_note(shared, rel)
                note.parent.mkdir(exist_ok=True)
                write_text_atomic(note, json.dumps({"entry": rel, "olds": sorted(olds)}))
                try:
                    os.rename(src, dest)
                except OSError as exc:
                    note.unlink(missing_ok=True)
                    if exc.errno != errno.EXDEV:
                        raise
                    _log.warning("tool cache: %s is on another filesystem than %s", job, shared)
                    break
                _relocate_scripts(dest, olds, str(dest))
                marker.touch()
                note.unlink()
                adopted.append(rel)
    except OSError as exc:
        _log.warning("tool cache: what the job installed in %s stays there: %s", job, exc)
    return adopted


def shared_tool_cache(root: Path) -> Path:
    """The shared tool cache a job's tool cache `root` was laid out from
    (`root` itself when it is not a job's)."""
    try:
        return Path(os.readlink(Path(root) / SHARED_LINK))
    except OSError:
        return Path(root)


def entries_as_dicts(entries: Iterable[ToolEntry]) -> list[dict[str, str]]:
    return [asdict(e) for e in entries]


#: setup actions served by the tool cache: (tool directory, the input naming the version)
SETUP_ACTIONS = {
    "actions/setup-python": ("Python", "python-version"),
    "actions/setup-node": ("node", "node-version"),
    "actions/setup-go": ("go", "go-version"),
    "actions/setup-java": ("Java_Temurin-Hotspot_jdk", "java-version"),
    "astral-sh/setup-uv": ("uv", "version"),
}


# How a host gets a version of each tool where `refresh_tool_cache` finds it:
# every Python pyenv or uv installed, but only the first node, go, uv and
# java on PATH.
_INSTALL_ADVICE = {
    "Python": "Install it on the host (`uv python install {spec}` or `pyenv install {spec}`)",
    "node": "Put a node {spec} first on PATH (e.g. `fnm install {spec}` or `nvm install {spec}`)",
    "go": "Put a Go {spec} toolchain's `go` first on PATH",
    "uv": "Put a uv {spec} first on PATH (e.g. `pip install uv=={spec}`)",
    "Java_Temurin-Hotspot_jdk": "Put a JDK {spec}'s `java` (with `javac`) first on PATH",
    # The host's PyPy and GraalPy are not laid out (only CPython is): a
    # download by setup-python itself is the one way in, kept once it worked.
    "PyPy": "setup-python downloads PyPy itself (from downloads.python.org): check the network "
    "(an interpreter installed on the host is not used)",
    "GraalPy": "setup-python downloads GraalPy itself (from GitHub's releases): check the "
    "network (an interpreter installed on the host is not used)",
}


def _matches(version: str, spec: str) -> bool:
    """`3.11` / `3.11.4` / `3.x` / `v20` style specs against a full version."""
    want = spec.strip().lstrip("v").split(".")
    have = version.split(".")
    return all(w in ("x", "*", "") or (i < len(have) and have[i] == w) for i, w in enumerate(want))


def setup_action_hint(root: Path, uses: str, inputs: Mapping[str, str]) -> str | None:
    """For a failed `uses:` step of a setup action asking for a version the
    host lacks: a message naming the versions the tool cache has (and what to
    do); for one it has, asked for with `check-latest: true` (which needs the
    network), that the host's is used without it. None when the action is not
    one the tool cache serves, when no plain version was asked for, or when
    the version is there (the step failed for another reason)."""
    action = _action_name(uses)
    if action not in SETUP_ACTIONS:
        return None
    tool, input_name = SETUP_ACTIONS[action]
    asked = spec = str(inputs.get(input_name) or "").strip()
    if not asked:
        return None
    arch = None  # any
    if tool == "Python":
        # setup-python's other forms: `3.15-dev` (a pre-release of 3.15),
        # `3.14t` (free-threaded: `<arch>-freethreaded` in the tool cache),
        # `pypy3.11` / `pypy-3.11` and `graalpy-24.2` (tools of their own)
        if m := re.fullmatch(r"(pypy|graalpy)-?\d+(\.\d+)*(-\S+)?", spec):
            tool, spec = ("PyPy" if m.group(1) == "pypy" else "GraalPy"), ""
        elif m := re.fullmatch(r"(\d+(\.\d+)*)(t?)(-dev)?", spec):
            spec, arch = m.group(1), ("freethreaded" if m.group(3) else None)
    if spec and not re.fullmatch(r"v?\d+(\.(\d+|x|\*))*", spec):
        return None
    root = shared_tool_cache(root)  # the one `preloop toolcache` lists, not the job's
    entries = [e for e in list_tool_cache(root) if e.tool == tool]
    # A plain version is not met by a free-threaded build (setup-python
    # takes `3.14` from `x64`, never `x64-freethreaded`).
    fitting = [
        e
        for e in entries
        if (e.arch.endswith(f"-{arch}") if arch else not e.arch.endswith("-freethreaded"))
    ]
    # `architecture: arm64` (sqlalchemy's arm legs) is met only by that one.
    machine = str(inputs.get("architecture") or "").strip().lower()
    if machine:
        fitting = [e for e in fitting if e.arch.partition("-")[0].lower() == machine]
    if matching := [e.version for e in fitting if _matches(e.version, spec)]:
        if str(inputs.get("check-latest") or "").strip().lower() != "true":
            return None  # the step failed for another reason
        # readme_renderer's `check-latest: true`: the action asks GitHub's
        # versions manifest for the newest first, even when the host has one.
        return (
            f"{action}: `check-latest: true` asks the network for the newest {tool} "
            f"matching {asked!r}; the tool cache ({root}) has {tool} {matching[0]}, which "
            "the step uses without `check-latest` where the network is out of reach"
        )
    versions = list(dict.fromkeys(e.version for e in entries))
    spec = spec or asked
    # `3.x` / `20.*`: the version to install is what comes before the wildcard.
    version = re.sub(r"(\.(x|\*))+$", "", spec.lstrip("v"))
    version += "t" if arch else ""
    install = _INSTALL_ADVICE.get(tool, "Install {spec} on the host").format(spec=version)
    what = f"free-threaded {tool}" if arch else tool
    if machine:
        what = f"{machine} {what}"
        versions = list(dict.fromkeys(f"{e.version} ({e.arch})" for e in entries))
        if any(_matches(e.version, spec) for e in entries):
            install = f"An {machine} {tool} runs on an {machine} host"
    if not versions:
        return (
            f"{action}: this host has no {what} matching {asked!r}, and the tool cache "
            f"({root}) has no {tool} at all. {install}; `preloop toolcache` lists what it has"
        )
    return (
        f"{action}: this host has no {what} matching {asked!r}; the tool cache ({root}) has "
        f"{tool} {', '.join(versions)}. {install}, or ask for one of these; "
        "`preloop toolcache` lists them"
    )
