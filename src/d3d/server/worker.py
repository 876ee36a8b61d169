"""The generation worker of d3d serve: one thread, a bounded FIFO queue, cancellation and deadlines per round."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..api import Generator
from ..engine import GenerationResult, LogprobRecorder, StopChecker
from ..errors import D3DError
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
        """Queue `job`, or QueueFull when max_queue jobs already wait behind the running one. An idle
        worker's first queued job is about to run, not waiting behind one: without that, a burst of
        max_queue + 1 requests at an idle server got a 503 whenever the thread had not dequeued yet."""
        with self.lock:
            if self.waiting >= self.max_queue + (self.running == 0):
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
