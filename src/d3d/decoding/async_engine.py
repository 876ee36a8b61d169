"""Asynchronous D3D: the drafter drafts every successor block while the target verifies.

Each round the target verifies V = [pending token, drafts] while the drafter runs the packed pass on V
(d3d.decoding.packed) in a worker thread (on CUDA, on its own stream), so a round costs about
max(verify, packed draft) instead of their sum. When verification returns (a, bonus), candidate a's
slots 1.. are the next drafts and go straight to verification; the bonus is the next pending token.
A synchronous draft (as in d3d.decoding.engine with D3DProposer) is made for the first round and whenever the
accepted count was not packed.

Cache invariant at the start of every round: the target's and the drafter's caches both hold every
verified token except the pending one. Output equals plain decoding's (greedy) or has its
distribution (sampling): the drafts of a packed candidate are sampled from that candidate's own
distribution q, which depends only on verified text, and q goes to the standard verification rule.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..drafters.drafter import Drafter
from .engine import (GenerationResult, LogprobRecorder, StopChecker, commit_round, finish, prefill, sync_device,
                     validate_request)
from ..errors import D3DError
from .packed import keep_prefix, likely_candidates, packed_draft
from .trace import DRAFT_TID, VERIFY_TID, add_span, now_us
from .verify import SamplingParams, draft_generator, make_generator, sample_draft, verify

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


class DraftWorker:
    """The drafter side of the round: a one-thread executor (and a CUDA stream) kept for one generation,
    the drafter's sampling state, and the trace lane of its spans."""

    def __init__(self, drafter: Drafter, params: SamplingParams, vocab_size: int, overlap: bool = True,
                 max_candidates: int | None = None, head_all: bool = False, trace: list | None = None,
                 target_device=None):
        self.drafter, self.params, self.vocab_size = drafter, params, vocab_size
        self.max_candidates, self.head_all, self.trace = max_candidates, head_all, trace
        self.device = drafter.draft_ids.device
        self.target_device = torch.device(target_device) if target_device is not None else self.device
        self.generator = draft_generator(params, self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1) if overlap else None

    def __enter__(self) -> "DraftWorker":
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

    def candidates(self, block: Block, k: int, remaining: int) -> list[int]:
        """Acceptance counts worth packing for a block of k drafts: all (or the most likely), minus those
        after which generation stops at max_new_tokens anyway."""
        pool = range(k + 1) if not self.max_candidates else likely_candidates(block.conf[:k], self.max_candidates)
        return [a for a in pool if a + 1 < remaining]

    def block(self, logits: torch.Tensor) -> Block:
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
    def sync_draft(self, tokens: list[int]) -> Block:
        """A plain synchronous D3D draft after the verified text (ending with the pending token); the
        cache then keeps the text minus the pending token, which the next packed pass feeds as v0."""
        t0 = now_us()
        logits = self.drafter.draft_block(tokens)[:self.drafter.block_size - 1]
        keep_prefix(self.drafter, len(tokens) - 1)
        block = self.block(logits)
        add_span(self.trace, "sync draft", DRAFT_TID, t0, now_us())
        return block

    @torch.no_grad()
    def pick(self, out: torch.Tensor) -> Block:
        """The next block from one packed candidate's output [S, .]: slot 0 is the bonus position."""
        t0 = now_us()
        logits = out[1:] if self.head_all else self.drafter.head(out[1:])
        block = self.block(logits)
        add_span(self.trace, "pick", DRAFT_TID, t0, now_us())
        return block


