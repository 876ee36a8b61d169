"""The `ar-draft` method (baseline), a small autoregressive drafter: draft k tokens one by one, then verify them at once.

The drafter is a causal stack of the same shape and budget as the D3D drafter (kind "ar", trained with
the next-token loss only). Its KV cache follows the verified text: drafted tokens enter the cache while
drafting, and the next round keeps whatever prefix the target accepted (Drafter.sync_context).

k adapts to recent acceptance like transformers' assisted generation: +2 after a round that accepted
every draft, -1 otherwise, within [1, max_k]; the method option ar_draft_k (`--ar-draft-k`) fixes it.
"""
from __future__ import annotations

from functools import partial

import torch

from ..drafters.drafter import Drafter
from ..decoding.engine import generate
from ..decoding.proposer import DrafterProposer
from ..decoding.verify import sample_draft
from ..drafters.kinds import AR
from .registry import Method, Runner, Setup, register


class ARDraftProposer(DrafterProposer):
    name = "ar-draft"

    def __init__(self, drafter: Drafter, vocab_size: int, max_len: int = 4096, k: int = 4, max_k: int = 15,
                 adaptive: bool = True):
        super().__init__(drafter, vocab_size, max_len)
        self.k0, self.max_k, self.adaptive = k, max_k, adaptive

    def reset(self, prompt_ids: list[int]) -> None:
        super().reset(prompt_ids)
        self.k = self.k0

    def accept(self, draft: list[int], n: int) -> None:
        """Update k from how much of the draft the target kept."""
        if self.adaptive:
            self.k = min(self.max_k, self.k + 2) if n == len(draft) else max(1, self.k - 1)

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        k = min(k, self.k)
        d, device = self.drafter, self.drafter.draft_ids.device
        new = d.sync_context(tokens)
        if not new:  # the whole text is cached: recompute the last position to get its logits
            new = d.sync_context(tokens[:-1]) + tokens[-1:]
        logits = d(torch.tensor([new], device=device), last_only=True)[0]
        d.cached_tokens += new
        draft, qs = [], []
        for i in range(k):
            (tok,), q = sample_draft(d, logits[-1:], self.params, self.vocab_size, self.generator)
            draft.append(tok)
            if q is not None:
                qs.append(q)
            if i + 1 < k:
                logits = d(torch.tensor([[tok]], device=device))[0]
                d.cached_tokens.append(tok)
        return draft, torch.cat(qs) if qs else None


def _ar_draft_runner(s: Setup) -> Runner:
    k = s.options.get("ar_draft_k")
    fixed = {} if k is None else {"k": k, "adaptive": False}
    proposer = ARDraftProposer(s.drafter(AR, "ar-draft"), s.model.args.vocab_size, max_len=s.model.args.max_seq_len,
                               **fixed)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=s.block_size),
                  block_size=s.block_size, ar_draft_k=k)


AR_DRAFT = register(Method("ar-draft", _ar_draft_runner, help="baseline: a small autoregressive drafter",
                           drafter_kind=AR.name, drafter_suffix="-ar", drafter_option="ar-drafter"))
