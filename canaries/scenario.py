"""Scenario files: load, validate and resolve the YAML that describes one canary run.

A scenario names a seed, an engine (a profile from `configs/engines/` plus knob overrides), a
workload, the perturbations to inject and what the suite expects to see. Validation collects every
problem it can find and names the file, the line and the field of each; it never stops at the first.

YAML note: scenarios are read with a loader that only treats `true`/`false` as booleans, so
`invariant_check: off` stays the string "off" (YAML 1.1 would read it as False).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from canaries.verdict import VERDICTS
from engine_stub import config as engine_config
from engine_stub.config import KNOB_HELP, ConfigError, EngineConfig, config_from_sources
from engine_stub.perturb.spec import (
    GROUP_WORDS,
    PARAM_MINIMUMS,
    POSITION_WORDS,
    REQUEST_WORDS,
    TRIGGER_EVENTS,
    VALUE_WORDS,
    PerturbationSpec,
    SpecError,
    parse_perturbations,
)

__all__ = [
    "Disabled",
    "Expect",
    "Problem",
    "Scenario",
    "ScenarioError",
    "Workload",
    "REPO_ROOT",
    "discover",
    "engine_knobs",
    "engine_spec",
    "json_schema",
    "known_detectors",
    "known_kinds",
    "list_profiles",
    "load_scenario",
    "validate_paths",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
SCENARIO_DIR = REPO_ROOT / "configs" / "scenarios"
PROFILE_DIR = REPO_ROOT / "configs" / "engines"
DEFAULT_PROFILE = "cpu-tiny"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# Limits on a scenario file, far above any real one (under 2 KiB, a few aliases at most), that
# keep a hostile one (an alias bomb, a huge or deeply nested file) from hurting the validator.
MAX_FILE_BYTES = 256 * 1024
MAX_ALIASES = 32
MAX_NODES = 2_000  # YAML nodes, as written and with aliases expanded
MAX_DEPTH = 64  # nested mappings and sequences, aliases expanded

TOP_KEYS = ("name", "description", "seed", "engine", "workload", "perturbations", "expect")
ENGINE_OUTCOMES = ("crashes", "survives")
# Knobs the harness owns (where the engine listens and logs, the lockstep gate), and the seed,
# which a scenario sets once at top level.
_HARNESS_KNOBS = ("sources", "host", "port", "event_log", "seed")

# ------------------------------------------------------------------------------------------------
# Data model.


def _printable(text: str) -> str:
    """`text` with every non-printable character escaped (a key or path may hold any)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


@dataclass(frozen=True)
class Problem:
    """One validation problem: where it is (file, 1-based line, field path) and what is wrong.

    `str()` gives `file:line: field: message`: one line, or more when the message has line
    breaks (each further line indented), never a trailing newline or a bare carriage return.
    """

    file: str
    line: int | None
    field: str
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file:
            raise ValueError(f"Problem.file must be a non-empty path, got {self.file!r}")
        if self.line is not None and (not isinstance(self.line, int) or self.line < 1):
            raise ValueError(f"Problem.line must be None or >= 1, got {self.line!r}")
        if not isinstance(self.field, str):
            raise ValueError(f"Problem.field must be a string, got {self.field!r}")
        if not isinstance(self.message, str) or not self.message.strip():
            raise ValueError(f"Problem.message must be a non-empty string, got {self.message!r}")

    def __str__(self) -> str:
        file = _printable(self.file)
        where = f"{file}:{self.line}" if self.line is not None else file
        lines = [_printable(part.rstrip()) for part in self.message.splitlines() if part.strip()]
        return f"{where}: {_printable(self.field) or '<document>'}: " + "\n    ".join(lines)


