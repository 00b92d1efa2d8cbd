"""YAML with line numbers, refused fast when hostile: the reader of every scenario and profile.

`read_doc(path)` parses a file into a `Doc`: its data, the line of each field's key and value
(by dotted path, `expect.fires[0]`), and the problems found so far. Files over MAX_FILE_BYTES are
refused unread, bytes that are not UTF-8 and unprintable characters by line and column, and an
alias bomb, a recursive alias or deep nesting while composing, before anything is expanded.

YAML note: scenarios are read with a loader that only treats `true`/`false` as booleans, so
`invariant_check: off` stays the string "off" (YAML 1.1 would read it as False).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from canaries.scenario.model import Problem

__all__ = ["MAX_ALIASES", "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_NODES", "Doc", "read_doc"]

# Limits on a scenario file, far above any real one (under 2 KiB, a few aliases at most), that
# keep a hostile one (an alias bomb, a huge or deeply nested file) from hurting the validator.
MAX_FILE_BYTES = 256 * 1024
MAX_ALIASES = 32
MAX_NODES = 2_000  # YAML nodes, as written and with aliases expanded
MAX_DEPTH = 64  # nested mappings and sequences, aliases expanded


class _Refused(yaml.YAMLError):
    """A document past one of the limits below; `line` is where it went past (1-based)."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = mark.line + 1 if mark is not None else None


if yaml.__with_libyaml__:  # libyaml scans and parses (C): about ten times faster
    from yaml._yaml import CParser as _EventSource
else:  # pragma: no cover - PyYAML built without libyaml

    class _EventSource(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):
        def __init__(self, stream: str) -> None:
            yaml.reader.Reader.__init__(self, stream)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)


def _check_printable(text: str) -> None:
    """PyYAML's reader check, the same with either event source: a ReaderError at the first
    character YAML does not allow."""
    match = yaml.reader.Reader.NON_PRINTABLE.search(text)
    if match is not None:
        raise yaml.reader.ReaderError("<unicode string>", match.start(), ord(match.group()),
                                      "unicode", "special characters are not allowed")


class _Loader(yaml.composer.Composer, _EventSource, yaml.constructor.SafeConstructor,
              yaml.resolver.Resolver):
    """A safe loader whose only booleans are true/false (so `off`, `yes`, `on` stay strings).

    Events come from libyaml where PyYAML has it; composing is PyYAML's, so that it refuses,
    before anything is expanded, more than MAX_ALIASES aliases, an alias inside the node it
    names, more than MAX_NODES nodes and nesting deeper than MAX_DEPTH.
    """

    def __init__(self, stream: str) -> None:
        _check_printable(stream)
        _EventSource.__init__(self, stream)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        yaml.composer.Composer.__init__(self)
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
    for first, resolvers in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
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


class Doc:
    """A parsed YAML document and the lines of its fields (key line and value line per path)."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.data: Any = None
        self.key_lines: dict[str, int] = {}
        self.value_lines: dict[str, int] = {"": 1}
        self.problems: list[Problem] = []
        loader = None
        try:
            loader = _Loader(text)  # rejects non-printable characters
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


def _unreadable(file: str, line: int | None, message: str) -> Doc:
    doc = Doc(file, "")
    doc.problems.append(Problem(file, line, "<file>", message))
    return doc


def read_doc(path: Path) -> Doc:
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
    return Doc(file, text)


