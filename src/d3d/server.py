"""`d3d serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around one Generator.

Endpoints: GET / (a web page showing drafting live), GET /health, GET /v1/models,
POST /v1/chat/completions, POST /v1/completions (plain JSON or server-sent events), GET /metrics
(Prometheus text format).

Concurrency: one model, one generation worker thread, a bounded FIFO queue in front of it. A request
that finds `max_queue` requests already waiting behind the running one gets 503. A client that
disconnects (streaming or not) has its request dropped from the queue, or its generation stopped at
the next round (the engine's on_round callback raises), so its slot frees at once.

Streamed chunks carry, besides the OpenAI fields, a `d3d` object per round: `accepted` (draft tokens
accepted in the round), `tokens` (the round's token ids), `segments` (the round's text split into
`{"text", "draft": bool}` pieces: accepted drafts vs the target's own token), running `tau` and
`tokens_per_s`. The web page uses it; OpenAI clients ignore it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import Generator, check_messages
from .target import D3DError
from .verify import SamplingParams

log = logging.getLogger("d3d.server")
STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_TOKENS = 512
MAX_BODY_BYTES = 4 << 20
MAX_STOP = 16
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class ApiError(Exception):
    """An error answered as an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# ---------------------------------------------------------------------------------------------
# Request parsing


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise bad(f"'{key}' must be a number (got {json.dumps(v)})", key)
    if v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad(f"'{key}' must be in {rng} (got {v})", key)
    return float(v)


def _int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer (got {json.dumps(v)})", key)
    return v


def parse_request(body, gen: Generator, chat: bool) -> GenRequest:
    """Validate an OpenAI-style request body; every problem is an ApiError(400)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("'model' must be a string", "model")
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")

    if chat:
        if "messages" not in body:
            raise bad("'messages' is required", "messages")
        try:
            messages = check_messages(body["messages"])
            prompt_ids = gen.encode(messages)
        except D3DError as e:
            raise bad(str(e), "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise bad("empty prompt", "prompt")
            prompt_ids = gen.encode(prompt, raw=True)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = min(len(gen.tokenizer), gen.model.args.vocab_size)
            if not all(0 <= t < vocab for t in prompt):
                raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(prompt)
        elif prompt is None:
            raise bad("'prompt' is required", "prompt")
        else:
            raise bad("'prompt' must be a string (or a list of one string, or a list of token ids)", "prompt")
    if not prompt_ids:
        raise bad("empty prompt", "messages" if chat else "prompt")

    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k") or 0
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0 (got {top_k})", "top_k")
    seed = _int(body, "seed")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key)
    room = gen.context_window - len(prompt_ids) - gen.block_size
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
    elif max_tokens <= 0:
        raise bad(f"'{key}' must be > 0 (got {max_tokens})", key)
    if room <= 0:
        raise bad(f"prompt too long: {len(prompt_ids)} tokens leave no room in the context window "
                  f"({gen.context_window} tokens)", "messages" if chat else "prompt", "context_length_exceeded")
    try:
        gen.check(prompt_ids, max_tokens)
    except D3DError as e:
        raise bad(f"'{key}' too large: {e}", key, "context_length_exceeded") from None

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop strings", "stop")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except D3DError as e:
        raise bad(str(e)) from None
    return GenRequest(prompt_ids, params, max_tokens, stop, stream, bool(opts.get("include_usage", False)))


# ---------------------------------------------------------------------------------------------
# Incremental text


class TextStreamer:
    """Turns rounds of token ids into text deltas whose concatenation is exactly the final text: EOS
    dropped, cut before the first stop string; text that might still become a stop string, or is an
    incomplete UTF-8 character, is held back until it is certain."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.eos = {tokenizer.eos_token_id}
        self.ids: list[int] = []
        self.emitted = ""

    def _visible(self, final: bool) -> str:
        text = self.tokenizer.decode([t for t in self.ids if t not in self.eos])
        cut = min((text.index(s) for s in self.stop if s in text), default=None)
        if cut is not None:
            return text[:cut]
        if final:
            return text
        text = text.rstrip("\ufffd")
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[:len(text) - hold]

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self._visible(final)
        if len(text) > len(self.emitted) and text.startswith(self.emitted):
            delta, self.emitted = text[len(self.emitted):], text
            return delta
        return ""


# ---------------------------------------------------------------------------------------------
# The generation worker


class Cancelled(Exception):
    """Raised from on_round to stop a generation whose client went away."""


@dataclass
class Job:
    req: GenRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued -> running -> done | cancelled

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancel_flag.set()


