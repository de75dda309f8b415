"""Run the dashboard with uvicorn on a thread of `gym-server serve` (same host, TLS when it has certificates)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

log = logging.getLogger("zoo_gym.dashboard")


def _warm(check) -> None:
    try:
        check.report()
    except Exception:  # noqa: BLE001 - a page load asks again and answers 500 with the headers
        log.exception("verifying the ledger for the dashboard failed")


class DashboardServer:
    """uvicorn on a socket bound here (so a taken port fails at once, and port 0 is known), in a thread."""

    def __init__(self, app, *, host: str, port: int, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None) -> None:
        bare = host.strip("[]")
        family = socket.AF_INET6 if ":" in bare else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bare, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot bind the dashboard to {host}:{port}: {exc.strerror}; choose another "
                          "--dashboard-port") from exc
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.host = host
        self.scheme = "https" if ssl_certfile else "http"
        config = uvicorn.Config(app, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, log_config=None,
                                access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{self.scheme}://{host}:{self.port}/"

    def start(self, timeout: float = 10.0) -> None:
        check = getattr(self._server.config.app.state, "ledger_check", None)
        if check is not None:  # verify the ledger now, not on the first page load
            threading.Thread(target=_warm, args=(check,), name="ledger-check", daemon=True).start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
