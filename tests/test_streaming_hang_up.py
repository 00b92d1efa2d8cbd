"""A hang-up on an engine without our lockstep gate (SGLang's server): the driver streams the
answer and closes the connection once it holds the planned tokens."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from canaries.driver import CLIENT_GONE_STATUS, hang_up_streaming
from canaries.watchdog import Patience, Watchdog

TOKENS = [7, 8, 9, 10, 11]


class _Streamer(BaseHTTPRequestHandler):
    """Streams TOKENS as SGLang does with skip_tokenizer_init: `data:` lines, cumulative ids."""

    sent: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Streamer.sent.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for n in range(1, len(TOKENS) + 1):
                self.wfile.write(b"data: " + json.dumps({"output_ids": TOKENS[:n]}).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up: what the test wants

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _hang_up(base_url: str, after_tokens: int) -> dict:
    record: dict = {"rid": "r0000", "status": None, "output_ids": None, "error": None}
    with Watchdog(Patience(), lambda: 0) as watchdog:
        hang_up_streaming(base_url, record, {"input_ids": [1, 2], "rid": "r0000"}, after_tokens, 10.0, watchdog)
    return record


def test_streaming_hang_up_leaves_once_the_planned_tokens_came(server: str) -> None:
    record = _hang_up(server, after_tokens=3)
    assert record["status"] == CLIENT_GONE_STATUS and record["hung_up"] is True
    assert record["output_ids"] is None and _Streamer.sent[-1]["stream"] is True


def test_streaming_hang_up_keeps_an_answer_that_ended_first(server: str) -> None:
    record = _hang_up(server, after_tokens=len(TOKENS) + 3)
    assert record["status"] == 200 and record["output_ids"] == TOKENS and "hung_up" not in record
