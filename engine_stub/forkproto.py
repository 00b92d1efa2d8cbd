"""The fork server's wire protocol (torch-free: the harness imports it without the engine).

Each direction of a fork connection carries one JSON object per line, and each direction has
exactly one writer: the harness writes its one request, the server writes every answer (the
forked engine never touches the connection; its ready line reaches the server on a pipe of its
own and the server forwards it). So no two writers can interleave and the order is the server's:

    {"type": "pid", "pid": N}       first, right after the fork
    {"type": "ready", "line": S}    the engine's ready line, if it got that far
    {"type": "exit", "code": C}     last (negative: killed by that signal); then EOF
    {"type": "error", "message": S} instead of a pid: the request was refused or fork failed

A request with `patched_site` asks for a fork parent, not an engine: the child loads the patched
mirror at that path into itself (`engine_stub.hotpatch`) and serves this protocol on the socket
`argv[0]`, its `ready` line the server ready line below, for as long as the requesting
connection stays open (its lifeline). One it cannot load in place exits (code 3) before `ready`,
its reason in its log.

`LineReader` turns a stream's chunks into whole lines (a recv may end anywhere);
`parse_message` checks a line against the table below and names what it got when it refuses.
"""

from __future__ import annotations

import json

__all__ = ["ForkProtocolError", "LineReader", "MAX_LINE", "MESSAGE_FIELDS", "encode", "parse_message",
           "parse_request", "PROTOCOL_VERSION", "REQUEST_FIELDS", "SERVER_READY_LINE"]

# The server's first line on its stdout; the version changes with any change to the messages, so
# a harness meeting an engine tree of another era (`canary bisect`'s old commits) knows.
PROTOCOL_VERSION = 3
SERVER_READY_LINE = f"engine_stub forkserver ready (protocol {PROTOCOL_VERSION})"
MAX_LINE = 1 << 20  # a request carries an environment: generous, but not endless

# type -> its one field and that field's type
MESSAGE_FIELDS: dict[str, tuple[str, type]] = {
    "pid": ("pid", int),
    "ready": ("line", str),
    "exit": ("code", int),
    "error": ("message", str),
}

# a fork request's fields -> (type, required)
REQUEST_FIELDS: dict[str, tuple[type, bool]] = {
    "argv": (list, True),
    "env": (dict, True),
    "log": (str, True),
    "cwd": (str, False),
    "patched_site": (str, False),
}


class ForkProtocolError(RuntimeError):
    """A fork connection carried something the protocol does not allow; the text names it."""


def encode(kind: str, value: object) -> bytes:
    """One message as its line: `encode("pid", 42)` -> b'{"type": "pid", "pid": 42}\\n'."""
    field, want = MESSAGE_FIELDS[kind]
    assert isinstance(value, want) and not isinstance(value, bool), (kind, value)
    return (json.dumps({"type": kind, field: value}) + "\n").encode()


def _shown(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return repr(text if len(text) <= 200 else text[:200] + "...")


def _object(raw: bytes, what: str) -> dict:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ForkProtocolError(f"{what} is not JSON ({exc}): {_shown(raw)}") from None
    if not isinstance(value, dict):
        raise ForkProtocolError(f"{what} is not a JSON object: {_shown(raw)}")
    return value


def parse_message(raw: bytes) -> tuple[str, object]:
    """(type, value) of one line the server sent; ForkProtocolError naming the line if it is
    not one of the protocol's messages."""
    message = _object(raw, "a fork server message")
    kind = message.get("type")
    if kind is None:
        raise ForkProtocolError(f"a fork server message has no 'type': {_shown(raw)}")
    if kind not in MESSAGE_FIELDS:
        raise ForkProtocolError(f"unknown message type {kind!r} from the fork server "
                                f"(known: {', '.join(MESSAGE_FIELDS)}): {_shown(raw)}")
    field, want = MESSAGE_FIELDS[kind]
    value = message.get(field)
    if not isinstance(value, want) or isinstance(value, bool):
        raise ForkProtocolError(f"a fork server {kind!r} message: {field!r} must be of type "
                                f"{want.__name__}: {_shown(raw)}")
    return kind, value


def parse_request(raw: bytes) -> dict:
    """A fork request, checked field by field; ForkProtocolError naming the field if not."""
    request = _object(raw, "the fork request")
    for name, (want, required) in REQUEST_FIELDS.items():
        if name not in request:
            if required:
                raise ForkProtocolError(f"the fork request has no {name!r}: {_shown(raw)}")
            continue
        if not isinstance(request[name], want):
            raise ForkProtocolError(f"the fork request's {name!r} must be of type {want.__name__}: "
                                    f"{_shown(raw)}")
    extra = sorted(set(request) - set(REQUEST_FIELDS))
    if extra:
        raise ForkProtocolError(f"the fork request has unknown field(s) {', '.join(extra)}: {_shown(raw)}")
    if not all(isinstance(a, str) for a in request["argv"]):
        raise ForkProtocolError(f"the fork request's 'argv' must hold strings: {_shown(raw)}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items()):
        raise ForkProtocolError(f"the fork request's 'env' must map strings to strings: {_shown(raw)}")
    return request


class LineReader:
    """Whole lines out of a byte stream read in arbitrary chunks."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self.pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines `chunk` completes (without their newlines); the rest is kept for later."""
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        if len(self.pending) > self.max_line:
            raise ForkProtocolError(f"a line longer than {self.max_line} bytes, starting "
                                    f"{_shown(self.pending[:60])}")
        return lines
