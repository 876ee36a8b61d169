"""The proposer protocol of the synchronous loop (d3d.decoding.engine.generate), as a base class.

Per generation: the engine sets `params` (the request's sampling settings, so a proposer may draft
greedily at temperature 0 and sample otherwise), then calls `reset(prompt_ids)` in the prefill phase,
timed into prefill_s as the target's prompt pass is: a drafter with a cache reads the prompt there, as
vLLM's draft models do, so that rounds feed only new tokens. Per round: `propose(tokens, k)` sees every
verified token (the last one is pending) and returns up to k drafts and, optionally, the distributions
[len(draft), V] they were sampled from (None: deterministic drafts, i.e. one-hot); after verification
`accept(draft, n)` says how many of them the target kept (the next round's text ends with the target's
own token after those n). A proposer that lists target layers in `hidden_layers` (DFlash) also gets
`observe(taps)`: the target's hidden states after those layers for every newly verified position,
prompt included, taken from the target's own passes.

The token-tree loop (d3d.decoding.tree) takes tree proposers instead: reset, build(tokens, k) -> TokenTree
and accepted(tree, path, drafted); d3d-async (d3d.decoding.async_engine) drives its drafter itself.
"""
from __future__ import annotations

import torch

from .verify import SamplingParams, draft_generator


class Proposer:
    name = ""
    hidden_layers: list[int] = []

    def __init__(self):
        self.params = SamplingParams()

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        raise NotImplementedError

    def accept(self, draft: list[int], n: int) -> None:
        pass

    def observe(self, taps: list[torch.Tensor]) -> None:
        pass


class DrafterProposer(Proposer):
    """A proposer over a learned drafter with a KV cache of the verified text (d3d.drafters): reset sets up
    its cache, reads the prompt and starts the drafter's own stream of randomness."""

    def __init__(self, drafter, vocab_size: int, max_len: int = 4096):
        super().__init__()
        self.drafter, self.vocab_size, self.max_len = drafter, vocab_size, max_len

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter.setup_cache(1, self.max_len)
        self.drafter.cached_tokens = []
        self.drafter.extend(prompt_ids)
        self.generator = draft_generator(self.params, self.drafter.draft_ids.device)
