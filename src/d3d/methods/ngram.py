"""Prompt-lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the last n tokens.

With a cost model (d3d.decoding.treecost.WidthCost, the measured cost of a target forward by width) each draft is
cut to the length that maximises expected tokens per second: on a CPU a 16-token verification costs
about twice a one-token step, so a long copy that is probably wrong costs more than it can win. The
chance that a copied token is right is estimated per n-gram length from what the text did next (also
after rounds that verified no draft), and the cut depends on verified text only, so outputs stay exact.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..decoding.engine import generate
from .registry import Method, Runner, Setup, register
from ..decoding.proposer import Proposer
from ..decoding.treecost import WidthCost, measured_curve

DECAY = 0.9  # weight of the past in the acceptance estimates, per observed round


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 10, cost: WidthCost | None = None):
        super().__init__()
        self.max_ngram, self.min_ngram, self.max_draft, self.cost = max_ngram, min_ngram, max_draft, cost
        self.sizes_drafts = cost is not None  # _length: with the batch's load where there is one

    def reset(self, prompt_ids: list[int]) -> None:
        self.hits = {n: [1.0, 2.0] for n in range(self.min_ngram, self.max_ngram + 1)}  # [right, tried]: 0.5 prior
        self.last: tuple[int, list[int], int] | None = None  # (text length, the whole match, n) of the last round

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        self._observe(tokens)
        follow, n = self._match(tokens, min(k, self.max_draft))
        if follow:
            self.last = (len(tokens), follow, n)
            if self.cost is not None:
                follow = follow[:self._length(n, len(follow))]
        return follow, None

    def _match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(what followed the longest, latest match, n), or ([], 0)."""
        for n, follow in ngram_continuations(tokens, k, 1, self.max_ngram, self.min_ngram):
            return follow, n
        return [], 0

    def _observe(self, tokens: list[int]) -> None:
        if self.last is not None:
            start, follow, n = self.last
            score_copy(self.hits[n], tokens, start, follow)
            self.last = None

    def _length(self, n: int, longest: int) -> int:
        """Draft length in 0..longest maximising (1 + p + p^2 + ... + p^k) / cost(k + 1), with p the
        estimated chance that a token copied after an n-gram match is right."""
        p = self.hits[n][0] / self.hits[n][1]
        others = self.cost.others()
        best, best_rate, gain, term = 0, self.cost.rate(1.0, 1, others), 1.0, 1.0
        for length in range(1, longest + 1):
            term *= p
            gain += term
            rate = self.cost.rate(gain, length + 1, others)
            if rate > best_rate:
                best, best_rate = length, rate
        return best


def ngram_continuations(tokens: list[int], k: int, max_matches: int = 4, max_ngram: int = 3,
                        min_ngram: int = 1) -> list[tuple[int, list[int]]]:
    """Up to `max_matches` distinct continuations (n, next <= k tokens) of earlier occurrences of the
    text's last n tokens: longest n first, latest occurrence first."""
    L, out, seen = len(tokens), [], set()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tuple(tokens[start + n:start + n + k])
                if follow and follow not in seen:
                    seen.add(follow)
                    out.append((n, list(follow)))
                    if len(out) >= max_matches:
                        return out
    return out


def longest_continuations(tokens: list[int], k: int, max_matches: int = 4, max_match: int = 64
                          ) -> list[tuple[int, list[int]]]:
    """Up to `max_matches` distinct continuations (match length, next <= k tokens) of the earlier
    occurrences of the text's last token, ranked by how far back each occurrence agrees with the text (up
    to `max_match` tokens), latest first among equals: the longest suffix match, as a suffix tree finds
    it. In code that restates code, a short n-gram recurs in many places and its latest occurrence is often
    the wrong one; the longest match picks the place being copied."""
    text = np.asarray(tokens)
    last = len(text) - 1
    ends = np.flatnonzero(text[:last] == text[last])[::-1]  # latest first
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_match, last)):
        at = ends - back
        alive &= at >= 0
        alive[alive] = text[at[alive]] == text[last - back]
        if not alive.any():
            break
        lengths += alive
    out, seen = [], set()
    for i in np.argsort(-lengths, kind="stable"):
        follow = tuple(tokens[ends[i] + 1:ends[i] + 1 + k])
        if follow and follow not in seen:
            seen.add(follow)
            out.append((int(lengths[i]), list(follow)))
            if len(out) >= max_matches:
                break
    return out


def score_copy(hits: list[float], tokens: list[int], start: int, follow: list[int]) -> None:
    """Update hits = [right, tried] (decayed counts) with how a copy `follow`, proposed when the text had
    `start` tokens, fared against the tokens that came: right ones in a row, then one miss if it went
    wrong within them."""
    came = tokens[start:start + len(follow)]
    right = 0
    while right < len(came) and came[right] == follow[right]:
        right += 1
    hits[0] = DECAY * hits[0] + right
    hits[1] = DECAY * hits[1] + right + (1 if right < len(came) else 0)


def _ngram_runner(s: Setup) -> Runner:
    curve = measured_curve(s.model)
    proposer = NgramProposer(cost=WidthCost(curve, load=getattr(s.model, "batch_load", None)) if curve else None)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=s.block_size),
                  block_size=s.block_size)


NGRAM = register(Method("ngram", _ngram_runner, help="n-gram prompt lookup, drafts cut to the measured cost of verification",
                        batches=True))