@torch.no_grad()
def generate_async(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
                   max_new_tokens: int = 128, drafter: Drafter | None = None, stop: list[str] | None = None,
                   draft_device=None, overlap: bool = True, trace: list | None = None,
                   max_candidates: int | None = None, successor_slots: int | None = None,
                   head_all: bool = False, on_round=None, logprobs: LogprobRecorder | None = None
                   ) -> AsyncGenerationResult:
    """Asynchronous D3D decoding with the drafter's block size B (B - 1 drafts per verified block).

    overlap=False runs the packed pass and verification one after the other (same output), to measure
    the overlap. Cost levers: max_candidates packs only the most likely acceptance counts (by the
    drafter's confidences); successor_slots < B drafts shorter successor blocks; head_all applies the LM
    head to every candidate inside the packed pass instead of only to the chosen one afterwards.
    trace collects Chrome-trace spans. On CPU the worker thread shares torch's intra-op thread count,
    which is process-wide (torch.set_num_threads in one thread changes it for all): with 2 cores,
    torch.set_num_threads(1) gives each side one core.
    on_round(chunk, accepted), logprobs: as in d3d.decoding.engine.generate (on_round is called after each round's
    chunk is appended).
    """
    if drafter is None:
        raise D3DError("generate_async needs a drafter")
    params = params or SamplingParams()
    B = drafter.block_size
    S = successor_slots or B
    if not 2 <= S <= B:
        raise D3DError(f"successor blocks must have 2..{B} slots (got {S})")
    validate_request(model, prompt_ids, max_new_tokens, B)
    device = next(model.parameters()).device
    draft_dev = _place(drafter, draft_device)
    gen = make_generator(params, device)
    stopper = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_new_tokens, stop)
    res = AsyncGenerationResult(prompt_ids=list(prompt_ids))
    stats = res.stats
    model.setup_cache(1, len(prompt_ids) + max_new_tokens + B + 1)
    drafter.setup_cache(1, len(prompt_ids) + max_new_tokens + B + B * S + 1)
    drafter.cached_tokens = []

    with DraftWorker(drafter, params, model.args.vocab_size, overlap, max_candidates, head_all, trace, device) as w:
        t0, started = now_us(), time.perf_counter()
        fut = w.submit(drafter.extend, list(prompt_ids))  # the drafter reads the prompt beside the target

        def join_drafter(_) -> None:
            add_span(w.trace, "prefill", VERIFY_TID, t0, now_us())
            _, d0, d1 = fut.result()
            add_span(w.trace, "prefill", DRAFT_TID, d0, d1)

        tokens, reason, start, _ = prefill(model, res, stopper, prompt_ids, params, gen, device, on_round, logprobs,
                                           drafter_prefill=join_drafter, started=started)
        block = None
        while reason is None:
            remaining = max_new_tokens - len(res.token_ids)
            s0 = now_us()
            if block is None:
                stats["fallbacks"] += 1 if res.rounds else 0
                block = w.sync_draft(tokens)
            else:
                stats["packed_hits"] += 1
            s1 = now_us()
            k = min(len(block.tokens), remaining - 1)
            drafts, q = block.tokens[:k], None if block.q is None else block.q[:k]
            V = [tokens[-1]] + drafts
            cands = w.candidates(block, k, remaining)
            fut = w.submit(packed_draft, drafter, V, cands, S, head_all) if cands else None
            base = len(tokens) - 1
            v0 = now_us()
            logits = model(torch.tensor([V], device=device))
            n, nxt = verify(drafts, logits[0], params, gen, q)
            model.rollback(base + 1 + n)
            sync_device(device)
            v1 = now_us()
            out, p0, p1 = fut.result() if fut is not None else (None, v1, v1)
            if fut is not None:
                keep_prefix(drafter, base + 1 + n)
            w1 = now_us()
            add_span(w.trace, "verify", VERIFY_TID, v0, v1, drafts=k, accepted=n)
            if fut is not None:
                add_span(w.trace, "draft", DRAFT_TID, p0, p1, candidates=len(cands))
            chunk = drafts[:n] + [nxt]
            res.acceptance_lengths.append(n + 1)
            reason = commit_round(res, stopper, tokens, chunk, on_round, logprobs, logits[0, :n + 1])
            block = w.pick(out[cands.index(n)]) if reason is None and n in cands else None
            for key, value in zip(_STAT_LISTS, ((v1 - v0) / 1e6, (p1 - p0) / 1e6, (w1 - v1) / 1e6, (s1 - s0) / 1e6,
                                                (now_us() - w1) / 1e6, len(cands))):
                stats[key].append(value)
        sync_device(draft_dev)
        return finish(res, stopper, reason, start, device, logprobs)
