"""Continuous batching: many generations share each target forward.

Every running generation has a cache slot of a BatchedTarget (d3d.runtime.batch) and runs the unchanged
decoding engines in a thread of its own, on a `SlotModel`: a target whose forward hands its tokens to the
scheduler and waits. The scheduler's thread waits until every running generation has handed in its next
forward (their Python work, proposing and verifying, is serial anyway), runs them all as one batched forward
and hands each its logits. Generations join (`acquire`) and leave (`release`) between forwards, so a new
request starts at the next forward, not after the others finish.

Long prompts are fed in chunks of about `prefill_chunk` tokens, one chunk per forward (a prompt of at most
`short_prompt` tokens, a question, whole), so the running generations keep decoding beside a prompt being read;
a check between chunks (cancellation, deadline) stops a prompt within one chunk. A fitted chunk shrinks as the
prompt's cached part grows, so that its forward takes no longer deep in a long prompt than at its start: each row
attends to every cached position, and after 3,500 tokens a 128-row chunk of SmolLM2 took 975 ms against 237 ms
at the start (measured: `attention_s`, seconds per row and cached position).

Prompt prefix reuse (llama.cpp's server keeps a slot's last prompt the same way; vLLM and SGLang share prefixes
across requests): a slot's KV cache outlives its generation, and the scheduler keeps the tokens whose K/V it holds
at positions 0, 1, ... (`held`: prompts and tokens fed in order; a tree's rows, a rollback or a move cut it
there). A new prompt on the slot feeds only what follows its longest common prefix with them (the chat
template's system turn, an earlier turn of the same conversation), at least its last token. Rows are computed
independently of the rows beside them, so reused K/V are the bits a fresh prefill writes and the output is
unchanged.

Load-aware speculation: each generation's last decoding forward width and the tokens it committed with it are
kept (`load`; a prompt chunk counts as a one-token step: its rows are work the batch does whatever the others
draft, and it decodes soon), so a method choosing how many tokens to verify (the tree methods' WidthCost) can
weigh its round against the whole batch: the width that maximises the batch's committed tokens per second of the
batch's forward, given what the other generations feed. At one generation that is the single-stream choice;
under load extra width costs what it adds to everyone's forward, and a draft that does not pay shrinks to nothing.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from .errors import D3DError
from .runtime.batch import BatchedTarget, Segment

PREFILL_SECONDS = 0.25  # a prompt chunk adds at most about this much to a forward (from the width cost curve)
SHORT_PROMPT = 64       # a prompt of at most this many tokens (a question) goes in one forward, whatever the chunk
IDLE_CHUNKS = 2         # prompt chunks a forward may take while no generation is decoding (Scheduler.prompt_budget)
STRAGGLER_S = 1.0       # a forward waits at most this long for a generation that has not handed in its next one


def piece_end(a: int, T: int, chunk: int, whole: int = 0) -> int:
    """Where the piece of a T-token prompt that starts at token `a` ends: the whole prompt if T <= `whole` (a
    question: its time to first token is then one forward, not two or three), else `chunk` tokens on, or the
    prompt's end where less than another chunk would be left (35 tokens at chunks of 32 are one forward, not two,
    the second of 3 tokens: a forward has a fixed cost, the weights' reading, that 3 tokens pay as much as 32)."""
    return T if T <= whole or T - a < 2 * chunk else a + chunk


