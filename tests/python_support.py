"""Real Python installations to point the tool cache at, in a test's own directory.

A job must never change the user's interpreters, so the tests that prove it
cannot use the host's: `host_python_prefix` makes a pyenv-style prefix of the
interpreter running the tests, whose own files (the interpreter, its
`site-packages` with pip) are copies a job could change and whose standard
library is linked. `tiny_project` is a project pip installs offline (a PEP
517/660 backend in the project itself, no setuptools), and `tree_state`
captures a tree to compare byte for byte.
"""

from __future__ import annotations

import os
import platform
import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

XY = f"{sys.version_info[0]}.{sys.version_info[1]}"
VERSION = platform.python_version()

_BACKEND = '''\
"""PEP 517 and PEP 660 in a few lines, so pip builds this project offline."""
import base64
import hashlib
import os
import zipfile

NAME, VERSION = "{name}", "1.0"
DIST = f"{{NAME}}-{{VERSION}}.dist-info"


def _wheel(directory, files):
    files = {{
        **files,
        f"{{DIST}}/METADATA": f"Metadata-Version: 2.1\\nName: {{NAME}}\\nVersion: {{VERSION}}\\n",
        f"{{DIST}}/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\n"
        "Tag: py3-none-any\\n",
    }}
    name = f"{{NAME}}-{{VERSION}}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(os.path.join(directory, name), "w") as z:
        for path, text in files.items():
            data = text.encode()
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{{path}},sha256={{digest.decode()}},{{len(data)}}")
        record.append(f"{{DIST}}/RECORD,,")
        z.writestr(f"{{DIST}}/RECORD", "\\n".join(record) + "\\n")
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with open(f"{{NAME}}.py") as f:
        return _wheel(wheel_directory, {{f"{{NAME}}.py": f.read()}})


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {{f"_{{NAME}}_editable.pth": os.getcwd() + "\\n"}})
'''


_PIP_MAIN = """\
import re
import sys
from pip._internal.cli.main import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def tiny_project_files(name: str, prefix: str = "") -> dict[str, str]:
    """The files of project `name` (module `name`, `VALUE = name`) under `prefix`."""
    return {
        f"{prefix}pyproject.toml": textwrap.dedent(
            f"""\
            [build-system]
            requires = []
            build-backend = "backend"
            backend-path = ["."]

            [project]
            name = "{name}"
            version = "1.0"
            """
        ),
        f"{prefix}backend.py": _BACKEND.format(name=name),
        f"{prefix}{name}.py": f"VALUE = {name!r}\n",
    }


def tiny_project(root: Path, name: str) -> Path:
    for rel, text in tiny_project_files(name).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def host_python_prefix(root: Path, *, system: bool = False) -> Path:
    """`root/versions/<version>`: this interpreter's base as pyenv lays one
    out. Its interpreter binary and `site-packages` (pip) are copies; the
    standard library, `lib/` and `include/` entries are links. `system`:
    like a distribution's interpreter instead, no `bin/python` (the tool
    cache then links only the interpreter) and the standard library marked
    EXTERNALLY-MANAGED, so that pip refuses to install into it."""
    base = Path(sys.base_prefix)
    base_exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = base / "lib" / f"python{XY}"
    site = stdlib / "site-packages"
    pips = sorted(site.glob("pip")) + sorted(site.glob("pip-*.dist-info"))
    if not (stdlib / "os.py").exists() or len(pips) != 2 or not base_exe.is_relative_to(base):
        pytest.fail(
            f"these tests copy the interpreter running them as a pyenv-style prefix, but its "
            f"base {base} is not one with pip in {site}: run them with a pyenv, uv or "
            f"python.org build of Python"
        )
    prefix = root / "versions" / VERSION
    (prefix / "bin").mkdir(parents=True)
    exe = prefix / "bin" / f"python{XY}"
    shutil.copy2(base_exe, exe)  # a copy finds its prefix here, a link would find the base
    names = ["python3"] if system else ["python", "python3"]
    for name in names:
        (prefix / "bin" / name).symlink_to(exe.name)
    # pip's console scripts, as pyenv has them: without them `pip` in a job
    # would be whatever else is on PATH (pyenv's shim: the user's own Python)
    for name in ("pip", "pip3", f"pip{XY}"):
        script = prefix / "bin" / name
        script.write_text(f"#!{exe}\n{_PIP_MAIN}")
        script.chmod(0o755)
    config = base / "bin" / f"python{XY}-config"
    if config.exists() and not system:
        (prefix / "bin" / config.name).symlink_to(config)  # it takes the prefix from its path
    lib = prefix / "lib"
    (lib / f"python{XY}" / "site-packages").mkdir(parents=True)
    for entry in (base / "lib").iterdir():
        if entry.name != f"python{XY}":
            (lib / entry.name).symlink_to(entry)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (lib / f"python{XY}" / entry.name).symlink_to(entry)
    for entry in pips:
        # bytecode too (copy2 keeps the mtimes it is checked against): pip
        # starts several times faster than from source
        shutil.copytree(entry, lib / f"python{XY}" / "site-packages" / entry.name)
    (prefix / "include").symlink_to(base / "include")
    if system:
        (lib / f"python{XY}" / "EXTERNALLY-MANAGED").write_text(
            "[externally-managed]\nError=installed by the system's package manager\n"
        )
    return prefix


def tree_state(root: Path) -> dict[str, tuple[str, bytes, int]]:
    """Every entry under `root`, links not followed: kind, content or link
    target, and mode."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(path.relative_to(root))] = ("link", os.readlink(path).encode(), 0)
            elif stat.S_ISDIR(st.st_mode):
                out[str(path.relative_to(root))] = ("dir", b"", stat.S_IMODE(st.st_mode))
            else:
                out[str(path.relative_to(root))] = (
                    "file",
                    path.read_bytes(),
                    stat.S_IMODE(st.st_mode),
                )
    return out
