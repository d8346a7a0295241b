"""GitHub's step protocols: environment files and workflow commands.

- Environment files (`GITHUB_OUTPUT`, `GITHUB_ENV`, `GITHUB_STATE`): one
  `name=value` per line, or the multi-line form `name<<DELIMITER` ...
  `DELIMITER`; `GITHUB_PATH`: one directory per line.
- Workflow commands on a step's output: `::add-mask::value`,
  `::group::title` / `::endgroup::`, `::error ...::msg`, `::warning ...::msg`,
  `::notice ...::msg`, `::debug::msg`, the deprecated `::set-output name=x::v`
  and `::save-state name=x::v`, `::set-env`/`::add-path` (a failure of the
  step unless `ACTIONS_ALLOW_UNSECURE_COMMANDS` is true, as on GitHub), and
  `::stop-commands::TOKEN` ... `::TOKEN::`, and `::add-matcher::FILE` /
  `::remove-matcher owner=X::` (problem matchers, `preloop.runner.matchers`:
  the job's registered matchers turn matching output lines into annotations);
  `::echo::`; each also in the older `##[name k=v;k=v]data` form.
- Masking (`preloop.runner.masking.Masker`): every registered value (secrets,
  `::add-mask::`) and its encoded forms are replaced by `***` in every line
  and in every property of a command (an annotation's `file=` and `title=`
  included) written after it was registered.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from preloop.errors import PreloopError
from preloop.runner.masking import MASK, Masker
from preloop.runner.matchers import MatcherError, ProblemMatchers, StepMatchers, load_matchers

__all__ = [
    "MASK",
    "Annotation",
    "CommandEffects",
    "EnvFileError",
    "Masker",
    "ProblemMatchers",
    "WorkflowCommandParser",
    "parse_env_file",
    "parse_path_file",
]


class EnvFileError(PreloopError):
    """A malformed environment file (an unterminated heredoc, a line without `=`)."""


def parse_env_file(path: Path, what: str) -> dict[str, str]:
    """`name=value` lines and `name<<DELIM` heredocs of an environment file
    (later assignments win). A missing file is empty."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return {}
    lines = text.splitlines()
    result: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip():
            continue
        eq = line.find("=")
        heredoc = line.find("<<")
        if heredoc > 0 and (eq < 0 or heredoc < eq):
            name, delimiter = line[:heredoc], line[heredoc + 2 :]
            if not name or not delimiter:
                raise EnvFileError(f"{what}: invalid heredoc line {line!r}")
            body: list[str] = []
            while i < len(lines) and lines[i] != delimiter:
                body.append(lines[i])
                i += 1
            if i >= len(lines):
                raise EnvFileError(
                    f"{what}: the value of {name!r} is not terminated by its delimiter "
                    f"{delimiter!r} on a line of its own"
                )
            i += 1
            result[name] = "\n".join(body)
        elif eq > 0:
            result[line[:eq]] = line[eq + 1 :]
        else:
            raise EnvFileError(
                f"{what}: invalid line {line!r}: use `name=value` or `name<<DELIMITER`"
            )
    return result