@dataclass
class Work:
    segment: Segment
    rest: int = 0  # a prompt chunk: the prompt's tokens still to feed, this chunk's included (0: a decoding round)
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class SlotModel:
    """One generation's view of the batched target: the interface the decoding engines use (setup_cache,
    forward, rollback, move_cache_rows, cache_len), every other attribute the target's own."""

    def __init__(self, scheduler: "Scheduler", slot: int):
        self.scheduler, self.slot, self.base_model = scheduler, slot, scheduler.model
        self.cache_len, self.cache_size = 0, scheduler.batch.max_len
        self.check = None  # called before each prompt chunk: raises to stop (set by the server per request)
        self.width, self.gain, self.start = 0, 0, 0  # the last forward: its width and the tokens it committed
        self.joined = False  # handed in a forward: from then on every forward waits for this generation's next
        self.held = scheduler.held[slot]  # the tokens whose K/V the slot holds at positions 0.. (see the module doc)
        self.reused = 0  # prompt tokens of this generation not fed: their K/V were held

    def __getattr__(self, name):
        return getattr(self.base_model, name)

    def setup_cache(self, max_batch: int = 1, max_len: int | None = None) -> None:
        if max_batch != 1:
            raise D3DError("a batch slot holds one sequence")
        if max_len is not None and max_len > self.cache_size:
            raise D3DError(f"sequence of {max_len} tokens exceeds the batch's KV cache ({self.cache_size})")
        self.cache_len = self.reused = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.cache_len})")
        self.cache_len = length
        self.gain = max(0, length - self.start)
        del self.held[length:]

    def move_cache_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if dst.numel():
            del self.held[int(dst.min()):]
        self.scheduler.batch.move_rows(self.slot, src, dst)

    def batch_load(self) -> tuple[int, float]:
        """(width, committed tokens) of the other generations' last forwards."""
        return self.scheduler.load(self.slot)

    def __call__(self, tokens, mask=None, positions=None, last_only=False, hidden_layers=None, logits_to_keep=0):
        return self.forward(tokens, mask, positions, last_only, hidden_layers, logits_to_keep)

    def forward(self, tokens: torch.Tensor, mask=None, positions=None, last_only=False, hidden_layers=None,
                logits_to_keep=0) -> torch.Tensor:
        if hidden_layers is not None:
            raise D3DError("methods that read the target's hidden states do not run batched")
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise D3DError("a batch slot runs one sequence [1, T]")
        T, keep = tokens.shape[1], 1 if last_only else logits_to_keep
        linear = mask is None and positions is None
        a = self._reuse(tokens[0], keep) if linear and keep and not self.cache_len else 0
        if linear and T - a > self.scheduler.prefill_chunk:  # a prompt: piece by piece
            out = []
            while a < T:
                if self.check is not None:
                    self.check()
                b = piece_end(a, T, self.scheduler.prompt_budget(self.slot, a), self.scheduler.short_prompt)
                out.append(self._run(tokens[0, a:b], None, None, (keep if b == T else 1) if keep else 0, rest=T - a))
                a = b
            return (out[-1] if keep else torch.cat(out))[None]
        if positions is not None:
            positions = positions.reshape(T)
        return self._run(tokens[0, a:], mask, positions, keep, rest=T - a if a else 0)[None]

    def _reuse(self, prompt: torch.Tensor, keep: int) -> int:
        """Start a prompt after its longest common prefix with the slot's held tokens (keeping at least the
        `keep` rows whose logits are asked for): the tokens reused."""
        held = torch.tensor(self.held[:prompt.shape[0] - keep], dtype=prompt.dtype, device=prompt.device)
        differ = (held != prompt[:held.shape[0]]).nonzero()
        n = int(differ[0]) if differ.numel() else held.shape[0]
        del self.held[n:]
        self.cache_len = self.reused = n
        with self.scheduler.cond:
            self.scheduler.reused += n
        return n

    def _run(self, tokens: torch.Tensor, mask, positions, keep: int, rest: int = 0) -> torch.Tensor:
        T, start = tokens.shape[0], self.cache_len
        if start + T > self.cache_size:
            raise D3DError(f"sequence of {start + T} tokens exceeds the KV cache ({self.cache_size})")
        del self.held[start:]  # rows written from `start` on: the held tokens end there, or go on with these
        if positions is None and mask is None:
            self.held.extend(tokens.tolist())
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        if mask is not None:
            mask = mask.reshape(T, start + T).to(torch.bool)
        prompt = keep and T > 1
        try:
            logits = self.scheduler.submit(Segment(self.slot, tokens, start, positions, mask, min(keep, T)),
                                           rest or (T if prompt else 0))
        except BaseException:
            del self.held[start:]
            raise
        self.cache_len, self.start = start + T, start
        # the load others weigh a round against (Scheduler.load): a prompt chunk counts as a one-token step there
        self.width = 0 if prompt else T
        self.gain = 0 if prompt else (min(T, keep) if keep else T)  # a verification: what rollback keeps
        return logits


