"""`d3d serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around one Generator.

Endpoints: GET / (a web page showing drafting live), GET /health, GET /v1/models,
POST /v1/chat/completions, POST /v1/completions (plain JSON or server-sent events), GET /metrics
(Prometheus text format).

Security (the Guard middleware, before any endpoint runs): with an API key every path but /health needs
`Authorization: Bearer KEY` (or HTTP Basic with KEY as the password, for the web page); a request with
an `Origin` header must come from the server's own origin (or one given with --allow-origin); a POST
must be `Content-Type: application/json`. Bodies are read in pieces and refused (413) past 4 MB.

Concurrency: one model, one generation worker thread, a bounded FIFO queue in front of it. A request
that finds `max_queue` requests already waiting behind the running one gets 503. Each request has a
task that waits for the client's disconnect (streaming or not): the request is then dropped from the
queue, or its generation stopped at the next round (the engine's on_round callback raises), so its
slot frees at once. With a request timeout, a request still queued at its deadline gets 504 and a
running one is cut at the next round (finish_reason "length", d3d.finish_reason "timeout").
Tokenisation runs in a helper thread, text decoding and stop handling in the worker thread, so the
event loop never does work that grows with a request's size.

Streamed chunks carry, besides the OpenAI fields, a `d3d` object per round: `accepted` (draft tokens
accepted in the round), `tokens` (the round's token ids), `segments` (the round's text split into
`{"text", "draft": bool}` pieces: accepted drafts vs the target's own token), running `tau` and
`tokens_per_s`, and with d3d-tree `branch` (the proposer(s) of the accepted path: d3d, alt, ngram,
joined by + when they agree). The web page uses it; OpenAI clients ignore it.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import json
import logging
import queue
import threading
import time
import uuid
from base64 import b64decode
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import Generator, check_messages
from .engine import GenerationResult, LogprobRecorder, StopChecker, TokenLogprob
from .errors import D3DError
from .verify import SamplingParams

log = logging.getLogger("d3d.server")
STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_TOKENS = 512
MAX_BODY_BYTES = 4 << 20
MAX_STOP = 16
MAX_STOP_CHARS = 64  # the engine looks for stops in the last 32 tokens' text
MAX_TOP_LOGPROBS = 20
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length"}
API_PATHS = ("/v1/chat/completions", "/v1/completions")
# OpenAI parameters this server does not implement, with the values that mean "not used"
UNSUPPORTED = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
               "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
               "function_call": ("none",), "best_of": (1,), "echo": (False,), "suffix": ("",)}


class ApiError(Exception):
    """An error answered as an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or ({"Retry-After": "1"} if status == 503 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
    chat: bool = True
    logprobs: int | None = None  # None: off; N: the chosen token's logprob and the N most likely


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
        raise bad(f"'{key}' must be an integer (got {json.dumps(v)[:40]})", key)
    return v


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def decode_body(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"malformed JSON body: {_first_line(e)}") from None


def check_unsupported(body: dict) -> None:
    for key, unused in UNSUPPORTED.items():
        if body.get(key) is not None and body[key] not in unused:
            raise bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """The number of top logprobs asked for (0 = only the chosen token's), or None when not asked."""
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise bad("'logprobs' must be a boolean", "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        key, n = "top_logprobs", (top or 0) if want else None
    else:
        key, n = "logprobs", _int(body, "logprobs")
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad(f"'{key}' must be in [0, {MAX_TOP_LOGPROBS}] (got {n})", key)
    return n


def parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    try:
        "".join(stop).encode()
    except UnicodeEncodeError:
        raise bad("'stop' is not valid Unicode (lone surrogate)", "stop") from None
    return stop


def encode_prompt(body: dict, gen: Generator, chat: bool) -> list[int]:
    """The prompt's token ids; every problem (tokenizer errors included) is an ApiError(400)."""
    param = "messages" if chat else "prompt"
    if chat:
        if "messages" not in body:
            raise bad("'messages' is required", "messages")
        try:
            prompt = check_messages(body["messages"])
        except D3DError as e:
            raise bad(str(e), "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = min(len(gen.tokenizer), gen.model.args.vocab_size)
            if not all(0 <= t < vocab for t in prompt):
                raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
            return list(prompt)
        if prompt is None:
            raise bad("'prompt' is required", "prompt")
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string (or a list of one string, or a list of token ids)", "prompt")
        if not prompt.strip():
            raise bad("empty prompt", "prompt")
    try:
        "".join(m["content"] for m in prompt).encode() if chat else prompt.encode()
    except UnicodeEncodeError:
        raise bad(f"'{param}' is not valid Unicode (lone surrogate)", param) from None
    try:
        return gen.encode(prompt, raw=not chat)
    except D3DError as e:
        raise bad(str(e), param) from None
    except Exception as e:  # the tokenizer's own errors, e.g. a lone surrogate in a string
        raise bad(f"cannot tokenize '{param}': {_first_line(e)}", param) from None


def accepts_logprobs(runner) -> bool:
    """Whether a method's runner takes the engines' `logprobs=` recorder."""
    try:
        params = inspect.signature(runner).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "logprobs" or p.kind is p.VAR_KEYWORD for p in params)


def parse_request(body, gen: Generator, chat: bool) -> GenRequest:
    """Validate an OpenAI-style request body; every problem is an ApiError(400)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("'model' must be a string", "model")
    check_unsupported(body)
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    logprobs = parse_logprobs(body, chat)
    if logprobs is not None and not accepts_logprobs(gen.runner):
        raise bad(f"logprobs are not available with method {gen.method}", "logprobs")
    stop = parse_stop(body)
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k") or 0
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0 (got {top_k})", "top_k")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=_int(body, "seed"))
    except D3DError as e:
        raise bad(str(e), "seed" if "seed" in str(e) else None) from None
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key)
    if max_tokens is not None and max_tokens <= 0:
        raise bad(f"'{key}' must be > 0 (got {max_tokens})", key)

    prompt_ids = encode_prompt(body, gen, chat)
    if not prompt_ids:
        raise bad("empty prompt", "messages" if chat else "prompt")
    room = gen.context_window - len(prompt_ids) - gen.block_size
    if room <= 0:
        raise bad(f"prompt too long: {len(prompt_ids)} tokens leave no room in the context window "
                  f"({gen.context_window} tokens)", "messages" if chat else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    try:
        gen.check(prompt_ids, max_tokens)
    except D3DError as e:
        raise bad(f"'{key}' too large: {e}", key, "context_length_exceeded") from None
    return GenRequest(prompt_ids, params, max_tokens, stop, stream, bool(opts.get("include_usage", False)), chat,
                      logprobs)


# ---------------------------------------------------------------------------------------------
# Incremental text


def _prefix_function(s: str) -> list[int]:
    """KMP: pi[i] = length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


def _overlap(text: str, s: str, pi: list[int]) -> int:
    """The longest k < len(s) such that text ends with s[:k], in O(len(s))."""
    k = 0
    for c in text[len(text) - len(s) + 1:] if len(s) > 1 else "":
        while k and c != s[k]:
            k = pi[k - 1]
        if c == s[k]:
            k += 1
    return k


class TextStreamer:
    """Turns rounds of token ids into text deltas whose concatenation is exactly the final text: EOS
    dropped, cut before the first stop string; text that might still become a stop string, or is an
    incomplete UTF-8 character, is held back until it is certain. Each push costs O(new tokens + total
    stop length): tokens are decoded in a small sliding window and stops searched only in new text."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.pi = [_prefix_function(s) for s in stop]
        self.longest = max(map(len, stop), default=1)
        self.eos = {tokenizer.eos_token_id}
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to the last piece already in self.text
        self.text = ""  # decoded so far (up to the stop, if one was found)
        self.emitted = 0
        self.cut = False

    def _decode_new(self, final: bool) -> str:
        head = self.tokenizer.decode(self.ids[self.prefix:self.read])
        whole = self.tokenizer.decode(self.ids[self.prefix:])
        if len(whole) <= len(head) or (whole.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return whole[len(head):]

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.cut:
            return ""
        self.ids += [t for t in ids if t not in self.eos]
        start = max(0, len(self.text) - self.longest + 1)
        self.text += self._decode_new(final)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.cut = self.text[:min(hits)], True
        end = len(self.text)
        if not (final or self.cut):
            end -= max((_overlap(self.text, s, pi) for s, pi in zip(self.stop, self.pi)), default=0)
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted += len(delta)
        return delta


class LogprobFormatter:
    """OpenAI `logprobs` objects from TokenLogprob entries: chat ({"content": [...]}) or legacy
    completions ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}). EOS is left out."""

    def __init__(self, tokenizer, chat: bool, top: int):
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.eos = tokenizer.eos_token_id
        self.pieces: dict[int, str] = {}
        self.offset = 0

    def piece(self, token: int) -> str:
        if token not in self.pieces:
            self.pieces[token] = self.tokenizer.decode([token])
        return self.pieces[token]

    def _entry(self, token: int, logprob: float) -> dict:
        p = self.piece(token)
        return {"token": p, "logprob": logprob, "bytes": list(p.encode("utf-8", "replace"))}

    def format(self, entries: list[TokenLogprob]) -> dict:
        entries = [e for e in entries if e.token != self.eos]
        if self.chat:
            return {"content": [self._entry(e.token, e.logprob) | {"top_logprobs": [self._entry(*t) for t in e.top]}
                                for e in entries], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if self.top else None, "text_offset": []}
        for e in entries:
            out["tokens"].append(self.piece(e.token))
            out["token_logprobs"].append(e.logprob)
            out["text_offset"].append(self.offset)
            self.offset += len(self.piece(e.token))
            if self.top:
                out["top_logprobs"].append({self.piece(t): lp for t, lp in e.top})
        return out


# ---------------------------------------------------------------------------------------------
# The generation worker


class Cancelled(Exception):
    """Raised from on_round to stop a generation whose client went away."""


class DeadlineReached(Exception):
    """Raised from on_round to cut a generation at its request's deadline."""


