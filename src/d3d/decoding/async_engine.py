"""Asynchronous D3D: the drafter drafts every successor block while the target verifies.

Each round the target verifies V = [pending token, drafts] while the drafter runs the packed pass on V
(d3d.decoding.packed) in a worker thread (on CUDA, on its own stream), so a round costs about
max(verify, packed draft) instead of their sum. When verification returns (a, bonus), candidate a's
slots 1.. are the next drafts and go straight to verification; the bonus is the next pending token.
A synchronous draft (as in d3d.decoding.engine with D3DProposer) is made for the first round and whenever the
accepted count was not packed.

It is a proposer of the synchronous loop (d3d.decoding.engine.generate, the protocol of
d3d.decoding.proposer) whose work runs between its verbs: `reset` starts reading the prompt beside the
target's prompt pass, `propose` returns the round's drafts and starts the packed pass on them, which
runs while the loop verifies, and `accept` joins it and picks the block of the accepted count.

Cache invariant at the start of every round: the target's and the drafter's caches both hold every
verified token except the pending one. Output equals plain decoding's (greedy) or has its
distribution (sampling): the drafts of a packed candidate are sampled from that candidate's own
distribution q, which depends only on verified text, and q goes to the standard verification rule.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from ..drafters.drafter import Drafter
from .engine import GenerationResult, LogprobRecorder, generate, sync_device
from ..errors import D3DError
from .packed import keep_prefix, likely_candidates, packed_draft
from .trace import DRAFT_TID, VERIFY_TID, add_span, now_us
from .proposer import Proposer
from .verify import SamplingParams, draft_generator, sample_draft

_STAT_LISTS = ("verify_s", "draft_s", "wait_s", "sync_draft_s", "pick_s", "candidates")


@dataclass
class AsyncGenerationResult(GenerationResult):
    """GenerationResult plus per-round stats: packed_hits (rounds whose block came from the packed
    pass), fallbacks (rounds after the first that needed a synchronous draft), and per-round lists
    verify_s, draft_s (packed pass, 0 if none), wait_s (verify done -> packed pass done), sync_draft_s,
    pick_s (LM head + sampling of the chosen candidate), candidates (how many were packed)."""

    stats: dict = field(default_factory=lambda: {"packed_hits": 0, "fallbacks": 0} | {k: [] for k in _STAT_LISTS})

    @property
    def hit_rate(self) -> float:
        s = self.stats
        return s["packed_hits"] / max(1, s["packed_hits"] + s["fallbacks"])

    @classmethod
    def of(cls, res: GenerationResult, stats: dict) -> "AsyncGenerationResult":
        return cls(**{f.name: getattr(res, f.name) for f in fields(GenerationResult)}, stats=stats)

    def to_json(self) -> dict:
        s = self.stats
        means = {f"mean_{k[:-2]}_ms": round(1000 * sum(s[k]) / max(1, len(s[k])), 3) for k in _STAT_LISTS[:-1]}
        return super().to_json() | {"packed_hits": s["packed_hits"], "fallbacks": s["fallbacks"],
                                    "hit_rate": round(self.hit_rate, 4)} | means


@dataclass
class Block:
    """Drafts ready for verification, their proposal law q (None = greedy) and the drafter's
    probability of each of its tokens (for choosing which acceptance counts to pack)."""

    tokens: list[int]
    q: torch.Tensor | None
    conf: list[float] | None


class _Done:
    """An already finished future: overlap=False runs the very same calls in sequence."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _place(drafter: Drafter, draft_device) -> torch.device:
    device = torch.device(draft_device) if draft_device is not None else drafter.draft_ids.device
    if device != drafter.draft_ids.device:
        drafter.to(device)  # setup_cache then reallocates the KV cache on that device
    return device


