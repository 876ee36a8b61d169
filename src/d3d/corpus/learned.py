"""A LearnedStore: d3d.corpus.datastore's retrieval over what the target has generated since the store was
created (a method runner's lifetime: one `d3d bench` run of a method, a server, a `d3d.load` Generator): every finished
generation's last prompt tokens and response join it at once, incrementally (the keys of the new tokens
only; a lookup scans the keys in position order, so the latest matches are the ones examined), and the
oldest generations leave it first once it holds more than `max_tokens` tokens (FIFO), so its memory
stays bounded (12 bytes a token: 0.8 MB for the default LEARN_TOKENS).
"""
from __future__ import annotations

import numpy as np

from ..errors import D3DError
from .datastore import MAX_MATCH_LEN, MAX_MATCHES, PROMPT_TAIL, Retrieval, key_layout

LEARN_TOKENS = 1 << 16  # tokens a LearnedStore holds by default (the oldest generations leave first)


class LearnedStore(Retrieval):
    """Retrieval from what the target generated since the store was created (see the module doc): `add`
    each finished generation, `lookup` as a Datastore's, `forget` to empty it. At most `max_tokens`
    tokens (SEPs included) are kept: the oldest generations leave first, and a generation longer than
    that keeps its last `max_tokens` tokens."""

    def __init__(self, vocab_size: int, max_tokens: int = LEARN_TOKENS):
        if max_tokens < 2:
            raise D3DError(f"a learned store must hold at least 2 tokens (got {max_tokens})")
        self.bits, self.sep, self.n_key = key_layout(vocab_size)
        self.vocab_size, self.max_tokens = int(vocab_size), int(max_tokens)
        self.generations = 0  # added since creation (or the last forget), evicted ones included
        self.forget()

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes held by its arrays (bounded: at most 12 * (max_tokens + MAX_MATCH_LEN + 1) after growth)."""
        return self.tokens.nbytes + self.keys.nbytes

    def forget(self) -> None:
        """Drop everything learned."""
        self.n, self.starts, self.generations = 0, [], 0  # starts: each kept generation's first position
        self._alloc(0)

    def _alloc(self, capacity: int) -> None:
        """Arrays for `capacity` tokens (and the SEP tail lookups read past the end), keeping the first n."""
        size = capacity + MAX_MATCH_LEN + 1
        tokens, keys = np.full(size, self.sep, dtype=np.int32), np.zeros(size, dtype=np.uint64)
        if self.n and hasattr(self, "tokens"):
            tokens[:self.n], keys[:self.n] = self.tokens[:self.n], self.keys[:self.n]
        self.tokens, self.keys = tokens, keys

    def add(self, prompt_ids: list[int], response_ids: list[int]) -> None:
        """Learn one finished generation: the prompt's last PROMPT_TAIL tokens (the chat template's
        assistant header) and the whole response, then SEP, as example_tokens lays out a datastore's."""
        if not response_ids:
            return
        new = [int(t) for t in list(prompt_ids)[-PROMPT_TAIL:] + list(response_ids)]
        if any(t < 0 or t >= self.vocab_size for t in new):
            raise D3DError(f"token ids outside the vocabulary of {self.vocab_size} cannot be learned")
        new = (new + [self.sep])[-self.max_tokens:]
        self.generations += 1
        drop = 0
        while self.starts and self.n - drop + len(new) > self.max_tokens:  # FIFO: whole generations
            self.starts.pop(0)
            drop = self.starts[0] if self.starts else self.n
        if drop:
            self.tokens[:self.n - drop] = self.tokens[drop:self.n].copy()
            self.keys[:self.n - drop] = self.keys[drop:self.n].copy()
            self.tokens[self.n - drop:self.n] = self.sep
            self.n -= drop
            self.starts = [p - drop for p in self.starts]
        if self.n + len(new) > len(self.tokens) - MAX_MATCH_LEN - 1:  # grow geometrically, up to the cap
            self._alloc(min(self.max_tokens, max(2 * (len(self.tokens) - MAX_MATCH_LEN - 1), self.n + len(new),
                                                 1024)))
        start, end = self.n, self.n + len(new)
        self.tokens[start:end] = new
        lo = max(0, start - (self.n_key - 1))  # the key of a new token holds up to n_key - 1 tokens before it
        window = np.concatenate([np.full(self.n_key - 1 - (start - lo), self.sep, dtype=np.int64),
                                 self.tokens[lo:end].astype(np.int64)])
        keys = np.zeros(len(new), dtype=np.uint64)
        for j in range(self.n_key):  # as Datastore's keys: token i - j in bits [64 - bits * (j + 1), 64 - bits * j)
            keys |= window[self.n_key - 1 - j:self.n_key - 1 - j + len(new)].astype(np.uint64) \
                << np.uint64(64 - self.bits * (j + 1))
        self.keys[start:end] = keys
        self.starts.append(start)
        self.n = end

    def _matches(self, text: list[int]) -> tuple[np.ndarray, int] | None:
        if not self.n:
            return None
        m_max = min(self.n_key, len(text))
        target = 0
        for j, t in enumerate(reversed(text[-m_max:])):
            target |= int(t) << (64 - self.bits * (j + 1))
        cand = np.flatnonzero(self.tokens[:self.n] == text[-1])  # the last token matches: one int32 pass
        if not len(cand):
            return None
        diff = self.keys[cand] ^ np.uint64(target)
        for m in range(m_max, 0, -1):
            hit = cand[diff >> np.uint64(64 - self.bits * m) == 0]
            if len(hit):
                return hit[-MAX_MATCHES:], m  # positions in order: the latest generations' matches
        return None
