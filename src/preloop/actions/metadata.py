"""An action's metadata file (`action.yml`, else `action.yaml`), read when its step runs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from preloop.errors import PreloopError

__all__ = [
    "NODE_RUNTIMES",
    "ActionMetadata",
    "ActionMetadataError",
    "deprecated_input",
    "deprecation",
    "load_action",
    "unexpected_inputs",
]

NODE_RUNTIMES = {"node12": 12, "node16": 16, "node20": 20, "node24": 24}


class ActionMetadataError(PreloopError):
    """A missing or unusable action.yml; the message names the file."""


@dataclass(frozen=True, slots=True)
class ActionMetadata:
    path: Path  # the metadata file
    directory: Path  # GITHUB_ACTION_PATH
    name: str
    using: str  # node20, composite, docker, ...
    runs: dict[str, Any]
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_node(self) -> bool:
        return self.using in NODE_RUNTIMES

    @property
    def node_major(self) -> int:
        return NODE_RUNTIMES.get(self.using, 0)

    @property
    def raw(self) -> dict[str, Any]:
        """What job.py's composite runner reads: `inputs`, `outputs`, `runs`."""
        return {"inputs": self.inputs, "outputs": self.outputs, "runs": self.runs}


def deprecation(decl: Any) -> str:
    """An `inputs:` entry's `deprecationMessage` ("" without one)."""
    message = decl.get("deprecationMessage") if isinstance(decl, dict) else None
    return str(message) if message is not None else ""


def deprecated_input(key: str, message: str) -> str:
    """GitHub's runner's warning for a given input its action deprecates."""
    return f"Input '{key}' has been deprecated with message: {message}"


def unexpected_inputs(given: Iterable[str], declared: Mapping[str, Any]) -> str:
    """GitHub's runner's warning for given inputs the action does not declare
    (names compared in any case); "" when there are none, or when it
    declares no inputs at all."""
    names = {k.lower() for k in declared}
    unexpected = [k for k in given if k.lower() not in names]
    if not unexpected or not declared:
        return ""
    listed = ", ".join(repr(k) for k in unexpected)
    return f"Unexpected input(s) {listed}, valid inputs are {sorted(declared)}"


def load_action(directory: Path, label: str) -> ActionMetadata:
    """`label` names the action in messages (`./dir`, `owner/repo@v1`)."""
    for candidate in ("action.yml", "action.yaml"):
        path = directory / candidate
        if path.is_file():
            break
    else:
        raise ActionMetadataError(
            f"action {label!r} has no action.yml or action.yaml ({directory})"
        )
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ActionMetadataError(f"{label}: {path.name}: invalid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        raise ActionMetadataError(f"{label}: {path.name}: an action needs a `runs` mapping")
    runs = dict(data["runs"])
    using = str(runs.get("using", "")).strip().lower()
    if using in NODE_RUNTIMES:
        if not isinstance(runs.get("main"), str) or not runs["main"].strip():
            raise ActionMetadataError(f"{label}: {path.name}: `runs.main` is missing")
    elif using == "composite":
        if not isinstance(runs.get("steps"), list):
            raise ActionMetadataError(f"{label}: {path.name}: `runs.steps` is missing")
    elif using == "docker":
        if not isinstance(runs.get("image"), str) or not runs["image"].strip():
            raise ActionMetadataError(f"{label}: {path.name}: `runs.image` is missing")
    else:
        raise ActionMetadataError(
            f"{label}: {path.name}: `runs.using: {using}` is not one of "
            f"{', '.join([*NODE_RUNTIMES, 'composite', 'docker'])}"
        )
    inputs_raw = data.get("inputs") or {}
    inputs = {
        str(k): (dict(v) if isinstance(v, dict) else {})
        for k, v in (inputs_raw.items() if isinstance(inputs_raw, dict) else [])
    }
    outputs_raw = data.get("outputs") or {}
    outputs = dict(outputs_raw) if isinstance(outputs_raw, dict) else {}
    return ActionMetadata(
        path=path,
        directory=directory,
        name=str(data.get("name") or label),
        using=using,
        runs=runs,
        inputs=inputs,
        outputs=outputs,
    )