class AsyncD3DProposer(Proposer):
    """The drafter side of asynchronous D3D, for one generation: a one-thread executor (and a CUDA stream),
    the drafter's sampling state, the block waiting for the next round, the per-round stats and the
    trace lane of its spans. Use it as a context manager (the executor is shut down at exit)."""

    name = "d3d-async"

    def __init__(self, drafter: Drafter, vocab_size: int, cache_len: int, slots: int, overlap: bool = True,
                 max_candidates: int | None = None, head_all: bool = False, trace: list | None = None,
                 target_device=None, pack: bool = True):
        super().__init__()
        self.drafter, self.vocab_size, self.cache_len, self.slots = drafter, vocab_size, cache_len, slots
        self.pack = pack  # False: no packed pass, every round drafts synchronously (the schedule of `d3d`)
        self.length = None  # pack=False: the DraftLength that sizes its drafts (generate_async's `length`)
        self.max_candidates, self.head_all, self.trace = max_candidates, head_all, trace
        self.device = drafter.draft_ids.device
        self.target_device = torch.device(target_device) if target_device is not None else self.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1) if overlap else None
        self.stats = {"packed_hits": 0, "fallbacks": 0} | {k: [] for k in _STAT_LISTS}

    def __enter__(self) -> "AsyncD3DProposer":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _timed(self, fn, args: tuple):
        t0 = now_us()
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            out = fn(*args)
        if self.stream is not None:
            self.stream.synchronize()
        return out, t0, now_us()

    def submit(self, fn, *args) -> Future | _Done:
        """Run fn(*args) on the drafter, concurrently when overlapping; result() -> (out, t0_us, t1_us)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.pool is None:
            return _Done(self._timed(fn, args))
        return self.pool.submit(self._timed, fn, args)

    def reset(self, prompt_ids: list[int]) -> None:
        """Set up the drafter's cache and start reading the prompt beside the target's prompt pass."""
        self.drafter.setup_cache(1, self.cache_len)
        self.drafter.cached_tokens = []
        self.generator = draft_generator(self.params, self.device)
        self.block, self.round, self.rounds = None, None, 0
        self.reading = (now_us(), self.submit(self.drafter.extend, list(prompt_ids)))
        self.last_us = now_us()  # when the drafter side last handed over: a round without drafts starts there

    def _join_prompt(self) -> None:
        if self.reading is not None:
            t0, fut = self.reading
            _, d0, d1 = fut.result()
            add_span(self.trace, "prefill", VERIFY_TID, t0, now_us())
            add_span(self.trace, "prefill", DRAFT_TID, d0, d1)
            self.reading = None

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """The round's drafts (the packed block of the last accepted count, else a synchronous draft), with
        the packed pass on V = [pending token, drafts] started for every acceptance count worth packing."""
        self._join_prompt()
        s0 = now_us()
        block, self.block = self.block, None
        if block is None:
            self.stats["fallbacks"] += 1 if self.rounds else 0
            block = self.sync_draft(tokens, k)
        else:
            self.stats["packed_hits"] += 1
        s1 = now_us()
        drafts, q = block.tokens[:k], None if block.q is None else block.q[:k]
        cands = self.candidates(block, len(drafts)) if self.pack else []
        V = [tokens[-1]] + drafts
        fut = self.submit(packed_draft, self.drafter, V, cands, self.slots, self.head_all) if cands else None
        self.round = (len(tokens) - 1, cands, fut, (s1 - s0) / 1e6, now_us())
        return drafts, q

    def accept(self, draft: list[int], n: int) -> None:
        """Join the packed pass, keep the drafter's cache up to the accepted text, and pick the block of
        the accepted count for the next round (none if it was not packed)."""
        self.rounds += 1
        if self.round is None:  # a round without drafts (k = 0: one token left): the target's forward only
            v0, self.last_us = self.last_us, now_us()
            add_span(self.trace, "verify", VERIFY_TID, v0, self.last_us, drafts=0, accepted=0)
            self._record((self.last_us - v0) / 1e6, 0.0, 0.0, 0.0, 0.0, 0)
            return
        base, cands, fut, sync_s, v0 = self.round
        self.round = None
        v1 = now_us()
        out, p0, p1 = fut.result() if fut is not None else (None, v1, v1)
        if fut is not None:
            keep_prefix(self.drafter, base + 1 + n)
        w1 = now_us()
        add_span(self.trace, "verify", VERIFY_TID, v0, v1, drafts=len(draft), accepted=n)
        if fut is not None:
            add_span(self.trace, "draft", DRAFT_TID, p0, p1, candidates=len(cands))
        self.block = self.pick(out[cands.index(n)]) if n in cands else None
        self.last_us = now_us()
        self._record((v1 - v0) / 1e6, (p1 - p0) / 1e6, (w1 - v1) / 1e6, sync_s, (self.last_us - w1) / 1e6, len(cands))

    def _record(self, *values) -> None:
        for key, value in zip(_STAT_LISTS, values):
            self.stats[key].append(value)

    def candidates(self, block: Block, k: int) -> list[int]:
        """Acceptance counts worth packing for a block of k drafts: all, or the most likely ones."""
        return list(range(k + 1)) if not self.max_candidates else likely_candidates(block.conf[:k], self.max_candidates)

    def block_of(self, logits: torch.Tensor) -> Block:
        """Drafts from draft-vocabulary logits [k, V_draft] (greedy argmax or sampled from q)."""
        tokens, q = sample_draft(self.drafter, logits, self.params, self.vocab_size, self.generator)
        conf = None
        if self.max_candidates:
            if q is None:
                conf = torch.softmax(logits.float(), -1).amax(-1).tolist()
            else:
                conf = q.gather(-1, torch.tensor(tokens, device=q.device)[:, None])[:, 0].tolist()
        return Block(tokens, None if q is None else q.to(self.target_device), conf)

    @torch.no_grad()
    def sync_draft(self, tokens: list[int], k: int) -> Block:
        """A plain synchronous D3D draft after the verified text (ending with the pending token): the whole
        block where the next packed pass needs it, else k drafts (Drafter.draft_logits), as D3DProposer drafts; the
        cache then keeps the text minus the pending token, which the next packed pass feeds as v0."""
        t0 = now_us()
        logits = self.drafter.draft_logits(tokens, self.drafter.block_size - 1 if self.pack else k)
        keep_prefix(self.drafter, len(tokens) - 1)
        block = self.block_of(logits)
        add_span(self.trace, "sync draft", DRAFT_TID, t0, now_us())
        return block

    @torch.no_grad()
    def pick(self, out: torch.Tensor) -> Block:
        """The next block from one packed candidate's output [S, .]: slot 0 is the bonus position."""
        t0 = now_us()
        logits = out[1:] if self.head_all else self.drafter.head(out[1:])
        block = self.block_of(logits)
        add_span(self.trace, "pick", DRAFT_TID, t0, now_us())
        return block


