"""The completion endpoints of d3d serve: read a body within its limits, parse it in the parser thread,
queue the job, then answer from the worker's events (whole or streamed), cancelling the job as soon as
its client leaves (see the package docstring)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from ..api import Generator
from .events import Done, Event, Failed, Round, Stopped
from .metrics import Metrics
from .requests import MAX_BODY_BYTES, ApiError, GenRequest, decode_body, parse_request
from .shaping import StreamShaper, completion_body, sse
from .worker import Job, QueueFull, Worker

log = logging.getLogger("d3d.server")

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


class Completions:
    """POST /v1/chat/completions and /v1/completions over one worker: `handle(request, chat)`."""

    def __init__(self, gen: Generator, worker: Worker, metrics: Metrics, request_timeout: float | None,
                 max_prompt_tokens: int | None, read_timeout: float | None, max_bytes_in_flight: int):
        self.gen, self.worker, self.metrics = gen, worker, metrics
        self.request_timeout, self.max_prompt_tokens, self.read_timeout = request_timeout, max_prompt_tokens, read_timeout
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="d3d-parse")
        self.budget = ByteBudget(max_bytes_in_flight)
        self.parse_backlog = worker.max_queue + 4  # requests read and waiting for (or in) the parser; beyond: 503
        self.parsing = 0

    def close(self) -> None:
        self.parser.shutdown(wait=False, cancel_futures=True)

    def _parse(self, raw: bytes, chat: bool) -> GenRequest:
        return parse_request(decode_body(raw), self.gen, chat, self.max_prompt_tokens)

    async def start(self, request: Request, chat: bool) -> Job:
        """Read, parse (in the parser thread) and queue a request; ApiError on any problem."""
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        raw = await read_body(request, timeout=self.read_timeout, budget=self.budget)
        try:
            if self.parsing >= self.parse_backlog:
                raise ApiError(503, f"server busy: {self.parsing} requests are already being parsed; retry later",
                               code="server_busy", type_="server_error")
            self.parsing += 1
            try:
                req = await asyncio.get_running_loop().run_in_executor(self.parser, self._parse, raw, chat)
            finally:
                self.parsing -= 1
        finally:
            self.budget.give(len(raw))
        del raw
        if not self.worker.alive:
            raise ApiError(503, "the generation worker is not running", code="worker_dead")
        job = Job(req, asyncio.get_running_loop(), deadline)
        try:
            self.worker.submit(job)
        except QueueFull:
            n = self.worker.max_queue
            raise ApiError(503, f"server busy: {n} requests are already waiting (--max-queue {n}); retry later",
                           code="queue_full", type_="server_error") from None
        return job

    async def watch_disconnect(self, request: Request, job: Job) -> None:
        """Wait for the client to go away (the body is read by now): cancel its job at once."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.worker.cancel(job)
        job.events.put_nowait(Stopped("disconnected"))

    async def next_event(self, job: Job) -> Event:
        """The job's next event; Stopped("expired") if its deadline passes while it is still queued."""
        while True:
            left = None if job.deadline is None or job.state != "queued" else job.deadline - time.monotonic()
            try:
                return await asyncio.wait_for(job.events.get(), timeout=None if left is None else max(0.0, left))
            except asyncio.TimeoutError:
                if self.worker.expire(job):
                    return Stopped("expired")

    def failure(self, ev: Event) -> ApiError | None:
        if isinstance(ev, Stopped) and ev.reason == "expired":
            return ApiError(504, f"request timed out in the queue (--request-timeout {self.request_timeout:g} s)",
                            code="timeout", type_="server_error")
        if isinstance(ev, Stopped):
            return ApiError(499, "client disconnected", code="cancelled", type_="server_error")
        return ev.error if isinstance(ev, Failed) else None

    async def handle(self, request: Request, chat: bool):
        endpoint = request.url.path
        watcher = None
        try:
            job = await self.start(request, chat)
            watcher = asyncio.create_task(self.watch_disconnect(request, job))
            first = await self.next_event(job)
            err = self.failure(first)
            if err is not None:
                raise err
        except ApiError as e:
            if watcher is not None:
                watcher.cancel()
            self.metrics.request(endpoint, e.status)
            return e.response()
        self.metrics.request(endpoint, 200)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.req.stream:
            return StreamingResponse(self._stream(job, first, watcher, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(job, first, watcher, rid, chat)

    def _release(self, job: Job, watcher: asyncio.Task) -> None:
        """After the answer, or when its client is gone: never leave the job running."""
        watcher.cancel()
        if job.state in ("queued", "running"):
            self.worker.cancel(job)

    async def _whole(self, job: Job, ev: Event, watcher: asyncio.Task, rid: str, chat: bool):
        try:
            while isinstance(ev, Round):
                ev = await self.next_event(job)
            err = self.failure(ev)
            if err is not None:
                return err.response()
        finally:
            self._release(job, watcher)
        return completion_body(ev, rid, chat, self.gen.name, self.gen.method, len(job.req.prompt_ids))

    async def _stream(self, job: Job, ev: Event, watcher: asyncio.Task, rid: str, chat: bool):
        shaper = StreamShaper(rid, chat, self.gen.name)
        try:
            if chat:
                yield shaper.role()
            while isinstance(ev, Round):
                yield shaper.round(ev)
                ev = await self.next_event(job)
            if isinstance(ev, Stopped):
                return
            if isinstance(ev, Failed):
                yield sse(ev.error.body())
            elif isinstance(ev, Done):
                for piece in shaper.done(ev, self.gen.method, len(job.req.prompt_ids), job.req.include_usage):
                    yield piece
            yield "data: [DONE]\n\n"
        finally:  # normal end, client gone (generator closed or cancelled)
            self._release(job, watcher)
