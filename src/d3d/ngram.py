"""Prompt-lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the last n tokens."""
from __future__ import annotations

from functools import partial

import torch

from .engine import generate
from .registry import Method, register


class NgramProposer:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 10):
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        k = min(k, self.max_draft)
        L = len(tokens)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = tokens[L - n:]
            for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow, None
        return [], None


NGRAM = register(Method(
    "ngram", lambda s: partial(generate, s.model, s.tokenizer, proposer=NgramProposer(), block_size=s.block_size),
    help="n-gram prompt lookup"))