@torch.no_grad()
def generate_async(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
                   max_new_tokens: int = 128, drafter: Drafter | None = None, stop: list[str] | None = None,
                   draft_device=None, overlap: bool = True, trace: list | None = None,
                   max_candidates: int | None = None, successor_slots: int | None = None,
                   head_all: bool = False, on_round=None, logprobs: LogprobRecorder | None = None,
                   pack: bool = True, length=None, draft_k: int | None = None) -> AsyncGenerationResult:
    """Asynchronous D3D decoding with the drafter's block size B (B - 1 drafts per verified block): the
    synchronous loop with an AsyncD3DProposer.

    overlap=False runs the packed pass and verification one after the other (same output), to measure
    the overlap. Cost levers: max_candidates packs only the most likely acceptance counts (by the
    drafter's confidences); successor_slots < B drafts shorter successor blocks; head_all applies the LM
    head to every candidate inside the packed pass instead of only to the chosen one afterwards.
    pack=False drafts every round synchronously, as `d3d` does (the schedule d3d-async falls back to where
    round_costs says the overlap does not pay), a draft of k tokens in a pass of k + 1 slots: k sized by `length`
    (a DraftLength, d3d.methods.d3d.fitted_length), or `draft_k` at most, or the whole block.
    trace collects Chrome-trace spans. On CPU the worker thread shares torch's intra-op thread count, which
    is process-wide (torch.set_num_threads in one thread changes it for all): with 2 cores,
    torch.set_num_threads(1) gives each side one core.
    on_round(chunk, accepted), logprobs: as in d3d.decoding.engine.generate.
    """
    if drafter is None:
        raise D3DError("generate_async needs a drafter")
    B = drafter.block_size
    S = successor_slots or B
    if not 2 <= S <= B:
        raise D3DError(f"successor blocks must have 2..{B} slots (got {S})")
    _place(drafter, draft_device)
    cache_len = len(prompt_ids) + max_new_tokens + B + B * S + 1
    with AsyncD3DProposer(drafter, model.args.vocab_size, cache_len, S, overlap, max_candidates, head_all, trace,
                          next(model.parameters()).device, pack) as proposer:
        proposer.length = None if pack else length
        block = B if pack or draft_k is None else min(draft_k + 1, B)
        res = generate(model, tokenizer, prompt_ids, params, max_new_tokens, proposer, block, stop, on_round, logprobs)
    return AsyncGenerationResult.of(res, proposer.stats)