class ScenarioError(ValueError):
    """A scenario file failed validation; `problems` holds every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class Workload:
    """The requests the driver sends."""

    requests: int = 8
    concurrency: int = 4
    prompt_tokens: tuple[int, int] = (24, 64)
    shared_prefix_tokens: int = 0
    max_new_tokens: int = 48
    temperature: float = 0.0
    unique_prompts: bool = False


@dataclass(frozen=True)
class Disabled:
    """A deliberately disabled check: the knob values that must be in force, and why."""

    checks: dict[str, object]
    reason: str


@dataclass(frozen=True)
class Expect:
    """What the suite must observe. Exactly one of clean / fires / disabled is the mode."""

    clean: bool = False
    fires: tuple[str, ...] = ()
    within_steps: int | None = None
    silent: tuple[str, ...] = ()
    engine: str | None = None
    disabled: Disabled | None = None
    detected_by: tuple[str, ...] = ()
    verdict: str | None = None


WORKLOAD_KEYS = tuple(f.name for f in dataclasses.fields(Workload))
EXPECT_KEYS = tuple(f.name for f in dataclasses.fields(Expect))


@dataclass(frozen=True)
class Scenario:
    """A validated scenario. `engine` holds every engine knob resolved (profile < scenario keys),
    with the scenario seed as `seed`; `raw` is the YAML document as read."""

    name: str
    description: str
    seed: int
    profile: str
    engine: dict
    workload: Workload
    perturbations: tuple[PerturbationSpec, ...]
    expect: Expect
    path: str
    raw: dict = field(default_factory=dict, compare=False, repr=False)


# ------------------------------------------------------------------------------------------------
# Registries the validation needs.


def engine_knobs() -> dict[str, dataclasses.Field]:
    """Engine knobs a scenario or profile may set (EngineConfig fields minus the harness's)."""
    return {
        f.name: f
        for f in dataclasses.fields(EngineConfig)
        if f.name not in _HARNESS_KNOBS and not f.name.startswith("gate_")
    }


def known_kinds() -> tuple[str, ...]:
    """Registered perturbation kinds (engine_stub.perturb.kinds.KINDS), in registration order."""
    from engine_stub.perturb.kinds import KINDS

    return tuple(KINDS)


@lru_cache(maxsize=1)
def load_invariant_registry() -> None:
    """Import the engine modules that define invariants, so the registry lists them all."""
    import engine_stub.idle_check  # noqa: F401
    import engine_stub.mem  # noqa: F401
    import engine_stub.scheduler  # noqa: F401


def known_detectors() -> list[str]:
    """Every registered invariant name, then `kv_canary.<reason>` for each canary reason."""
    load_invariant_registry()
    from engine_stub.invariants import registered_invariants
    from engine_stub.kv_canary import REASONS

    return [inv.name for inv in registered_invariants()] + [f"kv_canary.{r}" for r in REASONS]


# ------------------------------------------------------------------------------------------------
# YAML with line numbers.


class _Refused(yaml.YAMLError):
    """A document past one of the limits below; `line` is where it went past (1-based)."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = mark.line + 1 if mark is not None else None


class _Loader(yaml.SafeLoader):
    """SafeLoader whose only booleans are true/false (so `off`, `yes`, `on` stay strings).

    It also refuses, while composing and so before anything is expanded, more than
    MAX_ALIASES aliases, an alias inside the node it names, more than MAX_NODES nodes and
    nesting deeper than MAX_DEPTH.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._nodes = 0
        self._depth = 0
        self._open_anchors: set[str] = set()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Refused(f"more than {MAX_ALIASES} aliases (*{event.anchor} is one too "
                               "many): a scenario needs a handful at most", event.start_mark)
            if event.anchor in self._open_anchors:
                raise _Refused(f"recursive alias: *{event.anchor} is inside the node "
                               f"&{event.anchor} it names", event.start_mark)
            return super().compose_node(parent, index)
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(f"more than {MAX_NODES} YAML nodes: a scenario has a few hundred at "
                           "most", event.start_mark)
        anchor = getattr(event, "anchor", None)
        self._depth += 1
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(anchor)


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _check_expansion(root: yaml.Node) -> None:
    """Raise _Refused if the document, aliases expanded, exceeds MAX_NODES or MAX_DEPTH.

    The composed graph shares each aliased node, so sizes are summed once per distinct node
    (post-order, without recursion: an alias chain can be longer than the stack is deep).
    """
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if not children_done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        count = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if count > MAX_NODES:
            raise _Refused(f"its aliases expand to more than {MAX_NODES} nodes (an alias bomb?); "
                           "refused before expanding them", node.start_mark)
        if depth > MAX_DEPTH:
            raise _Refused(f"its aliases expand to more than {MAX_DEPTH} levels of nesting; "
                           "refused before expanding them", node.start_mark)
        sizes[id(node)] = (count, depth)


def _line_and_column(text: str | bytes, offset: int) -> tuple[int, int]:
    """1-based line and column of `offset` in `text` (characters of a str, bytes of bytes)."""
    newline = "\n" if isinstance(text, str) else b"\n"
    line = text.count(newline, 0, offset) + 1
    return line, offset - (text.rfind(newline, 0, offset) + 1) + 1


class _Doc:
    """A parsed YAML document and the lines of its fields (key line and value line per path)."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.data: Any = None
        self.key_lines: dict[str, int] = {}
        self.value_lines: dict[str, int] = {"": 1}
        self.problems: list[Problem] = []
        loader = None
        try:
            loader = _Loader(text)  # the reader rejects non-printable characters here
            node = loader.get_single_node()
            if node is not None:
                _check_expansion(node)
                self._walk(node, "")
                self.data = loader.construct_document(node)
        except _Refused as exc:
            self.problems.append(Problem(file, exc.line, "<yaml>", exc.message))
        except yaml.reader.ReaderError as exc:
            line, column = _line_and_column(text, exc.position)
            char = exc.character
            what = f"#x{char:04x}" if isinstance(char, int) else repr(char)
            self.problems.append(Problem(file, line, "<yaml>", f"unacceptable character {what} "
                                         f"at column {column}: {exc.reason}"))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            msg = " ".join(x for x in (exc.context, exc.problem) if x) or str(exc)
            if exc.context_mark is not None and exc.problem_mark is not None \
                    and exc.context_mark.line != exc.problem_mark.line:
                msg += f" (the construct began at line {exc.context_mark.line + 1})"
            self.problems.append(Problem(file, line, "<yaml>", f"YAML syntax error: {msg}"))
        except yaml.YAMLError as exc:
            self.problems.append(Problem(file, None, "<yaml>", f"YAML error: {exc}"))
        finally:
            if loader is not None:
                loader.dispose()

    def _walk(self, node: yaml.Node, path: str) -> None:
        self.value_lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value)
                sub = f"{path}.{key}" if path else key
                line = key_node.start_mark.line + 1
                if key in seen:
                    self.problems.append(Problem(
                        self.file, line, sub, f"duplicate key (first at line {seen[key]})"))
                seen[key] = line
                self.key_lines[sub] = line
                self._walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, f"{path}[{i}]")

    def line(self, path: str, *, key: bool = False) -> int | None:
        """Line of `path` (its key line if `key`), else of the nearest enclosing field."""
        probe = path
        while True:
            table = (self.key_lines, self.value_lines) if key else (self.value_lines, self.key_lines)
            for t in table:
                if probe in t:
                    return t[probe]
            if not probe:
                return None
            probe = _parent(probe)
            key = False

    def add(self, path: str, message: str, *, key: bool = False) -> None:
        self.problems.append(Problem(self.file, self.line(path, key=key), path, message))


def _parent(path: str) -> str:
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else ""


def _unreadable(file: str, line: int | None, message: str) -> _Doc:
    doc = _Doc(file, "")
    doc.problems.append(Problem(file, line, "<file>", message))
    return doc


def _read_doc(path: Path) -> _Doc:
    """Parse `path`, refusing (as problems) files over MAX_FILE_BYTES and bytes not UTF-8."""
    file = str(path)
    too_big = f"a scenario file may hold at most {MAX_FILE_BYTES} bytes (a real one is under 2 KiB)"
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:  # refused unread
            return _unreadable(file, 1, f"{size} bytes: {too_big}")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        return _unreadable(file, None, f"cannot read: {exc}")
    if len(data) > MAX_FILE_BYTES:  # it grew since the stat, or is no regular file
        return _unreadable(file, 1, f"more than {MAX_FILE_BYTES} bytes: {too_big}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_and_column(data, exc.start)
        return _unreadable(file, line, f"not UTF-8: byte 0x{data[exc.start]:02x} at column "
                                       f"{column} ({exc.reason}); save the file as UTF-8")
    return _Doc(file, text)


# ------------------------------------------------------------------------------------------------
# Field checks.


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_keys(doc: _Doc, mapping: dict, path: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    for key in mapping:
        if key not in allowed:
            sub = f"{path}.{key}" if path else str(key)
            doc.add(sub, f"unknown key {key!r}; valid keys: {', '.join(allowed)}", key=True)


def _mapping_at(doc: _Doc, raw: Any, path: str) -> dict | None:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        doc.add(path, f"expected a mapping, got {type(raw).__name__}")
        return None
    return raw


def _config_error_knob(exc: ConfigError) -> str | None:
    text = str(exc)
    m = re.match(r"^([a-z_]+)=", text) or re.match(r"^unknown engine knob '([a-z_]+)'", text)
    return m.group(1) if m else None


def _build_config(
    doc: _Doc, knobs: dict[str, Any], origin: dict[str, str], source: str
) -> EngineConfig | None:
    """Build the EngineConfig from `knobs`, reporting every bad knob at the path `origin` names.

    A bad knob is reported and dropped (it falls back to the default) so later ones are checked
    too; returns the config, or None if any knob was bad.
    """
    values = dict(knobs)
    bad = False
    for _ in range(len(values) + 2):
        try:
            cfg = config_from_sources(environ={}, overrides=values, overrides_source=source)
        except ConfigError as exc:
            bad = True
            knob = _config_error_knob(exc)
            path = origin.get(knob or "", "engine")
            doc.add(path, str(exc))
            if knob in values:
                del values[knob]
                continue
            return None
        return None if bad else cfg
    return None


def _profile_knobs(name: str, doc: _Doc, path: str) -> tuple[dict[str, Any], bool]:
    """Knob values of profile `name`; problems in the profile file are added to `doc`."""
    profiles = _profile_paths()
    if name not in profiles:
        doc.add(path, f"unknown profile {name!r}; valid profiles: {', '.join(sorted(profiles))}")
        return {}, False
    pdoc = _read_doc(profiles[name])
    data = pdoc.data if isinstance(pdoc.data, dict) else {}
    if pdoc.data is not None and not isinstance(pdoc.data, dict):
        pdoc.add("", "a profile must be a mapping of engine knobs")
    _check_keys(pdoc, data, "", engine_knobs())
    knobs = {k: v for k, v in data.items() if k in engine_knobs()}
    if not pdoc.problems:
        _build_config(pdoc, knobs, {k: k for k in knobs}, str(profiles[name]))
    doc.problems.extend(pdoc.problems)
    return knobs, not pdoc.problems


def _check_detectors(doc: _Doc, raw: Any, path: str, *, non_empty: bool) -> tuple[str, ...]:
    if raw is None:
        raw = []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        doc.add(path, f"expected a list of detector names, got {type(raw).__name__}")
        return ()
    if non_empty and not raw:
        doc.add(path, "must name at least one detector")
    known = known_detectors()
    out = []
    for i, name in enumerate(raw):
        if name not in known:
            doc.add(f"{path}[{i}]", f"unknown detector {name!r}; valid detectors: {', '.join(known)}")
        else:
            out.append(name)
    return tuple(out)


def _workload(doc: _Doc, raw: Any, engine: dict[str, Any]) -> Workload:
    raw = _mapping_at(doc, raw, "workload")
    if raw is None:
        return Workload()
    _check_keys(doc, raw, "workload", WORKLOAD_KEYS)
    defaults = Workload()
    values: dict[str, Any] = {}

    def int_field(key: str, minimum: int) -> None:
        if key not in raw:
            return
        v = raw[key]
        if not _is_int(v):
            doc.add(f"workload.{key}", f"expected an integer, got {v!r}")
        elif v < minimum:
            doc.add(f"workload.{key}", f"must be >= {minimum}, got {v}")
        else:
            values[key] = v

    int_field("requests", 1)
    int_field("concurrency", 1)
    int_field("shared_prefix_tokens", 0)
    int_field("max_new_tokens", 1)
    if "prompt_tokens" in raw:
        v = raw["prompt_tokens"]
        if _is_int(v):
            v = [v, v]
        if isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v):
            if not 1 <= v[0] <= v[1]:
                doc.add("workload.prompt_tokens", f"needs 1 <= min <= max, got {raw['prompt_tokens']!r}")
            else:
                values["prompt_tokens"] = (v[0], v[1])
        else:
            doc.add("workload.prompt_tokens", f"expected an integer or [min, max], got {v!r}")
    if "temperature" in raw:
        v = raw["temperature"]
        if not _is_number(v) or v < 0:
            doc.add("workload.temperature", f"expected a number >= 0, got {v!r}")
        else:
            values["temperature"] = float(v)
    if "unique_prompts" in raw:
        v = raw["unique_prompts"]
        if not isinstance(v, bool):
            doc.add("workload.unique_prompts", f"expected true or false, got {v!r}")
        else:
            values["unique_prompts"] = v
    w = dataclasses.replace(defaults, **values)
    if w.shared_prefix_tokens >= w.prompt_tokens[0] and "shared_prefix_tokens" in values:
        doc.add("workload.shared_prefix_tokens",
                f"must be below the shortest prompt ({w.prompt_tokens[0]}), got {w.shared_prefix_tokens}")
    ctx = engine.get("max_context_len")
    if _is_int(ctx) and w.prompt_tokens[1] + w.max_new_tokens > ctx:
        field_ = "workload.max_new_tokens" if "max_new_tokens" in values else "workload.prompt_tokens"
        doc.add(field_, f"longest prompt ({w.prompt_tokens[1]}) + max_new_tokens ({w.max_new_tokens}) "
                        f"exceeds the engine's max_context_len={ctx}")
    return w


def _perturbations(doc: _Doc, raw: Any) -> tuple[PerturbationSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        doc.add("perturbations", f"expected a list, got {type(raw).__name__}")
        return ()
    kinds = known_kinds()
    specs = []
    for i, item in enumerate(raw):
        try:
            specs.extend(parse_perturbations([item], kinds, path="perturbations"))
        except SpecError as exc:
            path = exc.path.replace("perturbations[0]", f"perturbations[{i}]", 1)
            doc.add(path, exc.message, key=exc.message.startswith("unknown key"))
    return tuple(specs)


def _expect(doc: _Doc, raw: Any, engine: dict[str, Any], n_perturbations: int) -> Expect:
    if raw is None:
        doc.add("expect", "missing; give one of clean: true, fires: [...], or disabled: {...} + detected_by: [...]")
        return Expect()
    if not isinstance(raw, dict):
        doc.add("expect", f"expected a mapping, got {type(raw).__name__}")
        return Expect()
    _check_keys(doc, raw, "expect", EXPECT_KEYS)
    values: dict[str, Any] = {}
    modes = [m for m in ("clean", "fires", "disabled") if m in raw and not (m == "clean" and raw[m] is False)]
    if len(modes) != 1:
        what = "none" if not modes else " and ".join(modes)
        doc.add("expect", f"needs exactly one of clean: true, fires: [...], disabled: {{...}} (got {what})")

    if "clean" in raw:
        if not isinstance(raw["clean"], bool):
            doc.add("expect.clean", f"expected true or false, got {raw['clean']!r}")
        else:
            values["clean"] = raw["clean"]
    if values.get("clean"):
        if n_perturbations:
            doc.add("perturbations", "a clean (control) scenario must not have perturbations", key=True)
        for key in ("fires", "silent", "within_steps", "detected_by", "disabled"):
            if key in raw and key not in modes:
                doc.add(f"expect.{key}", "not allowed with clean: true", key=True)
    elif modes and n_perturbations == 0:
        doc.add("perturbations", f"expect.{modes[0]} needs at least one perturbation", key=True)

    if "fires" in raw:
        values["fires"] = _check_detectors(doc, raw["fires"], "expect.fires", non_empty=True)
    if "silent" in raw:
        values["silent"] = _check_detectors(doc, raw["silent"], "expect.silent", non_empty=False)
        for name in set(values["silent"]) & set(values.get("fires", ())):
            doc.add("expect.silent", f"{name!r} is both in fires and in silent")
    if "within_steps" in raw:
        v = raw["within_steps"]
        if "fires" not in raw:
            doc.add("expect.within_steps", "only meaningful with fires", key=True)
        elif not _is_int(v) or v < 0:
            doc.add("expect.within_steps", f"expected an integer >= 0, got {v!r}")
        else:
            values["within_steps"] = v
    if "engine" in raw:
        v = raw["engine"]
        if v not in ENGINE_OUTCOMES:
            doc.add("expect.engine", f"{v!r} is not one of {', '.join(ENGINE_OUTCOMES)}")
        else:
            values["engine"] = v
    if "verdict" in raw:
        v = raw["verdict"]
        if v not in VERDICTS:
            doc.add("expect.verdict", f"{v!r} is not a verdict; valid verdicts: {', '.join(VERDICTS)}")
        else:
            values["verdict"] = v

    if "disabled" in raw:
        values["disabled"] = _disabled(doc, raw["disabled"], engine)
        values["detected_by"] = _check_detectors(
            doc, raw.get("detected_by"), "expect.detected_by", non_empty=True)
        if "detected_by" not in raw:
            doc.add("expect.detected_by", "required with disabled: name the detectors that still catch it")
    elif "detected_by" in raw:
        doc.add("expect.detected_by", "only meaningful with disabled", key=True)
    return Expect(**values)


def _disabled(doc: _Doc, raw: Any, engine: dict[str, Any]) -> Disabled | None:
    path = "expect.disabled"
    if not isinstance(raw, dict):
        doc.add(path, f"expected a mapping of engine knobs plus reason, got {type(raw).__name__}")
        return None
    knobs = engine_knobs()
    _check_keys(doc, raw, path, ("reason", *knobs))
    reason = raw.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        doc.add(f"{path}.reason", "required: a non-empty string saying why the check is off")
        reason = ""
    checks: dict[str, object] = {}
    declared = [k for k in raw if k in knobs]
    if not declared:
        doc.add(path, "name at least one engine knob that is disabled (e.g. invariant_check: off)")
    # Coerce each declared value against the resolved engine (skipped if that is invalid: its
    # problems are already reported) and require it to be what the engine runs with.
    base = {k: v for k, v in engine.items() if k in knobs}
    for knob in declared:
        value = raw[knob]
        if not engine:
            checks[knob] = value
            continue
        try:
            cfg = config_from_sources(environ={}, overrides={**base, knob: value},
                                      overrides_source=f"{doc.file}: {path}")
        except ConfigError as exc:
            doc.add(f"{path}.{knob}", str(exc))
            continue
        coerced = getattr(cfg, knob)
        checks[knob] = coerced
        if engine.get(knob) != coerced:
            doc.add(f"{path}.{knob}",
                    f"declares {knob}={coerced!r} but the scenario's engine resolves to "
                    f"{knob}={engine.get(knob)!r}; set engine.{knob}: {value} as well")
    return Disabled(checks=checks, reason=reason)


# ------------------------------------------------------------------------------------------------
# Loading.


def _load(path: Path) -> tuple[Scenario | None, list[Problem], str | None, int | None]:
    """Scenario (or None), every problem, and the scenario's name and its line (for dup checks)."""
    doc = _read_doc(path)
    if doc.problems and doc.data is None:
        return None, doc.problems, None, None
    data = doc.data
    if data is None:
        doc.add("", "empty file; a scenario needs at least name and expect")
        return None, doc.problems, None, None
    if not isinstance(data, dict):
        doc.add("", f"a scenario must be a mapping, got {type(data).__name__}")
        return None, doc.problems, None, None
    _check_keys(doc, data, "", TOP_KEYS)

    name = data.get("name")
    name_ok = isinstance(name, str) and bool(NAME_RE.match(name))
    if "name" not in data:
        doc.add("name", "required")
    elif not name_ok:
        doc.add("name", f"{name!r} must match {NAME_RE.pattern}")
    description = data.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        doc.add("description", f"expected a string, got {type(description).__name__}")
        description = str(description)
    seed = data.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        doc.add("seed", f"expected an integer >= 0, got {seed!r}")
        seed = 0

    # Engine: profile values, overridden by the scenario's own keys.
    engine: dict[str, Any] = {}
    profile = DEFAULT_PROFILE
    eng_raw = _mapping_at(doc, data.get("engine"), "engine")
    if eng_raw is not None:
        knobs = engine_knobs()
        _check_keys(doc, eng_raw, "engine", ("profile", *knobs))
        profile = eng_raw.get("profile", DEFAULT_PROFILE)
        if not isinstance(profile, str):
            doc.add("engine.profile", f"expected a profile name, got {profile!r}")
            profile_knobs, profile_ok = {}, False
        else:
            profile_knobs, profile_ok = _profile_knobs(profile, doc, "engine.profile")
        overrides = {k: v for k, v in eng_raw.items() if k in knobs}
        merged = {**profile_knobs, **overrides}
        origin = dict.fromkeys(profile_knobs, "engine.profile")
        origin.update({k: f"engine.{k}" for k in overrides})
        cfg = _build_config(doc, merged, origin, f"{path}: engine")
        if cfg is not None and profile_ok:
            engine = {k: getattr(cfg, k) for k in knobs}
            engine["seed"] = seed
    workload = _workload(doc, data.get("workload"), engine)
    perturbations = _perturbations(doc, data.get("perturbations"))
    n_pert = len(data["perturbations"]) if isinstance(data.get("perturbations"), list) else 0
    expect = _expect(doc, data.get("expect"), engine, n_pert)

    name_line = doc.line("name") if name_ok else None
    doc.problems.sort(key=lambda p: p.line if p.line is not None else 0)
    if doc.problems:
        return None, doc.problems, name if name_ok else None, name_line
    scenario = Scenario(
        name=name, description=description, seed=seed, profile=profile, engine=engine,
        workload=workload, perturbations=perturbations, expect=expect, path=str(path), raw=data,
    )
    return scenario, [], name, name_line


def load_scenario(path: str | Path) -> Scenario:
    """Load and validate one scenario file; raises ScenarioError listing every problem."""
    scenario, problems, _, _ = _load(Path(path))
    if problems or scenario is None:
        raise ScenarioError(problems)
    return scenario


def _expand(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        found = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
        for f in found:
            if f not in out:
                out.append(f)
    return out


def discover(paths: Iterable[str | Path] | None = None) -> list[Path]:
    """Scenario files: `paths` (directories expand to their *.yaml), default configs/scenarios."""
    if paths is None:
        return sorted(SCENARIO_DIR.glob("*.yaml"))
    return _expand(paths)


def validate_paths(paths: Iterable[str | Path]) -> list[Problem]:
    """Validate every file under `paths`; also reports a scenario name used by two files."""
    problems: list[Problem] = []
    names: dict[str, tuple[str, int | None]] = {}
    for f in _expand(paths):
        _, found, name, line = _load(f)
        problems.extend(found)
        if name is None:
            continue
        if name in names:
            first_file, first_line = names[name]
            problems.append(Problem(str(f), line, "name",
                                    f"duplicate scenario name {name!r} (also in {first_file}:{first_line})"))
        else:
            names[name] = (str(f), line)
    return problems


def engine_spec(s: Scenario) -> dict:
    """What the engine's --scenario file holds: name, seed, flat knobs (seed included), and the
    perturbations as written in the YAML."""
    engine = dict(s.engine)
    engine["seed"] = s.seed
    raw = s.raw.get("perturbations") if isinstance(s.raw, dict) else None
    return {"name": s.name, "seed": s.seed, "engine": engine, "perturbations": list(raw or [])}


def _profile_paths() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.yaml"))}


def list_profiles() -> dict[str, dict]:
    """Every engine profile in configs/engines, by name, as written (knob -> value)."""
    out = {}
    for name, path in _profile_paths().items():
        doc = _read_doc(path)
        out[name] = dict(doc.data) if isinstance(doc.data, dict) else {}
    return out


# ------------------------------------------------------------------------------------------------
# JSON Schema for editors.


def _knob_schema(name: str, f: dataclasses.Field) -> dict:
    default = f.default
    choices = engine_config.CHOICES.get(name)
    schema: dict[str, Any]
    if choices:
        schema = {"enum": list(choices)}
        if name == "invariant_check":
            schema = {"enum": [*choices, 0, 1, 2]}
    elif isinstance(default, bool):
        schema = {"type": "boolean"}
    elif isinstance(default, int):
        schema = {"type": "integer"}
    elif isinstance(default, float):
        schema = {"type": "number"}
    else:
        schema = {"type": "string"}
    help_text = KNOB_HELP.get(name)
    if help_text:
        schema["description"] = help_text
    return schema


def json_schema() -> dict:
    """A JSON Schema (draft 2020-12) of the scenario format."""
    knobs = {name: _knob_schema(name, f) for name, f in engine_knobs().items()}
    detectors = {"type": "array", "items": {"enum": known_detectors()}}
    nonneg = {"type": "integer", "minimum": 0}
    kinds = known_kinds()
    trigger = {
        "type": "object", "additionalProperties": False,
        "properties": {
            "at_step": nonneg, "after_step": nonneg, "warmup_steps": nonneg,
            "event": {"enum": list(TRIGGER_EVENTS)},
            "probability": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "interval": {"type": "integer", "minimum": 1},
            "times": {"type": "integer", "minimum": 1},
        },
    }
    request = {"oneOf": [nonneg, {"enum": list(REQUEST_WORDS)}]}
    target = {
        "type": "object", "additionalProperties": False,
        "properties": {
            "request": request, "index": request,
            "positions": {"oneOf": [
                {"enum": list(POSITION_WORDS)},
                {"type": "array", "items": nonneg, "minItems": 2, "maxItems": 2},
            ]},
            "group": {"enum": list(GROUP_WORDS)},
            "value": {"enum": list(VALUE_WORDS)},
            "count": {"type": "integer", "minimum": 1},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://serving-canary/scenario.schema.json",
        "title": "serving-canary scenario",
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "expect"],
        "properties": {
            "name": {"type": "string", "pattern": NAME_RE.pattern},
            "description": {"type": "string"},
            "seed": {"type": "integer", "minimum": 0, "default": 0},
            "engine": {
                "type": "object", "additionalProperties": False,
                "properties": {"profile": {"enum": sorted(_profile_paths()), "default": DEFAULT_PROFILE},
                               **knobs},
            },
            "workload": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "requests": {"type": "integer", "minimum": 1},
                    "concurrency": {"type": "integer", "minimum": 1},
                    "prompt_tokens": {"oneOf": [
                        {"type": "integer", "minimum": 1},
                        {"type": "array", "items": {"type": "integer", "minimum": 1},
                         "minItems": 2, "maxItems": 2},
                    ]},
                    "shared_prefix_tokens": nonneg,
                    "max_new_tokens": {"type": "integer", "minimum": 1},
                    "temperature": {"type": "number", "minimum": 0},
                    "unique_prompts": {"type": "boolean"},
                },
            },
            "perturbations": {
                "type": "array",
                "items": {
                    "type": "object", "additionalProperties": False, "required": ["kind"],
                    "properties": {
                        "kind": {"enum": list(kinds)},
                        "trigger": trigger,
                        "target": target,
                        "params": {"type": "object", "additionalProperties": False,
                                   "properties": {k: {"type": "integer", "minimum": m}
                                                  for k, m in PARAM_MINIMUMS.items()}},
                    },
                },
            },
            "expect": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "clean": {"type": "boolean"},
                    "fires": {**detectors, "minItems": 1},
                    "within_steps": nonneg,
                    "silent": detectors,
                    "engine": {"enum": list(ENGINE_OUTCOMES)},
                    "disabled": {
                        "type": "object", "additionalProperties": False, "required": ["reason"],
                        "properties": {"reason": {"type": "string", "minLength": 1}, **knobs},
                    },
                    "detected_by": {**detectors, "minItems": 1},
                    "verdict": {"enum": list(VERDICTS)},
                },
                "oneOf": [
                    {"required": ["clean"], "properties": {"clean": {"const": True}}},
                    {"required": ["fires"]},
                    {"required": ["disabled", "detected_by"]},
                ],
            },
        },
    }