@dataclass
class Job:
    req: GenRequest
    loop: asyncio.AbstractEventLoop
    deadline: float | None = None  # time.monotonic()
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued -> running -> done | cancelled; queued -> expired

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancel_flag.set()


class QueueFull(Exception):
    pass


@dataclass
class Progress:
    """What a generation has produced so far, as its rounds report it (for a cut, partial answer)."""

    ids: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    t_first: float | None = None

    def add(self, chunk: list[int], accepted: int) -> None:
        self.ids += chunk
        self.accepted.append(accepted)
        self.t_first = self.t_first or time.perf_counter()

    def result(self, req: GenRequest, tokenizer, logprobs: LogprobRecorder | None) -> GenerationResult:
        t1 = self.t_first or time.perf_counter()
        return GenerationResult(list(req.prompt_ids), list(self.ids), [a + 1 for a in self.accepted[1:]],
                                t1 - self.t0, time.perf_counter() - t1, "timeout",
                                StopChecker(tokenizer, {tokenizer.eos_token_id}, 1, req.stop).final_text(self.ids),
                                None if logprobs is None else logprobs.entries)


class Worker:
    """One thread that runs generations one after the other, FIFO, with at most `max_queue` waiting."""

    def __init__(self, gen: Generator, max_queue: int, metrics: "Metrics"):
        if max_queue < 1:
            raise D3DError(f"max_queue must be >= 1 (got {max_queue})")
        self.gen, self.max_queue, self.metrics = gen, max_queue, metrics
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.thread = threading.Thread(target=self._loop, name="d3d-generation", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

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
                self.metrics.count("cancelled")

    def expire(self, job: Job) -> bool:
        """Drop a job still queued at its deadline (True); a running one stops at its next round (False)."""
        with self.lock:
            if job.state != "queued":
                return False
            job.state = "expired"
            self.waiting -= 1
            self.metrics.count("timeouts")
            return True

    def stop(self) -> None:
        self.queue.put(None)

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            with self.lock:
                if job.state != "queued":
                    continue
                job.state, self.waiting, self.running = "running", self.waiting - 1, 1
            try:
                event = self._run(job)
            except Exception as e:  # a bug outside the generation itself: answer, log, keep serving
                log.exception("job failed")
                job.state, event = "done", ("error", ApiError(500, f"internal error: {type(e).__name__}"))
            with self.lock:
                self.running = 0
            job.emit(*event)  # after the bookkeeping: a client that has its answer sees an idle worker

    def _run(self, job: Job) -> tuple:
        r, tok = job.req, self.gen.tokenizer
        recorder = None if r.logprobs is None else LogprobRecorder(r.logprobs)
        fmt = None if recorder is None else LogprobFormatter(tok, r.chat, r.logprobs)
        streamer = TextStreamer(tok, r.stop) if r.stream else None
        progress = Progress()

        def on_round(chunk: list[int], accepted: int, branch: str | None = None) -> None:
            if job.cancel_flag.is_set():
                raise Cancelled
            progress.add(chunk, accepted)
            if streamer is not None:
                segments = [(streamer.push(chunk[:accepted]), True), (streamer.push(chunk[accepted:]), False)]
                lps = None if fmt is None else fmt.format(recorder.entries[len(progress.ids) - len(chunk):])
                job.emit("round", list(chunk), accepted, time.perf_counter(), segments, lps, branch)
            if job.deadline is not None and time.monotonic() >= job.deadline:
                raise DeadlineReached

        try:
            res = self.gen.run(r.prompt_ids, r.params, r.max_tokens, r.stop, on_round=on_round, logprobs=recorder)
        except Cancelled:
            job.state = "cancelled"
            self.metrics.count("cancelled")
            return ("cancelled",)
        except DeadlineReached:
            self.metrics.count("timeouts")
            res = progress.result(r, tok, recorder)
        except D3DError as e:
            job.state = "done"
            return "error", bad(str(e))
        except Exception as e:  # never seen; reported as a 500 body, and the worker keeps going
            log.exception("generation failed")
            job.state = "done"
            return "error", ApiError(500, f"generation failed: {type(e).__name__}: {_first_line(e)}")
        job.state = "done"
        self.metrics.generation(len(r.prompt_ids), res)
        tail = streamer.push([], final=True) if streamer is not None else ""
        lps = None if fmt is None or streamer is not None else fmt.format(res.logprobs)
        return "done", res, tail, lps


# ---------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.cancelled = 0
        self.timeouts = 0
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

    def count(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

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
            out += metric("d3d_requests_timed_out_total", "counter",
                          "Requests dropped (504) or cut short at their --request-timeout deadline.",
                          [("", self.timeouts)])
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
        out += metric("d3d_worker_alive", "gauge", "1 while the generation worker thread runs.",
                      [("", int(worker.alive))])
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Security: API key, Origin, Content-Type


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


class Guard:
    """ASGI middleware that refuses, before any endpoint runs: a missing or wrong API key (401), a
    browser request from another origin (403; preflights from --allow-origin origins get CORS headers),
    a POST that is not application/json (415)."""

    def __init__(self, app, metrics: Metrics, api_key: str | None, allow_origins: list[str], bind_host: str):
        self.app, self.metrics, self.api_key = app, metrics, api_key
        self.allow_origins, self.bind_host = set(allow_origins), bind_host

    def own_origins(self, scope, headers: Headers) -> set[str]:
        """The origins the built-in page has when loaded from this server: its own host names at its port,
        or (when listening on every interface) the Host the browser used."""
        if _is_wildcard(self.bind_host):
            return {f"http://{headers.get('host', '')}"}
        port = (scope.get("server") or ("", 80))[1]
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        names = {host} | (set(LOOPBACK_NAMES) if _is_loopback(self.bind_host) else set())
        return {f"http://{n}:{port}" for n in names} | ({f"http://{n}" for n in names} if port == 80 else set())

    def allowed(self, origin: str) -> bool:
        return "*" in self.allow_origins or origin in self.allow_origins

    def authorized(self, headers: Headers) -> bool:
        scheme, _, cred = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                cred = b64decode(cred, validate=True).decode().partition(":")[2]
            except ValueError:
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(cred.strip().encode(), self.api_key.encode())

    def check(self, scope, headers: Headers) -> ApiError | None:
        path, method = scope["path"], scope["method"]
        origin = headers.get("origin")
        if origin is not None and origin not in self.own_origins(scope, headers) and not self.allowed(origin):
            return ApiError(403, f"cross-origin request from {origin} refused (see --allow-origin)",
                            code="origin_not_allowed", type_="permission_error")
        if self.api_key and path != "/health" and not self.authorized(headers):
            challenge = 'Basic realm="d3d"' if path == "/" else "Bearer"
            return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                            code="invalid_api_key", type_="authentication_error",
                            headers={"WWW-Authenticate": challenge})
        if method == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return ApiError(415, f"Content-Type must be application/json (got {kind or 'none'})",
                                code="unsupported_media_type")
        return None

    def preflight(self, origin: str) -> Response:
        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": "GET, POST",
            "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600",
            "Vary": "Origin"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        cors = origin is not None and self.allowed(origin)
        if scope["method"] == "OPTIONS" and cors:
            return await self.preflight(origin)(scope, receive, send)
        err = self.check(scope, headers)
        if err is not None:
            if scope["path"] in API_PATHS:
                self.metrics.request(scope["path"], err.status)
            return await err.response()(scope, receive, send)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": list(message.get("headers", [])) + [
                    (b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]}
            await send(message)

        await self.app(scope, receive, send_cors)


# ---------------------------------------------------------------------------------------------
# The app


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
                    if branch is not None:  # d3d-tree: which proposer's branch the accepted path came from
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
