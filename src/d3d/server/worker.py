"""The generation worker of d3d serve: a bounded FIFO queue served by one thread, or, with --max-batch N and a
method that batches (Method.batches), by N threads ("lanes") whose generations share each target forward
through the scheduler (d3d.scheduler: continuous batching; a request starts at the next forward). Cancellation
and deadlines per round and, while a long prompt is processed, per prefill chunk (ChunkedPrefill on d3d's
target, the batch slots' own chunks in a batch; the methods on a runtime of their own check between prompt
slices: Method.own_prefill)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..api import Generator
from ..decoding.engine import PREFILL_CHUNK, GenerationResult, LogprobRecorder, StopChecker
from ..errors import D3DError
from .events import Done, Event, Failed, Round, Stopped
from .metrics import Metrics
from .requests import ApiError, GenRequest, _first_line, bad
from .streaming import LogprobFormatter, TextStreamer


log = logging.getLogger("d3d.server")


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

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancel_flag.set()


class QueueFull(Exception):
    pass




class ChunkedPrefill:
    """While a server job runs, the target's forward over a prompt longer than `chunk` tokens (one
    sequence, its KV cache set up, no mask or positions given: the engines' prefill) runs as forwards of
    `chunk` tokens that extend the cache one after the other, with `check()` (the job's cancel flag and
    deadline) called before each: a client that leaves or a deadline frees the worker within one chunk,
    at any prompt length. Every other forward (decoding rounds, tree verification) goes through
    unchanged. The engines are not touched: the chunked forward is installed on the target instance for
    the job's duration (`active`) and removed afterwards."""

    def __init__(self, model, chunk: int = PREFILL_CHUNK):
        if chunk < 1:
            raise D3DError(f"prefill chunk must be >= 1 token (got {chunk})")
        self.model, self.chunk = model, chunk
        self.chunks = 0  # chunk forwards run so far (tests count them)

    @staticmethod
    def supports(model) -> bool:
        return isinstance(model, torch.nn.Module) and all(hasattr(model, a) for a in ("cache_len", "cache_size",
                                                                                         "layers", "setup_cache"))

    def _cached(self, T: int) -> bool:
        m = self.model
        layers = getattr(m, "layers", None)
        return bool(layers) and getattr(layers[0].attention, "k_cache", None) is not None \
            and m.cache_len + T <= m.cache_size

    @contextmanager
    def active(self, check):
        """Install the chunked forward on the target while the body runs; `check()` raises to stop."""
        if not self.supports(self.model):
            yield
            return
        m, owner = self.model, threading.get_ident()
        saved = m.__dict__.get("forward")
        inner = saved or m.forward

        def forward(tokens, mask=None, positions=None, last_only=False, hidden_layers=None, logits_to_keep=0):
            T = tokens.shape[-1]
            if threading.get_ident() != owner or tokens.dim() != 2 or tokens.shape[0] != 1 or T <= self.chunk \
                    or mask is not None or positions is not None or not self._cached(T):
                return inner(tokens, mask, positions, last_only, hidden_layers, logits_to_keep)
            return self._chunked(inner, check, tokens, last_only, hidden_layers, logits_to_keep)

        m.forward = forward
        try:
            yield
        finally:
            if saved is None:
                del m.forward
            else:
                m.forward = saved

    def _chunked(self, inner, check, tokens, last_only, hidden_layers, logits_to_keep):
        T, logits, taps = tokens.shape[1], [], None
        for a in range(0, T, self.chunk):
            check()
            part = tokens[:, a:a + self.chunk]
            out = inner(part, None, None, last_only, hidden_layers, 0)
            self.chunks += 1
            if hidden_layers is not None:
                out, t = out
                taps = [prev + [x] for prev, x in zip(taps or [[] for _ in t], t)]
            if last_only:
                logits = [out]  # only the last chunk's last row is asked for
            else:
                logits.append(out)
        out = logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)
        if not last_only and logits_to_keep:
            out = out[:, -logits_to_keep:]
        if hidden_layers is None:
            return out
        return out, [torch.cat(parts, dim=1) for parts in (taps or [])]


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
    """Threads that run generations, FIFO, with at most `max_queue` waiting: one, or `max_batch` lanes on a
    Scheduler when the method batches (else one, and `batch_note` says why)."""

    def __init__(self, gen: Generator, max_queue: int, metrics: "Metrics", prefill_chunk: int | None = PREFILL_CHUNK,
                 max_batch: int = 1):
        if max_queue < 1:
            raise D3DError(f"max_queue must be >= 1 (got {max_queue})")
        if max_batch < 1:
            raise D3DError(f"max_batch must be >= 1 (got {max_batch})")
        self.gen, self.max_queue, self.metrics = gen, max_queue, metrics
        self.prefill = ChunkedPrefill(gen.model, prefill_chunk or PREFILL_CHUNK)
        self.scheduler, self.batch_note, lanes = None, "", [gen]
        if max_batch > 1:
            if not gen.batches:
                self.batch_note = f"method {gen.method} does not run batched: one request at a time"
            elif not ChunkedPrefill.supports(gen.model):
                self.batch_note = "this target's runtime does not run batched: one request at a time"
            else:
                from ..scheduler import Scheduler

                self.scheduler = Scheduler(gen.model, max_batch, prefill_chunk=prefill_chunk)
                lanes = gen.on_slots([self.scheduler.acquire() for _ in range(max_batch)])
        self.lanes = lanes
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.threads = [threading.Thread(target=self._loop, args=(lane,), name=f"d3d-generation-{i}", daemon=True)
                        for i, lane in enumerate(lanes)]
        for t in self.threads:
            t.start()

    @property
    def max_batch(self) -> int:
        return len(self.lanes)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads) and (self.scheduler is None or self.scheduler.thread.is_alive())

    def submit(self, job: Job) -> None:
        """Queue `job`, or QueueFull when max_queue jobs already wait behind the running ones. A job that an
        idle lane is about to take is not waiting behind one: without that, a burst of max_queue + 1
        requests at an idle server got a 503 whenever the thread had not dequeued yet."""
        with self.lock:
            if self.waiting >= self.max_queue + max(0, len(self.lanes) - self.running):
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
        for _ in self.threads:
            self.queue.put(None)
        if self.scheduler is not None:
            self.scheduler.stop()

    def _loop(self, lane: Generator) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            with self.lock:
                if job.state != "queued":
                    continue
                job.state, self.waiting, self.running = "running", self.waiting - 1, self.running + 1
            try:
                event = self._run(job, lane)
            except Exception as e:  # a bug outside the generation itself: answer, log, keep serving
                log.exception("job failed")
                job.state, event = "done", Failed(ApiError(500, f"internal error: {type(e).__name__}"))
            finally:
                if self.scheduler is not None:
                    self.scheduler.leave(lane.model.slot)
            with self.lock:
                self.running -= 1
            job.emit(event)  # after the bookkeeping: a client that has its answer sees an idle worker

    @contextmanager
    def _prefill_checked(self, lane: Generator, check):
        """Between prompt chunks, `check()`: a batch slot's own chunks, else ChunkedPrefill on the target."""
        if self.scheduler is None:
            with self.prefill.active(check):
                yield
            return
        lane.model.check = check
        try:
            yield
        finally:
            lane.model.check = None

    def _run(self, job: Job, lane: Generator) -> Event:
        r, tok = job.req, lane.tokenizer
        recorder = None if r.logprobs is None else LogprobRecorder(r.logprobs)
        fmt = None if recorder is None else LogprobFormatter(tok, r.chat, r.logprobs)
        streamer = TextStreamer(tok, r.stop) if r.stream else None
        progress = Progress()

        def check() -> None:
            if job.cancel_flag.is_set():
                raise Cancelled
            if job.deadline is not None and time.monotonic() >= job.deadline:
                raise DeadlineReached

        branch: list[str | None] = [None]  # the tree methods' accepted branch of the round (on_branch)

        def on_round(chunk: list[int], accepted: int) -> None:
            if job.cancel_flag.is_set():
                raise Cancelled
            progress.add(chunk, accepted)
            if streamer is not None:
                segments = [(streamer.push(chunk[:accepted]), True), (streamer.push(chunk[accepted:]), False)]
                lps = None if fmt is None else fmt.format(recorder.entries[len(progress.ids) - len(chunk):])
                job.emit(Round(list(chunk), accepted, time.perf_counter(), segments, lps, branch[0]))
            branch[0] = None
            if job.deadline is not None and time.monotonic() >= job.deadline:
                raise DeadlineReached

        try:
            with self._prefill_checked(lane, check):
                res = lane.run(r.prompt_ids, r.params, r.max_tokens, r.stop, on_round=on_round,
                                   logprobs=recorder, on_branch=lambda b: branch.__setitem__(0, b),
                                   prefill_check=check)
        except Cancelled:
            job.state = "cancelled"
            self.metrics.count("cancelled")
            return Stopped("cancelled")
        except DeadlineReached:
            self.metrics.count("timeouts")
            if not progress.ids:  # cut while the prompt was processed: no answer to give
                job.state = "done"
                return Failed(ApiError(504, f"request timed out while its prompt of {len(r.prompt_ids)} tokens "
                                            "was processed", code="timeout", type_="server_error"))
            res = progress.result(r, tok, recorder)
        except D3DError as e:
            job.state = "done"
            return Failed(bad(str(e)))
        except Exception as e:  # never seen; reported as a 500 body, and the worker keeps going
            log.exception("generation failed")
            job.state = "done"
            return Failed(ApiError(500, f"generation failed: {type(e).__name__}: {_first_line(e)}"))
        job.state = "done"
        self.metrics.generation(len(r.prompt_ids), res)
        tail = streamer.push([], final=True) if streamer is not None else ""
        lps = None if fmt is None or streamer is not None else fmt.format(res.logprobs)
        return Done(res, tail, lps, getattr(lane.model, "reused", 0))


# ---------------------------------------------------------------------------------------------
# Metrics
