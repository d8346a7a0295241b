"""`preloop toolcache` and `preloop artifacts`: the runner's services seen from the shell.

`preloop cache status` shows the actions cache beside the snapshot object
cache through `actions_cache_document` / `print_actions_cache` here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from preloop import config
from preloop.cli.app import cli, emit_json, make_console, state_dir_option
from preloop.control import UnknownRun
from preloop.errors import PreloopError, UsageError
from preloop.services.storage import (
    LocalStorage,
    ServiceStorage,
    artifact_run_name,
    is_zip_type,
)
from preloop.services.toolcache import default_tool_cache, list_tool_cache, refresh_tool_cache

__all__ = ["actions_cache_document", "print_actions_cache", "service_storage", "store_option"]

store_option = click.option(
    "--store",
    help="Store URL (default: $PRELOOP_STORE_URL, else the lite store). On PostgreSQL, "
    "artifacts and caches are read from the store.",
)


@contextlib.contextmanager
def service_storage(state: Path, store: str | None) -> Iterator[tuple[ServiceStorage, str]]:
    """The storage `preloop run` and runners use with this store, and where it
    is (for messages): in the store on PostgreSQL, else under `state`."""
    from preloop.engine import default_store_url, open_user_store

    url = default_store_url(state, store)
    if not url.startswith(("postgresql:", "postgres:")):
        local = LocalStorage(state)
        try:
            yield local, str(state / "artifacts")
        finally:
            local.close()
        return
    from preloop.services.store_storage import StoreStorage

    with open_user_store(url, store) as db:
        shared = StoreStorage(db, state, int(config.get("PRELOOP_ACTIONS_CACHE_MAX_BYTES")))
        try:
            yield shared, shared.location
        finally:
            shared.close()


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat(timespec="seconds")


@cli.command("toolcache")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option("--no-refresh", is_flag=True, help="List what is there without scanning the host.")
def toolcache_command(state_dir: Path | None, as_json: bool, no_refresh: bool) -> None:
    """The shared tool cache (default <state>/toolcache, or $RUNNER_TOOL_CACHE).

    It is refreshed from the host's toolchains (Python on PATH, pyenv and
    uv-managed Pythons; node; go; java; uv) before listing, as before every
    job, so actions/setup-python, setup-node, setup-go, setup-java (Temurin)
    and astral-sh/setup-uv find them without a download. Each job's
    RUNNER_TOOL_CACHE is its own, laid out over this one: its Pythons are
    throwaway venvs over these, so what a job installs goes with it.
    """
    state = state_dir if state_dir is not None else config.state_dir()
    root = default_tool_cache(state)
    entries = list_tool_cache(root) if no_refresh else refresh_tool_cache(root)
    if as_json:
        emit_json(
            {
                "tool_cache": str(root),
                "entries": [
                    {
                        "tool": e.tool,
                        "version": e.version,
                        "arch": e.arch,
                        "path": e.path,
                        "source": e.source,
                        "origin": e.origin,
                    }
                    for e in entries
                ],
            }
        )
        return
    console = make_console()
    table = Table("tool", "version", "arch", "links to", "origin", box=None)
    for e in entries:
        table.add_row(e.tool, e.version, e.arch, e.source, e.origin)
    if entries:
        console.print(table)
    console.print(f"{len(entries)} versions in {root}", highlight=False)


@cli.command("artifacts")
@click.argument("run_id", type=int)
@click.option(
    "--download",
    "download",
    metavar="NAME",
    default=None,
    help="Extract artifact NAME into DIR (default: ./NAME), file modes kept; an artifact "
    "uploaded as it is (archive: false) is copied into DIR (default: .) as its file.",
)
@click.argument("directory", required=False, type=click.Path(path_type=Path, file_okay=False))
@state_dir_option
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for scripts.")
def artifacts_command(
    run_id: int,
    download: str | None,
    directory: Path | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """List the artifacts run RUN_ID (of the store) uploaded, or download one.

    Artifacts are kept as the zips the upload-artifact action made, for
    PRELOOP_ARTIFACT_RETENTION_DAYS: under <state>/artifacts/<run> with the
    lite store, in the store itself on PostgreSQL (whichever runner ran the job).
    """
    state = state_dir if state_dir is not None else config.state_dir()
    name = _artifacts_of(state, store, run_id)
    with service_storage(state, store) as (storage, where):
        if storage.remote:  # run ids are the store's own there
            name = str(run_id)
        _artifacts(storage, where, run_id, name, download, directory, as_json)


def _artifacts(
    storage: ServiceStorage,
    where: str,
    run_id: int,
    name: str | None,
    download: str | None,
    directory: Path | None,
    as_json: bool,
) -> None:
    records = storage.list_artifacts(name) if name is not None else []
    if download is None:
        if directory is not None:
            raise UsageError("DIR is only taken with --download NAME")
        if as_json:
            emit_json({"run_id": run_id, "artifacts": [r.to_dict() for r in records]})
            return
        if not records:
            other = "" if name is not None else " (those of its id there are another store's run's)"
            click.echo(f"run {run_id} has no artifacts in {where}{other}")
            return
        console = make_console()
        table = Table("id", "name", "size", "job", "created (UTC)", box=None)
        for r in records:
            table.add_row(str(r.id), r.name, _human(r.size), r.job, r.created_at)
        console.print(table)
        return
    match = [r for r in records if r.name == download]
    if not match:
        names = ", ".join(r.name for r in records) or "none"
        raise UsageError(f"run {run_id} has no artifact named {download!r} (it has: {names})")
    record = match[0]
    archive = storage.blob_path("artifact", f"{name}/{record.id}")
    if not archive.is_file():  # removed (retention, a delete) since it was listed
        raise UsageError(f"run {run_id}'s artifact {download!r} is no longer in {where}")
    if is_zip_type(record.mime_type):
        dest = (directory if directory is not None else Path(download)).absolute()
        extracted = _extract(archive, dest)
    else:  # uploaded as it is (`archive: false`): the file, named as the artifact
        dest = (directory if directory is not None else Path.cwd()).absolute()
        target = dest / Path(record.name).name
        if target.exists():
            raise UsageError(f"{target} exists: remove it or pass another DIR")
        try:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(archive, target)
        except OSError as exc:
            raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from None
        extracted = 1
    if as_json:
        emit_json({"run_id": run_id, "name": download, "directory": str(dest), "files": extracted})
    else:
        click.echo(f"extracted {extracted} files of {download!r} into {dest}")


def _artifacts_of(state: Path, store: str | None, run_id: int) -> str | None:
    """The name under <state>/artifacts of the store's run RUN_ID's artifacts
    (run ids repeat across stores sharing a state directory: the run's unique
    key tells them apart), or None when it has none there."""
    from preloop.engine import default_store_url, open_user_store

    url = default_store_url(state, store)
    db = open_user_store(url, store)
    with db:
        try:
            context = db.run_context(run_id)
        except UnknownRun:
            raise PreloopError(f"no run {run_id} in {db.url}: see `preloop status`") from None
    engine = (context.get("github") or {}).get("preloop_engine") or {}
    key = engine.get("run_key") if isinstance(engine, dict) else None
    return artifact_run_name(state, str(run_id), str(key) if key else None)


def _extract(archive: Path, dest: Path) -> int:
    """Extracts `archive` into `dest`, refusing paths that leave it, keeping modes."""
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    count = 0
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile:
        raise UsageError(f"{archive}: the artifact is not a zip archive") from None
    with zf:
        for info in zf.infolist():
            target = (root / info.filename).resolve()
            if not target.is_relative_to(root):
                raise UsageError(f"{archive}: entry {info.filename!r} leaves the directory")
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            mode = (info.external_attr >> 16) & 0o7777
            if mode:
                target.chmod(mode)
            count += 1
    return count


def actions_cache_document(state: Path, store: str | None = None) -> dict[str, Any]:
    """The actions cache (actions/cache entries) for `preloop cache status`:
    of `state`, or of the store when it is PostgreSQL."""
    cap = int(config.get("PRELOOP_ACTIONS_CACHE_MAX_BYTES"))
    with service_storage(state, store) as (storage, where):
        entries = storage.cache_entries()
        if isinstance(storage, LocalStorage):
            where = str(storage.cache_dir)
    return {
        "cache_dir": where,
        "max_bytes": cap,
        "total_bytes": sum(e.size for e in entries),
        "entries": [
            {
                "id": e.id,
                "repository": e.repo,
                "ref": e.ref,
                "key": e.key,
                "version": e.version,
                "size_bytes": e.size,
                "created": _iso(e.created),
                "last_use": _iso(e.last_used),
            }
            for e in entries
        ],
    }


def print_actions_cache(console: Console, doc: dict[str, Any]) -> None:
    table = Table("key", "ref", "bytes", "last use (UTC)", "repository", box=None)
    for e in doc["entries"]:
        table.add_row(e["key"], e["ref"], _human(e["size_bytes"]), e["last_use"], e["repository"])
    if doc["entries"]:
        console.print(table)
    cap = doc["max_bytes"]
    console.print(
        f"actions cache: {len(doc['entries'])} entries, {_human(doc['total_bytes'])} in "
        f"{doc['cache_dir']} (cap {'disabled' if cap == 0 else _human(cap)})",
        highlight=False,
    )
