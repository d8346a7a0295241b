"""The runner's services with GitHub's clients, side by side with copying the files.

- **artifact**: `@actions/artifact` uploads a directory to preloop's artifact
  service and downloads it again into a new directory (zip, blob PUTs, finalize,
  list, signed GET, unzip), against `cp -r` of the same directory. Two trees:
  1,000 small files (default compression), and one 200 MB incompressible file
  (`compressionLevel: 0`, as workflows upload large binaries). Target <= 2x.
- **cache**: `@actions/cache` saves a 200 MB directory (tar + zstd, create,
  upload, finalize) and restores it after the directory is removed, against
  `tar -cf` + `cp` of the archive + `tar -xf`. Target <= 1.5x. A **client
  only** line runs what the client does besides the service (loading
  `@actions/cache`, its `tar` through `zstdmt --long=30`, and back).

Two more lines split the artifact time. **service only** sends the 200 MB
file through the same HTTP calls from Python (8 MiB blocks, block list,
finalize, signed GET to a file): the service's share. **client only** runs
what GitHub's client does on its own with no service at all (loading
`@actions/artifact`, its zip of the tree into a file with a sha256 alongside,
then `unzip-stream` with a sha256 alongside, as its download does): the floor
any service leaves the client at, whatever it does.

Every round is one `node` process (its start-up is counted: a step pays it too)
against one service started for the module. Trees are built once under
`$PRELOOP_BENCH_TREES` (default /var/tmp/preloop-bench-trees).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preloop.services import ServiceAccess, job_environment, run_services
from preloop.services.tokens import Claims, mint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "js" / "services.cjs"
_rounds = itertools.count(1)


def _trees() -> Path:
    base = Path(os.environ.get("PRELOOP_BENCH_TREES", "/var/tmp/preloop-bench-trees"))
    root = base / "services-v1"
    if (base / "services-v1.complete").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    small = root / "small"
    for i in range(1000):
        d = small / f"d{i % 20}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text(f"line {i}\n" * (1 + i % 50))
    big = root / "big"
    big.mkdir(parents=True)
    with open(big / "blob.bin", "wb") as fh:
        block = os.urandom(1 << 20)
        for i in range(200):
            fh.write(block[i:] + block[:i])  # incompressible, and not one repeated block
    (base / "services-v1.complete").write_text("")
    return root


@pytest.fixture(scope="module")
def trees() -> Path:
    return _trees()


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceAccess, Path]]:
    state = tmp_path_factory.mktemp("services-state")
    with run_services(state, "/bench/repo", "refs/heads/main", "refs/heads/main") as acc:
        yield acc, state


def _env(acc: ServiceAccess, state: Path, work: Path) -> dict[str, str]:
    return {
        **os.environ,
        **job_environment(state, acc, str(next(_rounds)), "bench"),
        "NODE_PATH": str(ROOT / "node_modules"),
        "GITHUB_WORKSPACE": str(work),
        "RUNNER_TEMP": str(work / "tmp"),
    }


def _fresh(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    (work / "tmp").mkdir(parents=True)


@pytest.mark.parametrize(("tree", "level"), [("small", 6), ("big", 0)])
@pytest.mark.parametrize("impl", ["preloop", "cp -r"])
def test_artifact_round_trip(
    benchmark: Any,
    trees: Path,
    services: tuple[ServiceAccess, Path],
    tmp_path: Path,
    tree: str,
    level: int,
    impl: str,
) -> None:
    acc, state = services
    benchmark.group = (
        f"artifact upload+download: {tree} ({'1,000 files' if tree == 'small' else '200 MB'})"
    )
    benchmark.extra_info["impl"] = impl
    src = trees / tree
    work = tmp_path / "w"

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        _fresh(work)
        return (), {}

    if impl == "preloop":

        def run() -> None:
            env = _env(acc, state, work)
            subprocess.run(
                ["node", str(SCRIPT), "artifact", str(src), str(work / "out"), str(level)],
                env=env,
                cwd=work,
                check=True,
                capture_output=True,
            )

    else:

        def run() -> None:
            subprocess.run(["cp", "-r", str(src), str(work / "out")], check=True)

    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    assert sum(1 for p in (work / "out").rglob("*") if p.is_file()) == (
        1000 if tree == "small" else 1
    )


@pytest.mark.parametrize(("tree", "level"), [("small", 6), ("big", 0)])
def test_artifact_client_only(
    benchmark: Any, trees: Path, tmp_path: Path, tree: str, level: int
) -> None:
    benchmark.group = (
        f"artifact upload+download: {tree} ({'1,000 files' if tree == 'small' else '200 MB'})"
    )
    benchmark.extra_info["impl"] = "client only (GitHub's zip + unzip, no service)"
    work = tmp_path / "w"

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        _fresh(work)
        return (), {}

    def run() -> None:
        env = {
            **os.environ,
            "NODE_PATH": str(ROOT / "node_modules"),
            "RUNNER_TEMP": str(work / "tmp"),
        }
        subprocess.run(
            ["node", str(SCRIPT), "client", str(trees / tree), str(work / "out"), str(level)],
            env=env,
            cwd=work,
            check=True,
            capture_output=True,
        )

    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    assert sum(1 for p in (work / "out").rglob("*") if p.is_file()) == (
        1000 if tree == "small" else 1
    )


@pytest.mark.parametrize("impl", ["preloop", "tar + cp", "client only"])
def test_cache_save_restore(
    benchmark: Any, trees: Path, services: tuple[ServiceAccess, Path], tmp_path: Path, impl: str
) -> None:
    acc, state = services
    benchmark.group = "cache save+restore: 200 MB directory"
    benchmark.extra_info["impl"] = impl
    work = tmp_path / "w"

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        _fresh(work)
        shutil.copytree(trees / "big", work / "deps")
        return (), {}

    if impl == "preloop":

        def run() -> None:
            env = _env(acc, state, work)
            key = f"bench-{next(_rounds)}"
            subprocess.run(
                ["node", str(SCRIPT), "cache", "deps", key],
                env=env,
                cwd=work,
                check=True,
                capture_output=True,
            )

    elif impl == "client only":

        def run() -> None:
            # what @actions/cache does besides the service: load, then its tar
            # with zstd (zstdmt --long=30) to save and unzstd to restore
            env = {**os.environ, "NODE_PATH": str(ROOT / "node_modules")}
            subprocess.run(["node", "-e", "require('@actions/cache')"], env=env, check=True)
            tar = ["tar", "--posix", "-P", "-C", str(work)]
            zstd = ["--use-compress-program", "zstdmt --long=30"]
            subprocess.run([*tar, "-cf", "tmp/a.tzst", *zstd, "deps"], cwd=work, check=True)
            shutil.rmtree(work / "deps")
            unzstd = ["--use-compress-program", "unzstd --long=30"]
            subprocess.run([*tar, "-xf", "tmp/a.tzst", *unzstd], cwd=work, check=True)

    else:

        def run() -> None:
            subprocess.run(["tar", "-cf", "tmp/a.tar", "deps"], cwd=work, check=True)
            subprocess.run(["cp", "tmp/a.tar", "tmp/b.tar"], cwd=work, check=True)
            shutil.rmtree(work / "deps")
            subprocess.run(["tar", "-xf", "tmp/b.tar"], cwd=work, check=True)

    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    assert (work / "deps" / "blob.bin").stat().st_size == 200 << 20


def _service_round_trip(acc: ServiceAccess, src: Path, dest: Path) -> None:
    token = mint(acc.secret, Claims(str(next(_rounds)), "bench", "/bench/repo", "x", "x"))

    def call(method: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{acc.url}twirp/github.actions.results.api.v1.ArtifactService/{method}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    url = call("CreateArtifact", {"name": "raw", "version": 4})["signedUploadUrl"]
    ids = []
    size = 0
    with open(src, "rb") as fh:
        while block := fh.read(8 << 20):
            ids.append(base64.b64encode(f"{len(ids):06d}".encode()).decode())
            put = f"{url}&comp=block&blockid={urllib.parse.quote(ids[-1])}"
            urllib.request.urlopen(urllib.request.Request(put, data=block, method="PUT")).close()
            size += len(block)
    xml = "<BlockList>" + "".join(f"<Latest>{b}</Latest>" for b in ids) + "</BlockList>"
    put = urllib.request.Request(f"{url}&comp=blocklist", data=xml.encode(), method="PUT")
    urllib.request.urlopen(put).close()
    call("FinalizeArtifact", {"name": "raw", "size": str(size)})
    signed = call("GetSignedArtifactURL", {"name": "raw"})["signedUrl"]
    with urllib.request.urlopen(signed) as resp, open(dest, "wb") as out:
        shutil.copyfileobj(resp, out, 8 << 20)


def test_artifact_service_only(
    benchmark: Any, trees: Path, services: tuple[ServiceAccess, Path], tmp_path: Path
) -> None:
    acc, _ = services
    benchmark.group = "artifact upload+download: big (200 MB)"
    benchmark.extra_info["impl"] = "service only (HTTP from Python, no zip)"
    dest = tmp_path / "blob.bin"
    benchmark.pedantic(
        lambda: _service_round_trip(acc, trees / "big" / "blob.bin", dest), rounds=3, iterations=1
    )
    assert dest.stat().st_size == 200 << 20