class QueueFull(Exception):
    pass


class Worker:
    """One thread that runs generations one after the other, FIFO, with at most `max_queue` waiting."""

    def __init__(self, gen: Generator, max_queue: int, metrics: "Metrics"):
        self.gen, self.max_queue, self.metrics = gen, max_queue, metrics
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.thread = threading.Thread(target=self._loop, name="d3d-generation", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.waiting >= self.max_queue:
                raise QueueFull
            self.waiting += 1
        self.queue.put(job)

    def cancel(self, job: Job) -> None:
        """Drop a queued job at once, or stop a running one at its next round."""
        job.cancel_flag.set()
        with self.lock:
            if job.state == "queued":
                job.state = "cancelled"
                self.waiting -= 1
                self.metrics.cancelled += 1

    def stop(self) -> None:
        self.queue.put(None)

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            with self.lock:
                if job.state == "cancelled":
                    continue
                job.state, self.waiting, self.running = "running", self.waiting - 1, 1
            event = self._run(job)
            with self.lock:
                self.running = 0
            job.emit(*event)  # after the bookkeeping: a client that has its answer sees an idle worker

    def _run(self, job: Job) -> tuple:
        def on_round(chunk: list[int], accepted: int) -> None:
            if job.cancel_flag.is_set():
                raise Cancelled
            job.emit("round", list(chunk), accepted, time.perf_counter())

        r = job.req
        try:
            res = self.gen.run(r.prompt_ids, r.params, r.max_tokens, r.stop, on_round=on_round)
        except Cancelled:
            job.state = "cancelled"
            with self.lock:
                self.metrics.cancelled += 1
            return ("cancelled",)
        except D3DError as e:
            job.state = "done"
            return "error", bad(str(e))
        except Exception as e:  # never seen; reported as a 500 body, and the worker keeps going
            log.exception("generation failed")
            job.state = "done"
            return "error", ApiError(500, f"generation failed: {type(e).__name__}: {e}")
        job.state = "done"
        self.metrics.generation(len(r.prompt_ids), res)
        return "done", res


# ---------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.cancelled = 0
        self.generations = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.rounds = 0
        self.round_tokens = 0
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.last_tau = 0.0
        self.last_tokens_per_s = 0.0

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def generation(self, prompt_tokens: int, res) -> None:
        with self.lock:
            self.generations += 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += res.new_tokens
            self.rounds += res.rounds
            self.round_tokens += sum(res.acceptance_lengths)
            self.decode_tokens += max(0, res.new_tokens - 1)
            self.decode_s += res.decode_s
            self.last_tau, self.last_tokens_per_s = res.tau, res.tokens_per_s

    def render(self, gen: Generator, worker: Worker) -> str:
        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + [f"{name}{labels} {value:g}"
                                                                         for labels, value in samples]

        with self.lock:
            reqs = sorted(self.requests.items())
            out = metric("d3d_info", "gauge", "The served model and decoding method.",
                         [(f'{{model="{gen.name}",method="{gen.method}"}}', 1)])
            out += metric("d3d_requests_total", "counter", "HTTP API requests by endpoint and status code.",
                          [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in reqs])
            out += metric("d3d_requests_cancelled_total", "counter",
                          "Requests dropped or stopped early because the client disconnected.", [("", self.cancelled)])
            out += metric("d3d_generations_total", "counter", "Completed generations.", [("", self.generations)])
            out += metric("d3d_prompt_tokens_total", "counter", "Prompt tokens of completed generations.",
                          [("", self.prompt_tokens)])
            out += metric("d3d_generated_tokens_total", "counter", "Tokens generated by completed generations.",
                          [("", self.generated_tokens)])
            out += metric("d3d_rounds_total", "counter", "Verification rounds (target forwards after the prefill).",
                          [("", self.rounds)])
            out += metric("d3d_decode_seconds_total", "counter", "Decode time (after the prefill) of completed "
                          "generations.", [("", self.decode_s)])
            out += metric("d3d_tau", "gauge", "Mean acceptance length (accepted drafts + 1 per round), all rounds.",
                          [("", self.round_tokens / self.rounds if self.rounds else 0.0)])
            out += metric("d3d_tokens_per_second", "gauge", "Decode throughput over all completed generations.",
                          [("", self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0)])
            out += metric("d3d_last_tau", "gauge", "Acceptance length of the last generation.", [("", self.last_tau)])
            out += metric("d3d_last_tokens_per_second", "gauge", "Decode throughput of the last generation.",
                          [("", self.last_tokens_per_s)])
        with worker.lock:
            out += metric("d3d_queue_waiting", "gauge", "Requests waiting for the generation worker.",
                          [("", worker.waiting)])
            out += metric("d3d_queue_capacity", "gauge", "Most requests that may wait (--max-queue).",
                          [("", worker.max_queue)])
            out += metric("d3d_generation_running", "gauge", "1 while a generation runs.", [("", worker.running)])
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(gen: Generator, max_queue: int = 16) -> FastAPI:
    metrics = Metrics()
    worker = Worker(gen, max_queue, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.stop()

    app = FastAPI(title="d3d", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
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
        return {"status": "ok", "model": gen.name, "method": gen.method, **busy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gen.name, "object": "model", "created": started,
                                            "owned_by": "d3d", "method": gen.method,
                                            "context_window": gen.context_window}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(gen, worker), media_type="text/plain; version=0.0.4")

    async def completion(request: Request, chat: bool):
        endpoint = request.url.path
        try:
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise bad(f"malformed JSON body: {e}") from None
            req = parse_request(body, gen, chat)
            job = Job(req, asyncio.get_running_loop())
            try:
                worker.submit(job)
            except QueueFull:
                raise ApiError(503, f"server busy: {worker.max_queue} requests are already waiting (--max-queue "
                                    f"{worker.max_queue}); retry later", code="queue_full",
                               type_="server_error") from None
        except ApiError as e:
            metrics.request(endpoint, e.status)
            return e.response()
        metrics.request(endpoint, 200)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(_stream(request, job, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _plain(request, job, rid, chat)

    async def _next_event(request: Request, job: Job):
        """The job's next event; None if the client disconnected meanwhile (the job is then cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    worker.cancel(job)
                    return None

    async def _plain(request: Request, job: Job, rid: str, chat: bool):
        try:
            while True:
                ev = await _next_event(request, job)
                if ev is None or ev[0] == "cancelled":
                    return JSONResponse({"error": {"message": "client disconnected", "type": "server_error",
                                                   "param": None, "code": "cancelled"}}, status_code=499)
                if ev[0] == "error":
                    return ev[1].response()
                if ev[0] == "done":
                    break
        finally:
            if job.state in ("queued", "running"):
                worker.cancel(job)
        res = ev[1]
        finish = FINISH.get(res.finish_reason, res.finish_reason)
        choice = {"index": 0, "logprobs": None, "finish_reason": finish}
        choice |= {"message": {"role": "assistant", "content": res.text}} if chat else {"text": res.text}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": gen.name, "choices": [choice], "usage": _usage(len(job.req.prompt_ids), res.new_tokens),
                "d3d": {"method": gen.method, "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 2),
                        "rounds": res.rounds, "acceptance_lengths": res.acceptance_lengths,
                        "finish_reason": res.finish_reason}}

    async def _stream(request: Request, job: Job, rid: str, chat: bool):
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": gen.name}

        def chunk(text: str | None, finish: str | None = None, role: bool = False, **extra) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return base | {"choices": [c]} | extra

        streamer = TextStreamer(gen.tokenizer, job.req.stop)
        ntok, rounds, round_tokens, t_first = 0, 0, 0, None
        try:
            if chat:
                yield _sse(chunk(None, role=True))
            while True:
                ev = await _next_event(request, job)
                if ev is None or ev[0] == "cancelled":
                    return
                if ev[0] == "error":
                    yield _sse({"error": {"message": ev[1].message, "type": ev[1].type, "param": None,
                                          "code": ev[1].code}})
                    break
                if ev[0] == "round":
                    _, ids, accepted, t = ev
                    ntok += len(ids)
                    if t_first is None:
                        t_first = t
                    else:
                        rounds, round_tokens = rounds + 1, round_tokens + accepted + 1
                    segments = [{"text": s, "draft": d} for s, d in ((streamer.push(ids[:accepted]), True),
                                                                      (streamer.push(ids[accepted:]), False)) if s]
                    info = {"accepted": accepted, "tokens": ids, "segments": segments, "new_tokens": ntok,
                            "rounds": rounds,
                            "tau": round(round_tokens / rounds, 4) if rounds else 1.0,
                            "tokens_per_s": round((ntok - 1) / (t - t_first), 2) if t > t_first else 0.0,
                            "prefill": rounds == 0}
                    yield _sse(chunk("".join(s["text"] for s in segments), d3d=info))
                    if await request.is_disconnected():
                        worker.cancel(job)
                        return
                    continue
                res = ev[1]  # done
                tail = streamer.push([], final=True)
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
          log_level: str = "info") -> None:
    import uvicorn

    app = create_app(gen, max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