@dataclass
class RoundPasses:
    """The passes of one round, for timing them (round_costs, d3d.bench.async_model): each leaves the caches as
    round_passes set them up. verify: the target over a block; draft(turn): a synchronous draft after the text
    (its last token changes with `turn`, so every draft feeds it again, as in a round); packed: the packed pass
    of every acceptance count's successor blocks."""

    verify: Callable[[], None]
    draft: Callable[[int], None]
    packed: Callable[[], None]


@torch.no_grad()
def round_passes(model, drafter: Drafter, context: int, slots: int) -> RoundPasses:
    """RoundPasses after `context` cached tokens (fewer where a model's context is shorter): the target's cache
    holds them all, the drafter's all but the last (the pending token a round feeds); successor blocks of
    `slots` slots."""
    B = drafter.block_size
    device, draft_device = next(model.parameters()).device, drafter.draft_ids.device
    context = max(2, min(context, model.args.max_seq_len - B - 1, drafter.args.max_seq_len - B - B * slots - 2))
    text = [0] * context
    model.setup_cache(1, context + B + 1)
    model(torch.zeros(1, context, dtype=torch.long, device=device))
    drafter.setup_cache(1, context + B + B * slots + 2)
    drafter.cached_tokens = []
    drafter.extend(text[:-1])
    V = torch.zeros(1, B, dtype=torch.long, device=device)

    @torch.no_grad()
    def verify() -> None:
        model(V)
        sync_device(device)
        model.rollback(context)

    @torch.no_grad()
    def draft(turn: int) -> None:
        text[-1] = 1 + turn % 2
        drafter.draft_block(text)
        keep_prefix(drafter, context - 1)

    @torch.no_grad()
    def packed() -> None:
        packed_draft(drafter, [0] * B, None, slots, apply_head=False)
        sync_device(draft_device)
        keep_prefix(drafter, context - 1)

    return RoundPasses(verify, draft, packed)


@torch.no_grad()
def round_costs(model, drafter: Drafter, split_threads: bool, context: int = 256, repeats: int = 3,
                slots: int | None = None) -> dict[str, float]:
    """Seconds of one round of each schedule of asynchronous D3D on this machine, the fastest of `repeats`
    (taking turns, as d3d.decoding.treecost's curves): "sync", a synchronous draft then the verification of its
    block (what `d3d` and d3d-async with pack=False do), and "overlap", the verification of a block while
    the packed pass drafts every outcome's successor in the worker thread, with half of the threads each
    where `split_threads` (one CPU). Both after `context` cached tokens (fewer where a model's context is
    shorter); every cache is rolled back after."""
    passes = round_passes(model, drafter, context, slots or drafter.block_size)

    def sync_round(turn: int) -> None:
        passes.draft(turn)
        passes.verify()

    def overlap_round(pool: ThreadPoolExecutor) -> None:
        fut = pool.submit(passes.packed)
        passes.verify()
        fut.result()

    times: dict[str, list[float]] = {"sync": [], "overlap": []}
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(1) as pool:
        for turn in range(repeats + 1):  # the first turn warms up, untimed
            t0 = time.perf_counter()
            sync_round(turn)
            t1 = time.perf_counter()
            if split_threads:
                torch.set_num_threads(max(1, threads // 2))
            try:
                t2 = time.perf_counter()
                overlap_round(pool)
                t3 = time.perf_counter()
            finally:
                torch.set_num_threads(threads)
            if turn:
                times["sync"].append(t1 - t0)
                times["overlap"].append(t3 - t2)
    return {k: min(v) for k, v in times.items()}
