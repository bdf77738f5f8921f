"""Running the app with uvicorn: in the foreground (`specdec serve`) or in a background thread
on a free port (tests, `specdec bench-serve`).

Stopping (SIGTERM, Ctrl-C, `BackgroundServer.stop`) drains before uvicorn closes connections:
the server stops accepting connections, the app answers 503 to new requests and to those
waiting for a batch row, running requests get `shutdown_grace_s` seconds to finish and are
then answered 503 (a stream: an error event, then `[DONE]`), and the answers get
FLUSH_S seconds to reach their clients.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from specdec.errors import SpecDecError

SHUTDOWN_GRACE_S = 5.0
"""seconds running requests get to finish when the server stops (then they are answered 503)"""
FLUSH_S = 3.0
"""seconds the answers then get to reach their clients before uvicorn cancels what is left"""


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but on shutdown it first stops accepting connections and lets the app
    answer every request in flight (`app.state.drain`, see `specdec.serve.app`)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while draining (uvicorn's shutdown closes them too)
            server.close()
        drain = getattr(self.app.state, "drain", None)
        if drain is not None:
            await drain(self.grace_s)
        await super().shutdown(sockets)


def _server(app: FastAPI, host: str, port: int, log_level: str, grace_s: float) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=FLUSH_S)
    return _DrainingServer(config, app, grace_s)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM), then drain (see the module docstring)."""
    if not 0 <= port <= 65535:
        raise SpecDecError(f"--port {port} is not a TCP port; give a number from 1 to 65535 (0 picks a free one)")
    _server(app, host, port, log_level, shutdown_grace_s).run()


class BackgroundServer:
    """`with BackgroundServer(app) as server:` serves `app` from a thread at `server.url` until the block ends."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", start_timeout_s: float = 60.0,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    ) -> None:
        self.app = app
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as err:
            self._socket.close()
            raise SpecDecError(f"cannot listen on {host}:{port} ({err}); pick another --port") from err
        self.port = int(self._socket.getsockname()[1])
        self.shutdown_grace_s = shutdown_grace_s
        self._server = _server(app, host, self.port, log_level, shutdown_grace_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name="specdec-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """e.g. http://127.0.0.1:PORT (the OpenAI base URL is url + "/v1")."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

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