class Scheduler:
    """Runs the forwards of up to `max_batch` generations together (see the module doc). `acquire()` gives a
    generation its SlotModel (None when all slots are taken), `release(slot)` frees it."""

    def __init__(self, model, max_batch: int, max_len: int | None = None, prefill_chunk: int | None = None,
                 short_prompt: int = SHORT_PROMPT, idle_chunks: int = IDLE_CHUNKS):
        from .decoding.treecost import WidthCost, measured_curve

        self.model = model
        self.curve = measured_curve(model)  # on the target alone, before any slot: the slots' methods share it
        self.cost = WidthCost(self.curve) if self.curve else None
        self.batch = BatchedTarget(model, max_batch, max_len)
        self.prefill_chunk = prefill_chunk or self._fitted_chunk()
        self.attention_s = 0.0 if prefill_chunk else self._attention_seconds()
        self.short_prompt, self.idle_chunks = short_prompt, idle_chunks
        if self.prefill_chunk < 1:
            raise D3DError(f"prefill chunk must be >= 1 token (got {self.prefill_chunk})")
        self.cond = threading.Condition()
        self.free = list(range(max_batch))
        self.slots: dict[int, SlotModel] = {}
        self.pending: dict[int, Work] = {}
        self.forwards = 0          # batched forwards run
        self.last_rows = 0         # rows of the last forward
        self.last_batch = 0        # generations in it
        self.last_drafts = 0       # tokens verified beyond each generation's pending one (its draft budget in use)
        self.rows = 0              # rows fed in all
        self.reused = 0            # prompt tokens not fed: their K/V were already in the slot (see the module doc)
        self.held: list[list[int]] = [[] for _ in range(max_batch)]
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="d3d-scheduler", daemon=True)
        self.thread.start()

    @property
    def max_batch(self) -> int:
        return self.batch.slots

    def _fitted_chunk(self) -> int:
        """The widest prompt chunk (a multiple of 16, at most 256) that adds at most PREFILL_SECONDS to a
        one-token forward (measured width cost curve, linear beyond its widest point): what a chunk delays the
        running generations' round by. Where a forward's fixed cost alone is near PREFILL_SECONDS (an fp32
        1.5B target reads 7 GB of weights a forward) a chunk's own cost would leave it 16 tokens, and a short
        prompt three forwards."""
        if self.cost is None:
            return 256
        return max([16] + [w for w in range(16, 257, 16) if self.cost(w) - self.cost(1) <= PREFILL_SECONDS])

    def _attention_seconds(self, width: int = 16, context: int = 2048) -> float:
        """Seconds a forward's row spends per cached position it attends to: a `width`-row forward after
        `context` cached positions against one after none, fastest of three each, on slot 0 (whatever its cache
        holds: the cost does not depend on it). Measured once per model, thread count and context, as the width
        cost curve is (a few seconds on the fp32 pair; `d3d bench --clients` starts a scheduler per level)."""
        context = min(context, self.batch.max_len - width)
        if context < 256:
            return 0.0
        key = (torch.get_num_threads(), width, context)
        cached = getattr(self.model, "_d3d_attention_s", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        device = self.model.norm.weight.device

        def seconds(start: int) -> float:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                self.batch.forward([Segment(0, torch.zeros(width, dtype=torch.long, device=device), start,
                                            torch.arange(start, start + width, device=device), None, 1)])
                times.append(time.perf_counter() - t0)
            return min(times)

        base = seconds(0)
        value = max(0.0, (seconds(context) - base) / (width * context))
        self.model._d3d_attention_s = (key, value)
        return value

    def acquire(self) -> SlotModel | None:
        with self.cond:
            if not self.free or self.stopped:
                return None
            slot = self.free.pop(0)
            self.slots[slot] = SlotModel(self, slot)
            return self.slots[slot]

    def leave(self, slot: int) -> None:
        """The generation on `slot` has ended; the slot stays taken (a server lane keeps its runner) but the
        forwards no longer wait for it until it hands in another."""
        with self.cond:
            if slot in self.slots:
                self.slots[slot].joined = False
                self.slots[slot].width = self.slots[slot].gain = 0
            self.pending.pop(slot, None)
            self.cond.notify_all()

    def release(self, slot: int) -> None:
        with self.cond:
            self.slots.pop(slot, None)
            self.pending.pop(slot, None)
            self.free.append(slot)
            self.free.sort()
            self.cond.notify_all()

    @property
    def running(self) -> int:
        return len(self.slots)

    def decoding(self, slot: int | None = None) -> bool:
        """Whether a generation other than `slot`'s is decoding (its last forward a decoding round)."""
        return any(s.joined and s.width for k, s in self.slots.items() if k != slot)

    def prompt_budget(self, slot: int | None = None, context: int = 0) -> int:
        """Prompt tokens a forward may take: `prefill_chunk`, or `idle_chunks` times it while no other generation
        is decoding, as when a prompt is read alone or prompts arrive together: no stream to keep flowing, and
        a forward's fixed cost paid fewer times (a 250-token prompt on the fp32 1.5B pair at 16-token chunks: 8
        forwards, not 16). A request that arrives meanwhile waits for the forward under way, at most about
        idle_chunks x PREFILL_SECONDS: beside a 4,000-token prompt read alone, four chunks made a short question
        wait 2.6 s (p95) for its first token through the server on that pair. After `context` cached tokens a
        fitted budget shrinks (by 16s, to 16 at least) until the forward's cost, its rows' attention to the cache
        included, is at most the budget's at the prompt's start."""
        tokens = self.prefill_chunk * (1 if self.decoding(slot) else self.idle_chunks)
        if not self.attention_s or not context or self.cost is None:
            return tokens
        cost = self.cost
        fits = [w for w in range(16, tokens + 1, 16) if cost(w) + w * context * self.attention_s <= cost(tokens)]
        return max(fits, default=min(16, tokens))

    def load(self, slot: int) -> tuple[int, float]:
        """(width, committed tokens) of the last forwards of the generations other than `slot`'s. One reading its
        prompt counts as a one-token step: its chunk's rows are work the batch does whatever the others draft,
        but a drafter pass or a wide tree delays its chunks as it would delay its tokens, and it decodes soon (8
        requests arriving together each ran the drafter over its whole prompt in its first round, as if alone)."""
        others = [s for k, s in self.slots.items() if k != slot and s.joined]
        return sum(s.width or 1 for s in others), float(sum(s.gain if s.width else 1 for s in others))

    def submit(self, segment: Segment, rest: int = 0) -> torch.Tensor:
        """Hand in one generation's next forward (`rest`: see Work) and wait for its logits."""
        work = Work(segment, rest)
        with self.cond:
            if self.stopped:
                raise D3DError("the scheduler has stopped")
            if segment.slot not in self.slots:
                raise D3DError(f"cache slot {segment.slot} is not in use")
            self.pending[segment.slot] = work
            self.slots[segment.slot].joined = True
            self.cond.notify_all()
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work.logits

    def stop(self) -> None:
        """Fail every waiting forward, end the scheduler's thread and free the batch's KV cache."""
        with self.cond:
            self.stopped = True
            for w in self.pending.values():
                w.error = D3DError("the scheduler has stopped")
                w.done.set()
            self.pending.clear()
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()
            self.batch.release()

    def _take(self) -> list[Work]:
        """Wait for a forward's work: the next forward of every generation that has joined (handed in one
        before; one still setting up does not hold the others back), or what has been handed in STRAGGLER_S
        after the first."""
        with self.cond:
            while not self.pending and not self.stopped:
                self.cond.wait()
            first = time.monotonic()
            while not self.stopped and len(self.pending) < sum(s.joined for s in self.slots.values()):
                left = STRAGGLER_S - (time.monotonic() - first)
                if left <= 0:
                    break
                self.cond.wait(left)
            works = self._fit(list(self.pending.values()))
            for w in works:
                del self.pending[w.segment.slot]
            return works

    def _fit(self, works: list[Work]) -> list[Work]:
        """The forwards to run now: every decoding round, and prompt chunks up to `prefill_chunk` prompt tokens
        in all (`idle_chunks` times that in a forward of prompts only), those of the prompts with the fewest
        tokens left first and the first always; the other prompt chunks wait for the next forward. So one
        forward's time stays near a chunk's plus the rounds', however many prompts arrive at once, the running
        generations keep streaming, and a short prompt is not queued behind the chunks of a long one."""
        prompt = sorted((w for w in works if w.rest), key=lambda w: (w.rest, w.segment.width))
        chosen = [w for w in works if w not in prompt]
        budget = self.prefill_chunk * (1 if chosen else self.idle_chunks)
        for i, w in enumerate(prompt):
            if i == 0 or w.segment.width <= budget:
                chosen.append(w)
                budget -= w.segment.width
        return chosen

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            works = self._take()
            if self.stopped:
                return
            try:
                logits = self.batch.forward([w.segment for w in works])
                for w, lg in zip(works, logits):
                    w.logits = lg
            except BaseException as e:  # every waiting generation gets the error, the scheduler goes on
                for w in works:
                    w.error = e if isinstance(e, D3DError) else D3DError(f"batched forward failed: {e}")
            self.forwards += 1
            self.last_rows = sum(w.segment.width for w in works)
            self.rows += self.last_rows
            self.last_batch = len(works)
            self.last_drafts = sum(w.segment.width - 1 for w in works if not w.segment.keep)
            for w in works:
                w.done.set()
