"""Running the app with uvicorn: in the foreground (`specdec serve`) or in a background thread
on a free port (tests, `specdec bench-serve`)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from specdec.errors import SpecDecError

GRACEFUL_SHUTDOWN_S = 5
"""seconds open connections (streams) get to finish when the server stops"""


def _config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C)."""
    if not 0 <= port <= 65535:
        raise SpecDecError(f"--port {port} is not a TCP port; give a number from 1 to 65535 (0 picks a free one)")
    uvicorn.Server(_config(app, host, port, log_level)).run()


class BackgroundServer:
    """`with BackgroundServer(app) as server:` serves `app` from a thread at `server.url` until the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
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
        self._server = uvicorn.Server(_config(app, host, self.port, log_level))
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
            self._thread.join(GRACEFUL_SHUTDOWN_S + 30)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
