"""The proposer protocol: what every decoding loop asks of the method that drafts.

Per generation the loop sets `params` (the request's sampling settings, so a proposer may draft greedily
at temperature 0 and sample otherwise), then calls `reset(prompt_ids)` just before the target's prompt
pass, timed into prefill_s with it: a drafter with a cache reads the prompt there (as vLLM's draft models
do, so that rounds feed only new tokens), beside the target's pass if it has a thread of its own. Per
round, `propose(tokens, k)` sees every verified token (the last one is pending) and returns a draft at
most k deep; after verification `accept(draft, outcome)` says what the target kept. The draft is one of
two shapes, and each loop takes one:

- a chain (d3d.decoding.engine.generate): `propose` returns up to k tokens and, optionally, the
  distributions [len(draft), V] they were sampled from (None: deterministic drafts, i.e. one-hot);
  `accept(draft, n)` gets how many of them the target kept (the next round's text ends with the
  target's own token after those n). `ngram`, `d3d`, `d3d-async`, `ar-draft`, `dflash`, `draft-model`.
- a tree (d3d.decoding.tree.generate_tree): `propose` returns a TokenTree (d3d.decoding.tokentree: the
  draft's tokens with their parents, rooted at the pending token; a chain is the tree whose every
  parent is the node before) and `accept(tree, path)` gets the accepted path. `d3d-tree`, `lookup-tree`,
  `suffix`; a tree proposer also has a token `budget`.

A proposer that lists target layers in `hidden_layers` (DFlash) also gets `observe(taps)`: the target's
hidden states after those layers for every newly verified position, prompt included, taken from the
target's own passes.
"""
from __future__ import annotations

import torch

from .verify import SamplingParams, draft_generator


class Proposer:
    name = ""
    hidden_layers: list[int] = []
    sizes_drafts = False  # True: it cuts its own drafts to what pays (a cost model of its own), so the engine's
    # DraftLength (d3d.decoding.budget) leaves them alone in a batch

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
