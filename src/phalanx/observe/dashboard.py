"""`phalanx run --dashboard [HOST:]PORT`: a read-only live page of the job, served by the launcher
on node 0 (starlette on uvicorn, in a thread of the launcher; plots by plotly.js from the plotly
package, served from here: no network needed). It reads RUN_DIR/observe/status.json, which rank 0
rewrites once a second: training never waits for the page or a browser.

Bound to 127.0.0.1 unless told otherwise; on any other address every request needs the token the
launcher prints in the URL (`?token=...`). No torch here (the launcher imports it).

Names on the page are the job's data, never markup: every reply carries a Content-Security-Policy
that allows only the server's own script files (no inline script, no event-handler attributes), and
is never framed. A connection that has not sent a whole request within REQUEST_TIMEOUT_S is closed
(uvicorn's keep-alive timer stops at the first byte), one address holds at most MAX_PER_CLIENT
connections (more are answered 429 and closed before uvicorn counts them: one client holding
hundreds half-open no longer fills MAX_CONNECTIONS and turns everyone else away with 503), and
workers forked by the launcher close their copy of the listening socket (os.register_at_fork), so
only the launcher holds the port.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any

from phalanx.observe import records
from phalanx.observe.dashboard_page import PAGE, SCRIPT
from phalanx.observe.history import History

REQUEST_TIMEOUT_S = 10.0  # connected, no whole request answered by then: closed
IDLE_TIMEOUT_S = 5  # uvicorn's keep-alive: an idle connection between requests
MAX_CONNECTIONS = 64  # beyond this uvicorn answers 503 at once
MAX_PER_CLIENT = 16  # connections one address may hold; a browser opens 6; beyond: 429 and closed
TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: 52\r\n\r\ntoo many connections from this address: close some\r\n"
)
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'none'"
    ),  # plotly sets inline styles; no script but ours
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token is in the URL
}
EXTRA_HINT = "HINT: pip install starlette uvicorn plotly (in phalanx's clone: pip install -e '.[dashboard]')."


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


def _protocol_class() -> Any:
    """uvicorn's h11 protocol, with a deadline for each request: from the connection (or the last
    reply) to a whole request answered. Our handlers answer from memory at once, so a connection
    still unanswered then is idle or half-sent (slowloris): it is closed. And a limit per client
    address: its connection beyond MAX_PER_CLIENT is answered 429 and closed at once."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    held: dict[str, int] = {}  # connections open per client address (the server's one event loop)

    class DeadlineProtocol(H11Protocol):
        _deadline: Any = None
        _client: str | None = None  # counted in `held`; None: refused, uvicorn never saw it

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(REQUEST_TIMEOUT_S, self._expire)

        def _expire(self) -> None:
            if self.conn.our_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if peer else ""
            if held.get(client, 0) >= MAX_PER_CLIENT:
                transport.write(TOO_MANY)
                transport.close()
                return
            held[client] = held.get(client, 0) + 1
            self._client = client
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._client is not None:
                super().data_received(data)

        def eof_received(self) -> None:
            if self._client is not None:
                super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._client is None:
                return  # refused in connection_made
            held[self._client] -= 1
            if not held[self._client]:
                del held[self._client]
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return DeadlineProtocol


def _close_in_forked_children(sock: socket.socket) -> None:
    """A worker forked from the launcher closes its copy of the listening socket at once (exec'd
    workers never get it: Python's sockets are not inheritable)."""
    ref = weakref.ref(sock)

    def close() -> None:
        held = ref()
        if held is not None:
            held.close()

    os.register_at_fork(after_in_child=close)


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
        from starlette.middleware import Middleware
        from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
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
                    return PlainTextResponse(
                        "forbidden: this dashboard needs the token printed with its URL\n", status_code=403
                    )
                return handler(request)

            return endpoint

        class SafeJSON(JSONResponse):
            def render(self, content: Any) -> bytes:
                return super().render(records.json_safe(content))

        def status(request: Request) -> JSONResponse:
            latest = history.page()["status"]
            return SafeJSON(records.api_status(latest or {}))

        class Headers:  # a plain ASGI middleware: every reply, 403 and 404 included
            def __init__(self, inner: Any):
                self.inner = inner

            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                async def send_with_headers(message: Any) -> None:
                    if message["type"] == "http.response.start":
                        message["headers"] = [
                            *message.get("headers", []),
                            *((k.lower().encode(), v.encode()) for k, v in HEADERS.items()),
                        ]
                    await send(message)

                await self.inner(scope, receive, send_with_headers)

        return Starlette(
            middleware=[Middleware(Headers)],
            routes=[
                Route("/", guarded(lambda r: HTMLResponse(page)), methods=["GET"]),
                Route(
                    "/dashboard.js", guarded(lambda r: Response(SCRIPT, media_type="text/javascript")), methods=["GET"]
                ),
                Route(
                    "/plotly.min.js",
                    guarded(lambda r: FileResponse(plotly_js, media_type="text/javascript")),
                    methods=["GET"],
                ),
                Route("/api/status", guarded(status), methods=["GET"]),
                Route("/api/page", guarded(lambda r: SafeJSON(history.page())), methods=["GET"]),
            ],
        )

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
            raise DashboardError(
                f"--dashboard {self.host}:{self.port}: cannot listen there: {error.strerror}. "
                "HINT: pick another port, e.g. --dashboard 8765."
            ) from None
        self.port = sock.getsockname()[1]
        _close_in_forked_children(sock)
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            http=_protocol_class(),
            timeout_keep_alive=IDLE_TIMEOUT_S,
            limit_concurrency=MAX_CONNECTIONS,
        )
        self._server = uvicorn.Server(config)
        self.history.start()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="phalanx-dashboard", daemon=True
        )
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
