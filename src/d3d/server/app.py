"""The d3d serve app: endpoints, SSE streaming, start-up (see the package docstring)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..api import Generator
from ..errors import D3DError
from .metrics import Metrics
from .requests import FINISH, MAX_BODY_BYTES, STATIC, ApiError, GenRequest, decode_body, parse_request
from .security import Guard, check_api_key
from .worker import PREFILL_CHUNK, Job, QueueFull, Worker


log = logging.getLogger("d3d.server")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


READ_TIMEOUT = 10.0            # seconds to send a request's headers, and again its body (then 408)
MAX_CONNECTIONS = 512          # open connections (uvicorn's limit_concurrency; beyond: 503)
MAX_BYTES_IN_FLIGHT = 64 << 20  # request body bytes held by all requests being read or parsed (beyond: 503)


class ByteBudget:
    """Body bytes held by requests being read or parsed, all together (event-loop thread only)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise ApiError(503, f"server busy: {self.limit} bytes of request bodies already in flight; retry later",
                           code="server_busy", type_="server_error")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout: float | None = READ_TIMEOUT,
                    budget: ByteBudget | None = None) -> bytes:
    """The request body, read piece by piece: 413 as soon as it is known to exceed `limit` (from
    Content-Length before reading anything, else while reading); 408 when it takes over `timeout`
    seconds (a body trickled in); 503 when `budget` has no room for it. A client that leaves mid-body
    is one log line and a 499 nobody reads. The bytes stay taken from `budget` (the caller gives them back)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                if size + len(part) > limit:
                    raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
                if budget is not None:
                    budget.take(len(part))
                size += len(part)
                parts.append(part)
    except TimeoutError:
        if budget is not None:
            budget.give(size)
        client = request.client.host if request.client else "?"
        log.info("request body from %s not received within %g s: 408", client, timeout)
        raise ApiError(408, f"request body not received within {timeout:g} s", code="timeout") from None
    except ClientDisconnect:
        if budget is not None:
            budget.give(size)
        client = request.client.host if request.client else "?"
        log.info("client %s disconnected while sending its request body", client)
        raise ApiError(499, "client disconnected", code="cancelled", type_="server_error") from None
    except BaseException:
        if budget is not None:
            budget.give(size)
        raise
    return b"".join(parts)


def create_app(gen: Generator, max_queue: int = 16, api_key: str | None = None,
               allow_origins: list[str] | tuple = (), request_timeout: float | None = None,
               bind_host: str = "127.0.0.1", allow_hosts: list[str] | tuple = (),
               max_prompt_tokens: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
               read_timeout: float | None = READ_TIMEOUT, max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT) -> FastAPI:
    """The ASGI app. api_key: required on every path but /health (None = open; empty or blank: D3DError;
    surrounding whitespace stripped); allow_origins: browser origins besides the server's own ("*" = any);
    request_timeout: seconds from arrival to deadline; allow_hosts: Host names besides loopback and
    bind_host ("*" = any); max_prompt_tokens: prompt-token cap (None: the context window's room);
    prefill_chunk: prompt tokens per forward (cancel and deadline checked between chunks); read_timeout:
    seconds to send a body (408); max_bytes_in_flight: body bytes held by all requests before parsing (503)."""
    if request_timeout is not None and not request_timeout > 0:
        raise D3DError(f"request_timeout must be > 0 (got {request_timeout})")
    if read_timeout is not None and not read_timeout > 0:
        raise D3DError(f"read_timeout must be > 0 (got {read_timeout})")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise D3DError(f"max_prompt_tokens must be >= 1 (got {max_prompt_tokens})")
    api_key = check_api_key(api_key)
    metrics = Metrics()
    worker = Worker(gen, max_queue, metrics, prefill_chunk)
    parser = ThreadPoolExecutor(1, thread_name_prefix="d3d-parse")
    budget = ByteBudget(max_bytes_in_flight)
    parse_backlog = max_queue + 4  # requests read and waiting for (or in) the parser thread; beyond: 503
    parsing = 0

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.stop()
        parser.shutdown(wait=False, cancel_futures=True)

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
            busy = {"running": worker.running, "waiting": worker.waiting, "max_queue": worker.max_queue}
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

    def parse(raw: bytes, chat: bool) -> GenRequest:
        return parse_request(decode_body(raw), gen, chat, max_prompt_tokens)

    async def start(request: Request, chat: bool) -> Job:
        """Read, parse (in the parser thread) and queue a request; ApiError on any problem."""
        nonlocal parsing
        deadline = None if request_timeout is None else time.monotonic() + request_timeout
        raw = await read_body(request, timeout=read_timeout, budget=budget)
        try:
            if parsing >= parse_backlog:
                raise ApiError(503, f"server busy: {parsing} requests are already being parsed; retry later",
                               code="server_busy", type_="server_error")
            parsing += 1
            try:
                req = await asyncio.get_running_loop().run_in_executor(parser, parse, raw, chat)
            finally:
                parsing -= 1
        finally:
            budget.give(len(raw))
        del raw
        if not worker.alive:
            raise ApiError(503, "the generation worker is not running", code="worker_dead")
        job = Job(req, asyncio.get_running_loop(), deadline)
        try:
            worker.submit(job)
        except QueueFull:
            raise ApiError(503, f"server busy: {worker.max_queue} requests are already waiting (--max-queue "
                                f"{worker.max_queue}); retry later", code="queue_full", type_="server_error") from None
        return job

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Wait for the client to go away (the body is read by now): cancel its job at once."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        worker.cancel(job)
        job.events.put_nowait(("disconnected",))

    async def next_event(job: Job) -> tuple:
        """The job's next event; ("expired",) if its deadline passes while it is still queued."""
        while True:
            left = None if job.deadline is None or job.state != "queued" else job.deadline - time.monotonic()
            try:
                return await asyncio.wait_for(job.events.get(), timeout=None if left is None else max(0.0, left))
            except asyncio.TimeoutError:
                if worker.expire(job):
                    return ("expired",)

    def failure(ev: tuple) -> ApiError | None:
        if ev[0] in ("cancelled", "disconnected"):
            return ApiError(499, "client disconnected", code="cancelled", type_="server_error")
        if ev[0] == "expired":
            return ApiError(504, f"request timed out in the queue (--request-timeout {request_timeout:g} s)",
                            code="timeout", type_="server_error")
        return ev[1] if ev[0] == "error" else None

    async def completion(request: Request, chat: bool):
        endpoint = request.url.path
        watcher = None
        try:
            job = await start(request, chat)
            watcher = asyncio.create_task(watch_disconnect(request, job))
            first = await next_event(job)
            err = failure(first)
            if err is not None:
                raise err
        except ApiError as e:
            if watcher is not None:
                watcher.cancel()
            metrics.request(endpoint, e.status)
            return e.response()
        metrics.request(endpoint, 200)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.req.stream:
            return StreamingResponse(_stream(job, first, watcher, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _plain(job, first, watcher, rid, chat)

    async def _plain(job: Job, ev: tuple, watcher: asyncio.Task, rid: str, chat: bool):
        try:
            while ev[0] == "round":
                ev = await next_event(job)
            err = failure(ev)
            if err is not None:
                return err.response()
        finally:
            watcher.cancel()
            if job.state in ("queued", "running"):
                worker.cancel(job)
        _, res, _, lps = ev
        finish = FINISH.get(res.finish_reason, res.finish_reason)
        choice = {"index": 0, "logprobs": lps, "finish_reason": finish}
        choice |= {"message": {"role": "assistant", "content": res.text}} if chat else {"text": res.text}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": gen.name, "choices": [choice], "usage": _usage(len(job.req.prompt_ids), res.new_tokens),
                "d3d": {"method": gen.method, "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 2),
                        "rounds": res.rounds, "acceptance_lengths": res.acceptance_lengths,
                        "finish_reason": res.finish_reason}}

    async def _stream(job: Job, ev: tuple, watcher: asyncio.Task, rid: str, chat: bool):
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": gen.name}

        def chunk(text: str | None, finish: str | None = None, role: bool = False, logprobs=None, **extra) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                c = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return base | {"choices": [c]} | extra

        ntok, rounds, round_tokens, t_first = 0, 0, 0, None
        try:
            if chat:
                yield _sse(chunk(None, role=True))
            while True:
                if ev[0] == "round":
                    _, ids, accepted, t, parts, lps, branch = ev
                    ntok += len(ids)
                    if t_first is None:
                        t_first = t
                    else:
                        rounds, round_tokens = rounds + 1, round_tokens + accepted + 1
                    segments = [{"text": s, "draft": d} for s, d in parts if s]
                    info = {"accepted": accepted, "tokens": ids, "segments": segments, "new_tokens": ntok,
                            "rounds": rounds,
                            "tau": round(round_tokens / rounds, 4) if rounds else 1.0,
                            "tokens_per_s": round((ntok - 1) / (t - t_first), 2) if t > t_first else 0.0,
                            "prefill": rounds == 0}
                    if branch is not None:  # d3d-tree, lookup-tree: which proposer's branch the accepted path came from
                        info["branch"] = branch
                    yield _sse(chunk("".join(s["text"] for s in segments), logprobs=lps, d3d=info))
                    ev = await next_event(job)
                    continue
                if ev[0] in ("cancelled", "disconnected"):
                    return
                if ev[0] == "error":
                    yield _sse(ev[1].body())
                    break
                _, res, tail, _ = ev  # done
                if tail:
                    seg = [{"text": tail, "draft": False}]
                    yield _sse(chunk(tail, d3d={"accepted": 0, "tokens": [], "segments": seg}))
                finish = FINISH.get(res.finish_reason, res.finish_reason)
                yield _sse(chunk(None, finish, d3d={"method": gen.method, "tau": round(res.tau, 4),
                                                    "tokens_per_s": round(res.tokens_per_s, 2), "rounds": res.rounds,
                                                    "new_tokens": res.new_tokens, "finish_reason": res.finish_reason}))
                if job.req.include_usage:
                    yield _sse(base | {"choices": [], "usage": _usage(len(job.req.prompt_ids), res.new_tokens)})
                break
            yield "data: [DONE]\n\n"
        finally:  # normal end, client gone (generator closed or cancelled): never leave the job running
            watcher.cancel()
            if job.state in ("queued", "running"):
                worker.cancel(job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

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
          max_prompt_tokens: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
          max_connections: int = MAX_CONNECTIONS, read_timeout: float | None = READ_TIMEOUT) -> None:
    import uvicorn

    app = create_app(gen, max_queue, api_key, allow_origins, request_timeout, host, allow_hosts, max_prompt_tokens,
                     prefill_chunk, read_timeout)
    uvicorn.Server(server_config(app, host, port, log_level, max_connections, read_timeout)).run()
