"""The D3D proposer and the `d3d` method (draft the block after the verified text, then verify it), and
the draft sampling that every learned drafter's proposer shares (draft_generator, sample_draft)."""
from __future__ import annotations

from functools import partial

import torch

from .drafter import Drafter
from .engine import generate
from .registry import Method, Runner, Setup, register
from .verify import SamplingParams


class D3DProposer:
    """Synchronous D3D: draft the block after the verified text (which ends with the bonus token)."""

    name = "d3d"

    def __init__(self, drafter: Drafter, vocab_size: int, max_len: int = 4096):
        self.drafter, self.vocab_size, self.max_len = drafter, vocab_size, max_len
        self.params = SamplingParams()

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter.setup_cache(1, self.max_len)
        self.drafter.cached_tokens = []
        self.drafter.extend(prompt_ids)
        self.generator = draft_generator(self.params, self.drafter.draft_ids.device)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        logits = self.drafter.draft_block(tokens)[:k]
        return sample_draft(self.drafter, logits, self.params, self.vocab_size, self.generator)


def draft_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """The drafter's own stream of randomness, distinct from (not a copy of) the target's: equal seeds
    would correlate draft sampling with the acceptance draws."""
    g = torch.Generator(device=device)
    seed = torch.seed() if params.seed is None else (params.seed * 0x9E3779B97F4A7C15 + 0x2545F491) % 2**64
    g.manual_seed(seed)
    return g


def sample_draft(drafter: Drafter, logits: torch.Tensor, params: SamplingParams, vocab_size: int,
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


def _d3d_runner(s: Setup):
    d = s.drafter("d3d", "d3d")
    proposer = D3DProposer(d, s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=d.block_size),
                  block_size=d.block_size)


D3D = register(Method("d3d", _d3d_runner, help="the D3D diffusion drafter, draft then verify", drafter_kind="d3d"))
