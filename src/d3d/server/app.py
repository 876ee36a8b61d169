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

from ..api import Generator
from ..errors import D3DError
from .metrics import Metrics
from .requests import FINISH, MAX_BODY_BYTES, STATIC, ApiError, GenRequest, decode_body, parse_request
from .security import Guard
from .worker import Job, QueueFull, Worker


log = logging.getLogger("d3d.server")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, read piece by piece: 413 as soon as it is known to exceed `limit` (from
    Content-Length before reading anything, else while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        parts.append(part)
    return b"".join(parts)


def create_app(gen: Generator, max_queue: int = 16, api_key: str | None = None,
               allow_origins: list[str] | tuple = (), request_timeout: float | None = None,
               bind_host: str = "127.0.0.1") -> FastAPI:
    """The ASGI app. api_key: required on every path but /health (None = open); allow_origins: browser
    origins besides the server's own ("*" = any); request_timeout: seconds from arrival to deadline."""
    if request_timeout is not None and not request_timeout > 0:
        raise D3DError(f"request_timeout must be > 0 (got {request_timeout})")
    metrics = Metrics()
    worker = Worker(gen, max_queue, metrics)
    parser = ThreadPoolExecutor(1, thread_name_prefix="d3d-parse")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.stop()
        parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="d3d", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Guard, metrics=metrics, api_key=api_key or None, allow_origins=list(allow_origins),
                       bind_host=bind_host)
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
        return parse_request(decode_body(raw), gen, chat)

    async def start(request: Request, chat: bool) -> Job:
        """Read, parse (in the parser thread) and queue a request; ApiError on any problem."""
        deadline = None if request_timeout is None else time.monotonic() + request_timeout
        raw = await read_body(request)
        req = await asyncio.get_running_loop().run_in_executor(parser, parse, raw, chat)
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


def serve(gen: Generator, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
          log_level: str = "info", api_key: str | None = None, allow_origins: list[str] | tuple = (),
          request_timeout: float | None = None) -> None:
    import uvicorn

    app = create_app(gen, max_queue, api_key, allow_origins, request_timeout, host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
