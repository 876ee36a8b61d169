"""Plain decoding and the synchronous draft-then-verify loop, generic over proposers.

Cache invariant: the target's KV cache holds every verified token except the last one, which is
"pending": it is fed at the start of the next target forward, followed by the draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import D3DError
from .proposer import Proposer
from .verify import SamplingParams, make_generator, next_token, verify

PREFILL_CHUNK = 256  # prompt tokens per forward while d3d serve processes a prompt (cancel and deadline between)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "length"
    text: str = ""
    logprobs: list["TokenLogprob"] | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, self.rounds)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens produced after the prefill's first token, per decode second."""
        return max(0, self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "new_tokens": self.new_tokens,
                "rounds": self.rounds, "acceptance_lengths": self.acceptance_lengths, "tau": round(self.tau, 4),
                "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 2), "finish_reason": self.finish_reason}


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target (log-softmax of its raw logits, temperature 1)
    and the `top` most likely tokens there as (token id, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class LogprobRecorder:
    """Opt-in (the engines' `logprobs=` argument): records a TokenLogprob per emitted token, taken from
    the target's logits at the position that produced it; `entries` grows before each on_round call."""

    def __init__(self, top: int = 0):
        self.top = top
        self.entries: list[TokenLogprob] = []

    def add(self, logits: torch.Tensor, ids: list[int]) -> None:
        """logits: [>= len(ids), V], row i scored ids[i]."""
        if not ids:
            return
        lp = torch.log_softmax(logits[:len(ids)].float(), -1)
        chosen = lp.gather(-1, torch.tensor(ids, device=lp.device)[:, None])[:, 0].tolist()
        tops = [[] for _ in ids]
        if self.top:
            values, index = lp.topk(min(self.top, lp.shape[-1]), -1)
            tops = [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
        self.entries += [TokenLogprob(t, c, top) for t, c, top in zip(ids, chosen, tops)]


def check_stop(stop: list[str] | None) -> list[str]:
    """The stop strings, checked: an empty one would match at once and end every answer after one token
    (vLLM refuses it too)."""
    stop = list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop):
        raise D3DError(f"stop strings must be non-empty strings (got {stop!r})")
    return stop


class StopChecker:
    """Ends generation on EOS, on `max_new_tokens`, or when the decoded text contains a stop string.

    `clip` cuts a freshly verified chunk at the first stop so that every method returns exactly the
    same tokens as plain decoding.
    """

    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, stop: list[str] | None):
        self.tokenizer, self.eos_ids, self.max_new, self.stop = tokenizer, eos_ids, max_new_tokens, check_stop(stop)

    def clip(self, generated: list[int], chunk: list[int]) -> tuple[list[int], str | None]:
        for j, t in enumerate(chunk):
            if len(generated) + j + 1 >= self.max_new or t in self.eos_ids or self._hits_stop(generated + chunk[:j + 1]):
                reason = "eos" if t in self.eos_ids else "stop" if self._hits_stop(generated + chunk[:j + 1]) \
                    else "length"
                return chunk[:j + 1], reason
        return chunk, None

    def _hits_stop(self, ids: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self.tokenizer.decode(ids[-32:])
        return any(s in tail for s in self.stop)

    def final_text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode([t for t in ids if t not in self.eos_ids])
        for s in self.stop:
            if s in text:
                text = text[:text.index(s)]
        return text


def validate_request(model, prompt_ids: list[int], max_new_tokens: int, block: int = 16) -> None:
    if not prompt_ids:
        raise D3DError("empty prompt")
    if max_new_tokens <= 0:
        raise D3DError(f"max_new_tokens must be > 0 (got {max_new_tokens})")
    limit = model.args.max_seq_len
    if len(prompt_ids) + max_new_tokens + block > limit:
        raise D3DError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the "
                       f"context window ({limit} tokens)")


def commit_round(res: GenerationResult, stopper: StopChecker, tokens: list[int], chunk: list[int],
                 on_round=None, logprobs: LogprobRecorder | None = None, rows: torch.Tensor | None = None
                 ) -> str | None:
    """Append a round's verified chunk: whole to `tokens` (the working text, which the caches follow),
    clipped at the first stop to the output; record its logprobs from the target's logits `rows` (if
    asked); report it to `on_round`. Returns the finish reason or None."""
    tokens += chunk
    clipped, reason = stopper.clip(res.token_ids, chunk)
    res.token_ids += clipped
    if logprobs is not None:
        logprobs.add(rows, clipped)
    if on_round is not None:
        on_round(clipped, res.acceptance_lengths[-1] - 1)
    return reason


def commit_first(res: GenerationResult, stopper: StopChecker, first: int, row: torch.Tensor, on_round=None,
                 logprobs: LogprobRecorder | None = None) -> str | None:
    """Start the output with the prefill's token (`row`: its logits, [1, V]); report it to `on_round` as a
    round with accepted=0. Returns the finish reason or None."""
    chunk, reason = stopper.clip([], [first])
    res.token_ids = chunk
    if logprobs is not None:
        logprobs.add(row, chunk)
    if on_round is not None:
        on_round(chunk, 0)
    return reason


def prefill(model, res: GenerationResult, stopper: StopChecker, prompt_ids: list[int], params: SamplingParams,
            gen: torch.Generator, device, on_round=None, logprobs: LogprobRecorder | None = None,
            proposer: Proposer | None = None):
    """The proposer's reset (given `params`; a proposer reads the prompt there, beside the target's pass if
    it has a thread of its own), the prompt's forward and the first token, committed (commit_first) and
    all timed into res.prefill_s; a proposer with hidden_layers observes the prompt's taps. Returns
    (working tokens, finish reason or None, decode start time)."""
    t0 = time.perf_counter()
    taps_of = None
    if proposer is not None:
        proposer.params = params
        proposer.reset(list(prompt_ids))
        taps_of = proposer.hidden_layers or None
    logits = model(torch.tensor([prompt_ids], device=device), last_only=True, hidden_layers=taps_of)
    if taps_of:
        logits, taps = logits
    first = next_token(logits[0, -1], params, gen)
    if taps_of:
        proposer.observe(taps)
    sync_device(device)
    t1 = time.perf_counter()
    res.prefill_s = t1 - t0
    reason = commit_first(res, stopper, first, logits[0, -1:], on_round, logprobs)
    return list(prompt_ids) + [first], reason, t1


def finish(res: GenerationResult, stopper: StopChecker, reason: str, t1: float, device,
           logprobs: LogprobRecorder | None = None) -> GenerationResult:
    """Close a generation: decode time since t1, finish reason, logprobs, text."""
    sync_device(device)
    res.decode_s = time.perf_counter() - t1
    res.finish_reason = reason
    res.logprobs = None if logprobs is None else logprobs.entries
    res.text = stopper.final_text(res.token_ids)
    return res


def sync_device(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def draft_length(model, proposer, block_size: int):
    """The DraftLength that sizes each round's draft (d3d.decoding.budget), or None where every round drafts its
    whole block: in a batch (a d3d.scheduler.SlotModel: `batch_load`) one per generation, weighed against the
    batch; alone the proposer's own `length` if it has one (`d3d`'s, kept across its generations)."""
    if proposer is None or getattr(proposer, "sizes_drafts", False):
        return None
    load = getattr(model, "batch_load", None)
    if load is None:
        return getattr(proposer, "length", None)
    from .budget import DraftLength
    from .treecost import WidthCost, measured_curve

    curve = measured_curve(model)
    return None if not curve else DraftLength(WidthCost(curve, load=load), block_size - 1)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
             max_new_tokens: int = 128, proposer: Proposer | None = None, block_size: int = 16,
             stop: list[str] | None = None, on_round=None, logprobs: LogprobRecorder | None = None
             ) -> GenerationResult:
    """Plain decoding when `proposer` is None, else synchronous speculative decoding with blocks of
    `block_size` tokens (one pending token + up to block_size - 1 drafts) verified per target forward.

    on_round(chunk, accepted), if given, is called with the tokens each round adds to the output (after
    stop clipping) and the number of drafts accepted in it; the prefill's first token comes as a round
    with accepted=0. An exception it raises aborts the generation (used to stop streaming early).
    logprobs: a LogprobRecorder that gets every emitted token's target logprobs (None: nothing recorded)."""
    params = params or SamplingParams()
    validate_request(model, prompt_ids, max_new_tokens, block_size)
    device = next(model.parameters()).device
    gen = make_generator(params, device)
    stopper = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_new_tokens, stop)
    res = GenerationResult(prompt_ids=list(prompt_ids))
    model.setup_cache(1, len(prompt_ids) + max_new_tokens + block_size + 1)
    taps_of = None if proposer is None else proposer.hidden_layers or None
    budget = draft_length(model, proposer, block_size)
    tokens, reason, t1 = prefill(model, res, stopper, prompt_ids, params, gen, device, on_round, logprobs, proposer)
    while reason is None:
        if proposer is None:
            logits = model(torch.tensor([[tokens[-1]]], device=device))
            rows = logits[0, -1:]
            chunk = [next_token(rows[0], params, gen)]
            res.acceptance_lengths.append(1)
        else:
            k = min(block_size - 1, max_new_tokens - len(res.token_ids) - 1)
            if budget is not None:
                k = budget.choose(k)
                budget.start()
            draft, q = proposer.propose(tokens, k) if k > 0 else ([], None)
            if budget is not None and k > 0:
                budget.drafted()
            base = len(tokens) - 1
            logits = model(torch.tensor([[tokens[-1]] + draft], device=device), hidden_layers=taps_of)
            if taps_of:
                logits, taps = logits
            n, nxt = verify(draft, logits[0], params, gen, q)
            if budget is not None:
                budget.observe(len(draft), n)
            model.rollback(base + 1 + n)
            proposer.accept(draft, n)
            if taps_of:
                proposer.observe([t[:, :n + 1] for t in taps])
            chunk = draft[:n] + [nxt]
            rows = logits[0, :n + 1]
            res.acceptance_lengths.append(n + 1)
        reason = commit_round(res, stopper, tokens, chunk, on_round, logprobs, rows)
    return finish(res, stopper, reason, t1, device, logprobs)

