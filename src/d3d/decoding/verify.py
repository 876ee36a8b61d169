"""Sampling settings and the verification rule of speculative decoding.

Greedy: accept the longest prefix of the draft that equals the target's argmax, then take the target's
own token. Sampling: standard speculative sampling (Leviathan et al., Chen et al.): accept draft x_i
with probability min(1, p(x_i) / q(x_i)); on rejection sample from norm(max(0, p - q)); if every
draft is accepted, sample the bonus token from p. The output then has exactly the distribution of p,
the target's distribution after temperature / top-k / top-p. A proposer that gives no q is treated
as one-hot on its draft (q(x_i) = 1), which is the same rule.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import takewhile

import torch

from ..errors import D3DError


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature == self.temperature):
            raise D3DError(f"invalid temperature {self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise D3DError(f"invalid top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise D3DError(f"invalid top-k {self.top_k}: must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise D3DError(f"invalid seed {self.seed}: must be in [{SEED_MIN}, {SEED_MAX}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> the target's sampling distribution (temperature, then top-k, then top-p)."""
    logits = logits.float() / max(params.temperature, 1e-8)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_tokens(logits: torch.Tensor) -> list[int] | int:
    """The argmax of each row of logits [..., V], as a list (one int for a single row). fp32 on the CPU
    goes through NumPy: torch.argmax over a 49k vocabulary took 58 us a row here, NumPy's 6 us (both
    return the first maximum), and a round takes one per accepted token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from a [V] logits row."""
    if params.greedy:
        return greedy_tokens(logits)
    return sample(probs_from_logits(logits, params), generator)


def leading_matches(matches: Iterable[bool]) -> int:
    """How many of `matches` hold before the first that does not: the greedy acceptance count when
    match i says whether draft token i is the target's token. verify, the replayed tau (d3d.training.estimate)
    and the teacher-forced tau of training (d3d.training.losses) all count acceptance with it."""
    return sum(1 for _ in takewhile(bool, matches))


def verify(draft: list[int], target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> tuple[int, int]:
    """Decide how much of `draft` to keep.

    draft: k proposed tokens; target_logits: [k + 1, V], row i scores the token after draft[:i];
    draft_probs: optional [k, V] proposal distributions q (None = one-hot on the draft).
    Returns (accepted, next_token): draft[:accepted] is kept and next_token follows it.
    """
    k = len(draft)
    if params.greedy:
        target = greedy_tokens(target_logits)
        n = leading_matches(d == t for d, t in zip(draft, target))
        return n, target[n]
    p = probs_from_logits(target_logits, params)
    u = torch.rand(k, generator=generator, device=p.device).tolist() if k else []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if qx > 0 and u[i] < min(1.0, px / qx):
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - draft_probs[i].to(p.dtype)).clamp(min=0)
        total = float(residual.sum())
        return i, sample(residual / total, generator) if total > 0 else sample(p[i], generator)
    return k, sample(p[k], generator)


def draft_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """The drafter's own stream of randomness, distinct from (not a copy of) the target's: equal seeds
    would correlate draft sampling with the acceptance draws."""
    g = torch.Generator(device=device)
    seed = torch.seed() if params.seed is None else (params.seed * 0x9E3779B97F4A7C15 + 0x2545F491) % 2**64
    g.manual_seed(seed)
    return g


def sample_draft(drafter, logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                 generator: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
    """Greedy: argmax drafts, one-hot q. Sampling: each slot sampled from softmax(logits / T), and that q
    returned over the full vocabulary (slots come from one parallel pass, so each q is a fixed proposal)."""
    if params.greedy:
        return drafter.draft_ids[logits.argmax(-1)].tolist(), None
    q = torch.softmax(logits.float() / params.temperature, dim=-1)
    picks = torch.multinomial(q, 1, generator=generator).squeeze(-1)
    full = torch.zeros(q.shape[0], vocab_size, dtype=q.dtype, device=q.device)
    full.scatter_(-1, drafter.draft_ids.expand_as(q), q)
    return drafter.draft_ids[picks].tolist(), full
