"""The `dflash` method (baseline): a DFlash-style drafter (d3d.drafters.dflash) drafts each block from the
target's hidden states of the verified text, which the engine hands it after every verification."""
from __future__ import annotations

from functools import partial

import torch

from ..decoding.engine import generate
from ..decoding.proposer import DrafterProposer
from ..decoding.verify import draft_generator, sample_draft
from ..drafters.dflash import DFlashDrafter
from ..drafters.kinds import DFLASH
from .registry import Method, Setup, register


class DFlashProposer(DrafterProposer):
    """Synchronous DFlash: the engine hands it the target's hidden states of every verified position."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, vocab_size: int, max_len: int = 4096):
        super().__init__(drafter, vocab_size, max_len)
        self.hidden_layers = list(drafter.cfg.target_layers)

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter.setup_cache(1, self.max_len)
        self.generator = draft_generator(self.params, self.drafter.draft_ids.device)

    def observe(self, taps: list[torch.Tensor]) -> None:
        self.drafter.observe(taps)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        if self.drafter.cache_len != len(tokens) - 1:
            raise RuntimeError(f"dflash context holds {self.drafter.cache_len} positions, expected {len(tokens) - 1}")
        logits = self.drafter.draft(tokens[-1])[:k]
        return sample_draft(self.drafter, logits, self.params, self.vocab_size, self.generator)


def _dflash_runner(s: Setup):
    proposer = DFlashProposer(s.drafter(DFLASH, "dflash"), s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    return partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=s.block_size)


DFLASH_METHOD = register(Method("dflash", _dflash_runner, help="baseline: a DFlash-style drafter reading the target's hidden states",
                         drafter_kind=DFLASH.name, drafter_suffix="-dflash", drafter_option="dflash-drafter"))
