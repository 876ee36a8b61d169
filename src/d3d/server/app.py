"""The d3d serve app: its routes (the completions themselves: d3d.server.completions) and start-up
(see the package docstring)."""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import Generator
from ..errors import D3DError
from .completions import MAX_BYTES_IN_FLIGHT, MAX_CONNECTIONS, READ_TIMEOUT, Completions
from .metrics import Metrics
from .requests import STATIC, ApiError
from .security import Guard, check_api_key
from .worker import PREFILL_CHUNK, Worker

log = logging.getLogger("d3d.server")


def create_app(gen: Generator, max_queue: int = 16, api_key: str | None = None,
               allow_origins: list[str] | tuple = (), request_timeout: float | None = None,
               bind_host: str = "127.0.0.1", allow_hosts: list[str] | tuple = (),
               max_prompt_tokens: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK,
               read_timeout: float | None = READ_TIMEOUT, max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT,
               max_batch: int = 1) -> FastAPI:
    """The ASGI app. api_key: required on every path but /health (None = open; empty or blank: D3DError;
    surrounding whitespace stripped); allow_origins: browser origins besides the server's own ("*" = any);
    request_timeout: seconds from arrival to deadline; allow_hosts: Host names besides loopback and
    bind_host ("*" = any); max_prompt_tokens: prompt-token cap (None: the context window's room);
    prefill_chunk: prompt tokens per forward (cancel and deadline checked between chunks; None: PREFILL_CHUNK, or
    in a batch the widest forward of about d3d.scheduler.PREFILL_SECONDS); read_timeout: seconds to send a body
    (408); max_bytes_in_flight: body bytes held by all requests before parsing (503); max_batch: generations
    decoded together (continuous batching, d3d.scheduler) where the method batches."""
    if request_timeout is not None and not request_timeout > 0:
        raise D3DError(f"request_timeout must be > 0 (got {request_timeout})")
    if read_timeout is not None and not read_timeout > 0:
        raise D3DError(f"read_timeout must be > 0 (got {read_timeout})")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise D3DError(f"max_prompt_tokens must be >= 1 (got {max_prompt_tokens})")
    api_key = check_api_key(api_key)
    metrics = Metrics()
    worker = Worker(gen, max_queue, metrics, prefill_chunk, max_batch)
    if worker.batch_note:
        log.warning("--max-batch %d: %s", max_batch, worker.batch_note)
    completions = Completions(gen, worker, metrics, request_timeout, max_prompt_tokens, read_timeout,
                              max_bytes_in_flight)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.stop()
        completions.close()

    app = FastAPI(title="d3d", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Guard, metrics=metrics, api_key=api_key, allow_origins=list(allow_origins),
                       bind_host=bind_host, allow_hosts=list(allow_hosts))
    app.state.gen, app.state.worker, app.state.metrics = gen, worker, metrics
    page = (STATIC / "index.html").read_text()
    started = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                        type_="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        with worker.lock:
            busy = {"running": worker.running, "waiting": worker.waiting, "max_queue": worker.max_queue,
                    "max_batch": worker.max_batch}
        alive = worker.alive
        body = {"status": "ok" if alive else "error", "worker": "alive" if alive else "dead", "model": gen.name,
                "method": gen.method, **busy}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gen.name, "object": "model", "created": started,
                                            "owned_by": "d3d", "method": gen.method,
                                            "context_window": gen.context_window}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(gen, worker), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completions.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions_endpoint(request: Request):
        return await completions.handle(request, chat=False)

    return app


def check_address(host: str, port: int) -> None:
    """Fail fast (before the model loads) if host:port cannot be listened on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise D3DError(f"cannot resolve --host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise D3DError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def http_protocol(header_timeout: float | None):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: a connection that has not sent
    complete headers `header_timeout` seconds after it opened (or after its last response) is closed, so
    idle or slow-loris connections cannot pile up (uvicorn's keep-alive timer stops at the first byte)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        def _arm_header_timer(self) -> None:
            old = getattr(self, "_header_timer", None)
            if old is not None:
                old.cancel()
            self._header_timer = None if header_timeout is None else \
                self.loop.call_later(header_timeout, self._header_timeout)

        def _header_timeout(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no request under way: nobody to answer

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return GuardedH11


def server_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  max_connections: int = MAX_CONNECTIONS, read_timeout: float | None = READ_TIMEOUT):
    """uvicorn's Config for `app` with the limits that hold before the queue: at most `max_connections`
    open connections and running requests (503 beyond), headers within `read_timeout` seconds of a
    connection's start or last response (else it is closed), idle keep-alive connections closed after
    5 s, headers of at most 16 KB (h11's default)."""
    import uvicorn

    if max_connections < 1:
        raise D3DError(f"max_connections must be >= 1 (got {max_connections})")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2,
                          http=http_protocol(read_timeout), limit_concurrency=max_connections, timeout_keep_alive=5)


def serve(gen: Generator, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
          log_level: str = "info", api_key: str | None = None, allow_origins: list[str] | tuple = (),
          request_timeout: float | None = None, allow_hosts: list[str] | tuple = (),
          max_prompt_tokens: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK,
          max_connections: int = MAX_CONNECTIONS, read_timeout: float | None = READ_TIMEOUT, max_batch: int = 1) -> None:
    import uvicorn

    app = create_app(gen, max_queue, api_key, allow_origins, request_timeout, host, allow_hosts, max_prompt_tokens,
                     prefill_chunk, read_timeout, max_batch=max_batch)
    uvicorn.Server(server_config(app, host, port, log_level, max_connections, read_timeout)).run()
