"""The `d3d` method: the D3D proposer drafts the block after the verified text, then the target verifies it."""
from __future__ import annotations

from functools import partial

import torch

from ..decoding.engine import generate
from ..drafters.kinds import D3D
from .registry import Method, Runner, Setup, register
from ..decoding.proposer import DrafterProposer
from ..decoding.verify import sample_draft


class D3DProposer(DrafterProposer):
    """Synchronous D3D: draft the block after the verified text (which ends with the bonus token)."""

    name = "d3d"

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        logits = self.drafter.draft_block(tokens)[:k]
        return sample_draft(self.drafter, logits, self.params, self.vocab_size, self.generator)


def _d3d_runner(s: Setup):
    d = s.drafter(D3D, "d3d")
    proposer = D3DProposer(d, s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=d.block_size),
                  block_size=d.block_size)


D3D_METHOD = register(Method("d3d", _d3d_runner, help="the D3D diffusion drafter, draft then verify",
                            drafter_kind=D3D.name, batches=True))
