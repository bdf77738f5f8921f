"""Running the app with uvicorn: in the foreground (`specdec serve`) or in a background thread
on a free port (tests, `specdec bench-serve`).

Stopping (SIGTERM, Ctrl-C, `BackgroundServer.stop`) drains before uvicorn closes connections:
the server stops accepting connections, the app answers 503 to new requests and to those
waiting for a batch row, running requests get `shutdown_grace_s` seconds to finish and are
then answered 503 (a stream: an error event, then `[DONE]`), and the answers get
FLUSH_S seconds to reach their clients.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from specdec.errors import SpecDecError

SHUTDOWN_GRACE_S = 5.0
"""seconds running requests get to finish when the server stops (then they are answered 503)"""
FLUSH_S = 3.0
"""seconds the answers then get to reach their clients before uvicorn cancels what is left"""

log = logging.getLogger("uvicorn.error")


def base_url(host: str, port: int) -> str:
    """e.g. http://127.0.0.1:8000 (an IPv6 address in brackets; the OpenAI base URL is this + "/v1")."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) for uvicorn to listen on; port 0 binds one free port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SpecDecError(f"cannot listen on {host}:{port} ({err}); pick another --port") from err
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but on shutdown it first stops accepting connections and lets the app
    answer every request in flight (`app.state.drain`, see `specdec.serve.app`)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float, on_listening: Callable[[str], None] | None = None) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self.on_listening = on_listening

    @property
    def port(self) -> int | None:
        """The TCP port the server listens on (the one bound when config.port is 0); None before it listens."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        port = self.port
        if not self.started or port is None:
            return
        url = base_url(self.config.host, port)
        if sockets is not None:  # uvicorn logs where it listens only when it binds the socket itself
            log.info("Uvicorn running on %s (Press CTRL+C to quit)", url)
        if self.on_listening is not None:
            self.on_listening(url)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while draining (uvicorn's shutdown closes them too)
            server.close()
        drain = getattr(self.app.state, "drain", None)
        if drain is not None:
            await drain(self.grace_s)
        await super().shutdown(sockets)


def _server(
    app: FastAPI, host: str, port: int, log_level: str, grace_s: float, on_listening: Callable[[str], None] | None = None
) -> _DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=FLUSH_S)
    return _DrainingServer(config, app, grace_s, on_listening)


def serve(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM), then drain (see the module docstring).

    on_listening: called with the server's base URL (`base_url`) once it accepts connections,
    with the port actually bound: port 0 binds one free port, and the URL names it."""
    if not 0 <= port <= 65535:
        raise SpecDecError(f"--port {port} is not a TCP port; give a number from 1 to 65535 (0 picks a free one)")
    if port != 0:
        _server(app, host, port, log_level, shutdown_grace_s, on_listening).run()
        return
    # uvicorn would bind port 0 once per address of the host (localhost: ::1 and 127.0.0.1, two
    # different free ports); one socket bound here gives one port, the one announced
    sock = _listening_socket(host, 0)
    try:
        _server(app, host, int(sock.getsockname()[1]), log_level, shutdown_grace_s, on_listening).run(sockets=[sock])
    finally:
        sock.close()


class BackgroundServer:
    """`with BackgroundServer(app) as server:` serves `app` from a thread at `server.url` until the block ends."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", start_timeout_s: float = 60.0,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    ) -> None:
        self.app = app
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._socket = _listening_socket(host, port)
        self.port = int(self._socket.getsockname()[1])
        self.shutdown_grace_s = shutdown_grace_s
        self._server = _server(app, host, self.port, log_level, shutdown_grace_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name="specdec-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """e.g. http://127.0.0.1:PORT (the OpenAI base URL is url + "/v1")."""
        return base_url(self.host, self.port)

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(self.shutdown_grace_s + FLUSH_S + 30)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
