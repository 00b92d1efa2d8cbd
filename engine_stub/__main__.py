"""`python -m engine_stub`: serve the engine over HTTP.

Every knob is a flag and an `ENGINE_STUB_*` variable (see --help). With --port 0 the engine binds
a free port; either way it prints one line `engine_stub ready on http://HOST:PORT` when it serves
(an IPv6 host in brackets: `http://[::1]:PORT`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Any

from engine_stub.config import ConfigError, add_config_flags, config_from_sources

# A launcher may name an inherited file descriptor here: the ready line is written to it as
# well, and it is closed, so the launcher learns of readiness without polling the log.
READY_FD_ENV = "ENGINE_STUB_READY_FD"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine_stub",
        description="A mini serving engine carrying SGLang's hybrid SWA KV memory path.",
    )
    parser.add_argument("--scenario", default=None, metavar="PATH",
                        help="a scenario YAML whose engine and perturbations sections to apply "
                             "[env ENGINE_STUB_SCENARIO]")
    add_config_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    scenario_path = args.pop("scenario") or os.environ.get("ENGINE_STUB_SCENARIO") or None
    perturber, overrides = None, {}
    try:
        if scenario_path:
            from engine_stub.perturb.loader import load_engine_scenario

            overrides, perturber = load_engine_scenario(scenario_path)
        config = config_from_sources(flags=args, overrides=overrides, overrides_source=str(scenario_path))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"engine_stub: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from engine_stub.engine import Engine
    from engine_stub.server import create_app

    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        print(f"engine_stub: cannot bind {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    engine = Engine(config, perturber=perturber)
    engine.events.write("listening", host=config.host, port=port)
    engine.start()
    app = create_app(engine)
    server = _prompt_server_class(uvicorn)(
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=30), engine)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler it found; with
    # Python's defaults that kills the process (-15) after a clean shutdown. This handler asks
    # for the same drain instead, also for a signal that lands before uvicorn installs its own.
    def request_exit(signum: int, frame: object) -> None:
        server.should_exit = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request_exit)
    # Listen now, so a client that connects as soon as it reads the ready line waits in the
    # backlog instead of being refused before uvicorn's startup.
    sock.listen(2048)
    # An IPv6 literal is bracketed in a URL (RFC 3986): http://[::1]:PORT.
    host = f"[{config.host}]" if ":" in config.host else config.host
    ready = f"engine_stub ready on http://{host}:{port}"
    print(ready, flush=True)
    _notify_ready(ready)
    server.run(sockets=[sock])
    return 0


# How often, and how many times, a stop looks for the last answer's task to finish before it
# leaves the drain to uvicorn (whose own tick is 0.1 s).
_PROMPT_EXIT_LOOK_S = 0.002
_PROMPT_EXIT_LOOKS = 50


def _prompt_server_class(uvicorn: Any) -> type:
    """uvicorn's Server, stopping at once when it is asked to and nothing is left to drain.

    Asked (SIGTERM, SIGINT), uvicorn notices at its next 0.1 s tick (a signal another thread
    took wakes nobody), then gives open connections another 0.1 s: a harness that stops an
    engine per scenario pays both every time. Here the signal wakes the loop (a wakeup fd), and
    once no request is in flight and no connection is `answering` (an idle keep-alive one,
    which uvicorn's own shutdown closes at once too, or one whose client has not yet closed it)
    the engine drains and exits, as the app's shutdown would: at once, or as soon as the last
    answer's task has finished, looked for every 2 ms for 0.1 s; otherwise uvicorn drains the
    answers in flight first, as before.
    """

    class PromptServer(uvicorn.Server):
        def __init__(self, config: Any, engine: Any) -> None:
            super().__init__(config)
            self.engine = engine

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if threading.current_thread() is not threading.main_thread():
                return  # signals reach only the main thread's handlers
            wake_r, wake_w = socket.socketpair()
            wake_r.setblocking(False)
            wake_w.setblocking(False)
            self._wake = (wake_r, wake_w)  # kept open for the process's life
            asyncio.get_running_loop().add_reader(wake_r.fileno(), wake_r.recv, 512)
            signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            with contextlib.suppress(RuntimeError):  # no loop yet: uvicorn sees should_exit
                asyncio.get_running_loop().call_soon(self._exit_if_nothing_to_drain, _PROMPT_EXIT_LOOKS)

        def _exit_if_nothing_to_drain(self, looks_left: int) -> None:
            state = self.server_state
            if state.tasks or any(answering(connection) for connection in state.connections):
                # Often the last answer's task is just finishing (its response sent): look again
                # shortly, for as long as uvicorn's own tick would take to notice; then its drain.
                if looks_left > 1:
                    asyncio.get_running_loop().call_later(_PROMPT_EXIT_LOOK_S, self._exit_if_nothing_to_drain,
                                                          looks_left - 1)
                return
            self.engine.stop()  # the loop blocks meanwhile: nobody is waiting on it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    return PromptServer


def answering(connection: Any) -> bool:
    """Whether one of uvicorn's HTTP connections still has an answer to make or send: a request
    cycle not complete (uvicorn's own test of an idle connection at shutdown), or bytes its
    transport has not handed to the kernel yet."""
    cycle = getattr(connection, "cycle", None)
    if cycle is not None and not getattr(cycle, "response_complete", False):
        return True
    transport = getattr(connection, "transport", None)
    return transport is not None and transport.get_write_buffer_size() > 0


def _notify_ready(line: str) -> None:
    fd = os.environ.pop(READY_FD_ENV, "")
    if not fd.isdigit():
        return
    try:
        os.write(int(fd), (line + "\n").encode())
        os.close(int(fd))
    except OSError:
        pass  # the launcher went away; the log still has the line


if __name__ == "__main__":
    exit_code = main()
    # The engine has drained, closed (and fsynced) its event log: skip the interpreter's teardown
    # of torch, which costs more than the whole shutdown (about half a second).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
