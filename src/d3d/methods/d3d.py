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
    """Synchronous D3D: draft the block after the verified text (which ends with the bonus token), k drafts from a
    pass of k + 1 slots (Drafter.draft_logits). `length`: the DraftLength that sizes its drafts alone
    (fitted_length), None: every round drafts the whole block."""

    name = "d3d"
    length = None

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        logits = self.drafter.draft_logits(tokens, k)
        return sample_draft(self.drafter, logits, self.params, self.vocab_size, self.generator)


def fitted_length(model, drafter):
    """A DraftLength for synchronous D3D with `drafter` alone on this device: the target's forward cost by width
    and the drafter's pass by slots, both measured (a few seconds); None where the target's context is too short
    to measure them."""
    from ..decoding.budget import DraftLength
    from ..decoding.treecost import WidthCost, drafter_costs, measured_curve, slot_options

    curve = measured_curve(model)
    if not curve:
        return None
    B = drafter.block_size
    passes = WidthCost(drafter_costs(D3DProposer(drafter, model.args.vocab_size), slot_options(B)))
    return DraftLength(WidthCost(curve), B - 1, draft_s=lambda n: passes(min(n + 1, B)))


def _d3d_runner(s: Setup) -> Runner:
    """Drafts sized every round to what pays on this device (fitted_length; in a batch the scheduler's own
    sizing), or of `draft_k` tokens each (--draft-k), or whole blocks where the costs cannot be measured."""
    d = s.drafter(D3D, "d3d")
    proposer = D3DProposer(d, s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    k = s.options.get("draft_k")
    if k is None and getattr(s.model, "batch_load", None) is None:
        proposer.length = fitted_length(s.model, d)
    block = d.block_size if k is None else min(k + 1, d.block_size)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=block),
                  block_size=block, draft_k=k, sized=proposer.length is not None)


D3D_METHOD = register(Method("d3d", _d3d_runner, help="the D3D diffusion drafter, draft then verify",
                            drafter_kind=D3D.name, batches=True))
