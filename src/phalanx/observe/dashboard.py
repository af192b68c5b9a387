"""`phalanx run --dashboard [HOST:]PORT`: a read-only live page of the job, served by the launcher
on node 0 (starlette on uvicorn, in a thread of the launcher; plots by plotly.js from the plotly
package, served from here: no network needed). It reads RUN_DIR/observe/status.json, which rank 0
rewrites once a second: training never waits for the page or a browser.

Bound to 127.0.0.1 unless told otherwise; on any other address every request needs the token the
launcher prints in the URL (`?token=...`). No torch here (the launcher imports it).
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import threading
import time
from typing import Any

from phalanx.observe import records
from phalanx.observe.dashboard_page import PAGE
from phalanx.observe.history import History

EXTRA_HINT = "HINT: pip install 'phalanx[dashboard]' (starlette, uvicorn, plotly)."


class DashboardError(ValueError):
    """The dashboard cannot start (missing extra, address in use): refused before any worker starts."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _plotly_js() -> str:
    import plotly

    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    if not os.path.exists(path):
        raise DashboardError(f"the plotly package has no bundled plotly.min.js ({path}). {EXTRA_HINT}")
    return path


class Dashboard:
    """The server and its sampler; `start()` binds (errors surface here), `stop()` ends both."""

    def __init__(self, run_dir: str, address: str, token: str | None = None):
        host, _, port = address.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.token = None if is_loopback(self.host) else (token or secrets.token_urlsafe(16))
        self.history = History(run_dir)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
        from starlette.routing import Route

        plotly_js = _plotly_js()
        history = self.history
        token = self.token
        page = PAGE.replace("__QS__", f"?token={token}" if token else "")

        def allowed(request: Request) -> bool:
            return token is None or secrets.compare_digest(request.query_params.get("token", ""), token)

        def guarded(handler: Any) -> Any:
            async def endpoint(request: Request) -> Any:
                if not allowed(request):
                    return PlainTextResponse("forbidden: this dashboard needs the token printed with its URL\n",
                                             status_code=403)
                return handler(request)
            return endpoint

        def status(request: Request) -> JSONResponse:
            latest = history.page()["status"]
            return JSONResponse(records.api_status(latest or {}))

        return Starlette(routes=[
            Route("/", guarded(lambda r: HTMLResponse(page)), methods=["GET"]),
            Route("/plotly.min.js", guarded(lambda r: FileResponse(plotly_js, media_type="text/javascript")),
                  methods=["GET"]),
            Route("/api/status", guarded(status), methods=["GET"]),
            Route("/api/page", guarded(lambda r: JSONResponse(history.page())), methods=["GET"]),
        ])

    def start(self) -> "Dashboard":
        try:
            import uvicorn
        except ImportError:
            raise DashboardError(f"--dashboard needs uvicorn and starlette. {EXTRA_HINT}") from None
        try:
            app = self.app()
        except ImportError as error:
            raise DashboardError(f"--dashboard needs {error.name}. {EXTRA_HINT}") from None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as error:
            sock.close()
            raise DashboardError(f"--dashboard {self.host}:{self.port}: cannot listen there: {error.strerror}. "
                                 "HINT: pick another port, e.g. --dashboard 8765.") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self.history.start()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="phalanx-dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.history.stop()