def parse_path_file(path: Path) -> list[str]:
    """The directories a step appended to `GITHUB_PATH`, in order."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


@dataclass(frozen=True, slots=True)
class Annotation:
    """An `::error::` / `::warning::` / `::notice::` of a step, for the summary."""

    level: str
    message: str
    job: str = ""
    step: str = ""
    file: str | None = None
    line: int | None = None
    title: str | None = None
    col: int | None = None

    def render(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.line:
                where += f":{self.line}"
                if self.col:
                    where += f":{self.col}"
            where += ": "
        title = f"{self.title}: " if self.title else ""
        return f"{self.level}: {where}{title}{self.message}"

    def masked(self, masker: Masker) -> Annotation:
        """This annotation with every string in it masked."""
        m = masker.mask
        return Annotation(
            level=self.level,
            message=m(self.message),
            job=m(self.job),
            step=m(self.step),
            file=m(self.file) if self.file is not None else None,
            line=self.line,
            title=m(self.title) if self.title is not None else None,
            col=self.col,
        )


@dataclass(slots=True)
class CommandEffects:
    """What workflow commands did during one step."""

    annotations: list[Annotation] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)  # deprecated ::set-output
    state: dict[str, str] = field(default_factory=dict)  # deprecated ::save-state
    # ::set-env / ::add-path, honoured only with ACTIONS_ALLOW_UNSECURE_COMMANDS
    env: dict[str, str] = field(default_factory=dict)
    path: list[str] = field(default_factory=list)
    failed: bool = False  # a command GitHub refuses fails the step


# The commands GitHub's runner registers (ActionCommandManager): a line
# naming another is output like any other.
_REGISTERED = frozenset(
    {
        "stop-commands",
        "set-env",
        "set-output",
        "save-state",
        "add-mask",
        "add-path",
        "add-matcher",
        "remove-matcher",
        "debug",
        "warning",
        "error",
        "notice",
        "group",
        "endgroup",
        "echo",
    }
)
# The commands whose line GitHub's runner shows as it is while `::echo::on`
# holds (the extensions without OmitEcho); add-mask shows `::add-mask::***`.
_ECHOED = frozenset(
    {
        "set-env",
        "set-output",
        "save-state",
        "add-path",
        "add-matcher",
        "remove-matcher",
        "group",
        "endgroup",
        "echo",
    }
)
# Where a line of a batch might hold a command (`line()` strips leading
# whitespace first); `\s*` may cross lines, which only finds more.
_COMMAND_START = re.compile(r"^\s*::", re.MULTILINE)
_LEGACY_PREFIX = "##["


def _unescape(s: str, mappings: tuple[tuple[str, str], ...]) -> str:
    for escaped, char in mappings:
        s = s.replace(escaped, char)
    return s


# GitHub's ActionCommand escape tables, in the order it unescapes them
_DATA = (("%0D", "\r"), ("%0A", "\n"), ("%25", "%"))
_PROPERTY = (("%0D", "\r"), ("%0A", "\n"), ("%3A", ":"), ("%2C", ","), ("%25", "%"))
_LEGACY = (("%3B", ";"), ("%0D", "\r"), ("%0A", "\n"), ("%5D", "]"), ("%25", "%"))


def _properties(text: str, separator: str, mappings: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """`k=v` pairs as GitHub's runner reads them: an empty key or value is
    dropped, keys are matched without regard to case."""
    props: dict[str, str] = {}
    for item in text.split(separator):
        k, eq, v = item.partition("=")
        if k and eq and v:
            props[k.lower()] = _unescape(v, mappings)
    return props


def parse_command(
    line: str, registered: frozenset[str] = _REGISTERED
) -> tuple[str, dict[str, str], str] | None:
    """(name, properties, data) of a workflow command, or None: GitHub's
    `ActionCommand.TryParseV2` (`::name k=v,k=v::data` after leading
    whitespace), then `TryParse`, the older `##[name k=v;k=v]data` anywhere
    in the line (setup-python still writes `##[add-matcher]`). The name is
    one the runner registers, in any case."""
    stripped = line.lstrip()
    if stripped.startswith("::"):
        end = stripped.find("::", 2)
        if end >= 0:
            info = stripped[2:end]
            name, _, props = info.partition(" ")
            if name.lower() in registered:
                data = _unescape(stripped[end + 2 :], _DATA)
                return name.lower(), _properties(props.strip(), ",", _PROPERTY), data
    start = line.find(_LEGACY_PREFIX)
    if start >= 0:
        end = line.find("]", start)
        if end >= 0:
            info = line[start + len(_LEGACY_PREFIX) : end]
            name, _, props = info.partition(" ")
            if name.lower() in registered:
                data = _unescape(line[end + 1 :], _LEGACY)
                return name.lower(), _properties(props, ";", _LEGACY), data
    return None


class WorkflowCommandParser:
    """Interprets one step's output line by line. `line()` returns the text to
    log (None to hide the line), after masking; `lines()` does it for a batch."""

    def __init__(
        self,
        masker: Masker,
        job: str,
        step: str,
        *,
        debug: bool = False,
        allow_unsecure: bool = False,
        matchers: ProblemMatchers | None = None,
        workspace: Path | None = None,
        host_path: Callable[[Path], Path] | None = None,
    ) -> None:
        self.masker = masker
        self._debug = debug  # show `::debug::` lines (step debug logging)
        # ACTIONS_ALLOW_UNSECURE_COMMANDS: `::set-env` / `::add-path` allowed
        self._allow_unsecure = allow_unsecure
        self.effects = CommandEffects()
        self._job = job
        self._step = step
        self._stopped: str | None = None
        # `::echo::on`: the step's command lines are shown (from the start
        # with step debug logging, as GitHub's runner has it)
        self._echo = debug
        # the job's problem matchers (a step's own parser without a job has
        # none), and the step's view of the workspace and host paths
        self._matchers = StepMatchers(matchers or ProblemMatchers(), workspace, host_path)

    def _relative(self, file: str | None) -> str | None:
        """An annotation's absolute `file=` under the workspace, relative to
        it, as GitHub's runner makes it (IssueCommandExtension): `src/a.py`,
        not the job directory's path a linter prints."""
        if not file or not os.path.isabs(file):
            return file
        return self._matchers.relative(file) or file

    def lines(self, raws: list[str]) -> list[str]:
        """The lines of `raws` to log, as `line()` returns them (hidden ones
        left out). A batch with no command, no carriage return and no secret
        in it (most of a chatty step's output) is returned as it is, after a
        few scans of its joined text instead of a call per line."""
        if self._stopped is None and not self._matchers.active:
            joined = "\n".join(raws)
            if (
                "\r" not in joined
                and ("::" not in joined or _COMMAND_START.search(joined) is None)
                and _LEGACY_PREFIX not in joined
                and not self.masker.contains_secret(joined)
            ):
                return raws
        shown = (self.line(raw) for raw in raws)
        return [text for text in shown if text is not None]

    def line(self, raw: str) -> str | None:
        text = raw.rstrip("\r")
        if self._stopped is not None:
            stop = parse_command(text, frozenset({self._stopped.lower()}))
            if stop is not None:
                self._stopped = None
                return None
            return self._output(text)
        command = parse_command(text)
        if command is None:
            return self._output(text)
        name, props, data = command
        if self._echo and name in _ECHOED:
            shown = self._command(text, name, props, data)
            echoed = self.masker.mask(text)
            return echoed if shown is None else f"{echoed}\n{shown}"
        return self._command(text, name, props, data)

    def _command(self, text: str, name: str, props: dict[str, str], data: str) -> str | None:
        if name == "add-mask":
            if not data.strip():
                return self._warn("Can't add secret mask for empty string in ##[add-mask] command.")
            self.masker.add(data)
            return "::add-mask::***" if self._echo else None
        if name == "stop-commands":
            self._stopped = data
            return None
        if name == "group":
            return self.masker.mask(f"▼ {data}")
        if name == "endgroup":
            return None
        if name in ("error", "warning", "notice"):
            line_no = props.get("line")
            col = props.get("col")
            ann = Annotation(
                level=name,
                message=data,
                job=self._job,
                step=self._step,
                file=self._relative(props.get("file")),
                line=int(line_no) if line_no and line_no.isdigit() else None,
                title=props.get("title"),
                col=int(col) if col and col.isdigit() else None,
            ).masked(self.masker)
            self.effects.annotations.append(ann)
            # The rendered line is masked as a whole too: a value may span
            # the join of two properties.
            return self.masker.mask(ann.render())
        if name == "echo":
            value = data.strip().lower()
            if value not in ("on", "off"):
                return self._refused(
                    text,
                    "Invalid echo command value. Possible values can be: 'on', 'off'. "
                    f"Current value is: '{data}'.",
                )
            self._echo = value == "on"
            return None
        if name == "debug":
            return self.masker.mask(f"debug: {data}") if self._debug else None
        if name == "set-output" and "name" in props:
            self.effects.outputs[props["name"]] = data
            return None
        if name == "save-state" and "name" in props:
            # old @actions/core (before 1.10) saves a JavaScript action's state
            # for its post step this way
            self.effects.state[props["name"]] = data
            return None
        if name in ("set-env", "add-path"):
            return self._unsecure(name, text, props, data)
        if name in ("add-matcher", "remove-matcher"):
            return self._matcher_command(name, text, props, data)
        return self._output(text)

    def _output(self, text: str) -> str:
        """A line that is no command: logged as it is, and an annotation
        too when a problem matcher of the job matches it (GitHub's
        OutputManager)."""
        if self._matchers.active and (found := self._matchers.match(text)) is not None:
            level, match = found
            self.effects.annotations.append(
                Annotation(
                    level=level,
                    message=match.message or "",
                    job=self._job,
                    step=self._step,
                    file=self._matchers.file_of(match),
                    line=int(match.line) if match.line and match.line.isdigit() else None,
                    col=int(match.column) if match.column and match.column.isdigit() else None,
                ).masked(self.masker)
            )
        return self.masker.mask(text)

    def _matcher_command(
        self, name: str, text: str, props: dict[str, str], data: str
    ) -> str | None:
        """GitHub's Add/RemoveMatcherCommandExtension: the line is not shown;
        a matcher file the runner cannot use fails the step."""
        owner = props.get("owner", "")
        if name == "remove-matcher" and owner and data:
            return self._warn(
                "Either specify an owner name or a file path in ##[remove-matcher] command. "
                "Both values cannot be set."
            )
        if name == "add-matcher" and not data:
            return self._warn("File path must be specified.")
        if name == "remove-matcher" and not owner and not data:
            return self._warn(
                "Either an owner name or a file path must be specified in "
                "##[remove-matcher] command."
            )
        try:
            if name == "add-matcher":
                self._matchers.add(self._matchers.resolve(data))
            elif owner:
                self._matchers.remove([owner])
            else:
                path = self._matchers.resolve(data)
                self._matchers.remove([c.owner for c in load_matchers(path, validate=False)])
        except MatcherError as exc:
            return self._refused(text, str(exc))
        return None

    def _warn(self, message: str) -> str:
        ann = Annotation("warning", message, self._job, self._step)
        self.effects.annotations.append(ann)
        return ann.render()

    def _unsecure(self, name: str, text: str, props: dict[str, str], data: str) -> str | None:
        """GitHub's SetEnv/AddPathCommandExtension: disabled (the step fails)
        unless ACTIONS_ALLOW_UNSECURE_COMMANDS is true; NODE_OPTIONS is never set."""
        if not self._allow_unsecure:
            why = (
                f"The `{name}` command is disabled. Please upgrade to using Environment Files "
                "or opt into unsecure command execution by setting the "
                "`ACTIONS_ALLOW_UNSECURE_COMMANDS` environment variable to `true`."
            )
            return self._refused(text, why)
        if name == "add-path":
            self.effects.path.append(data)
            return None
        var = props.get("name", "")
        if not var:
            return self._refused(text, "Required field 'name' is missing in ##[set-env] command.")
        if var.upper() == "NODE_OPTIONS":
            ann = Annotation(
                "error",
                "Can't update NODE_OPTIONS environment variable using ::set-env:: command.",
                self._job,
                self._step,
            )
            self.effects.annotations.append(ann)
            return ann.render()
        self.effects.env[var] = data
        return None

    def _refused(self, text: str, why: str) -> str:
        self.effects.failed = True
        first = Annotation(
            "error",
            f"Unable to process command '{text.strip()}' successfully.",
            self._job,
            self._step,
        ).masked(self.masker)
        self.effects.annotations += [first, Annotation("error", why, self._job, self._step)]
        return self.masker.mask(f"{first.render()} {why}")
