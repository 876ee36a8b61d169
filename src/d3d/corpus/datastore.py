"""Retrieval from the target's own outputs: what followed the text's last tokens in the distillation data.

The distillation data (d3d.corpus.data) holds the target's greedy responses to about 10k training prompts. A
greedy target repeats itself across prompts (the same openings, the same step-by-step phrasing, the same
code idioms), so where the text's last few tokens occurred in those responses, what followed them there
is a good guess for what the target says next (REST, He et al. 2023, with a datastore of the target's
own text rather than someone else's). A lookup is a binary search in a suffix-sorted index plus a few
array operations over the matches, well under a millisecond on a CPU, and needs no model.

Layout of a datastore file (`d3d datastore` writes it, numpy .npz):
  tokens      uint16 (uint32 for vocabularies over 65535) token ids, examples separated by SEP
  vocab_size  the target's vocabulary size (fixes the packing of keys, see below)
  meta        JSON: the data it was built from and the command
The index is rebuilt on load (one argsort, about 0.3 s for 2M tokens): position i's key packs tokens
i, i-1, ..., i-n+1 into one uint64, latest token in the highest bits, so the positions whose last m <= n
tokens equal the text's last m tokens form one contiguous range of the sorted keys.
"""
from __future__ import annotations

import io
import json
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .data import load_dataset
from ..atomic import atomic_write_bytes
from ..errors import D3DError, first_line

PROMPT_TAIL = 16     # prompt tokens kept before each response (the chat template's assistant header)
MAX_MATCHES = 64     # matched positions examined per lookup (the last in index order: the latest on a full key)
MAX_MATCH_LEN = 16   # a match is extended backwards up to this many tokens
SHIPPED = Path(__file__).parent.parent / "assets" / "datastores"


@dataclass
class Continuation:
    """One retrieved continuation: its tokens, the length of the context match it came from, and per
    token the share of the matches (still agreeing up to it) that continued with it."""

    tokens: list[int]
    match_len: int
    shares: list[float]
    counts: list[int] = field(default_factory=list)  # per token: the matches still agreeing up to it


def key_layout(vocab_size: int) -> tuple[int, int, int]:
    """(bits per token, SEP, tokens per uint64 key) for a vocabulary: 2**bits - 1 >= vocab_size, so SEP,
    the all-ones id, is never a token."""
    bits = int(vocab_size).bit_length()
    n_key = 64 // bits
    if n_key < 1:
        raise D3DError(f"vocabulary of {vocab_size} tokens is too large for a datastore key")
    return bits, (1 << bits) - 1, n_key


class Retrieval:
    """The lookup shared by Datastore and LearnedStore. A subclass has `tokens` (its token array, SEP
    between examples, at least MAX_MATCH_LEN + 1 SEPs after the last token), `sep`, `n_key`, and
    `_matches(text)`: (positions whose last m tokens equal the text's last m, for the largest m that has
    any, at most MAX_MATCHES of them; m) or None."""

    tokens: np.ndarray
    sep: int
    n_key: int

    def _matches(self, text: list[int]) -> tuple[np.ndarray, int] | None:
        raise NotImplementedError

    def lookup(self, text: list[int], k: int, branches: int = 2) -> list[Continuation]:
        """Up to `branches` continuations (at most k <= MAX_MATCH_LEN + 1 tokens each) of the text's longest
        suffix found in the store: the first token's `branches` most frequent choices among the longest
        matches, each followed by the most frequent path among the matches that agree with it so far."""
        k = min(k, MAX_MATCH_LEN + 1)  # the padding after the last example
        if k < 1 or not text:
            return []
        if any(t >= self.sep or t < 0 for t in text[-min(self.n_key, len(text)):]):
            return []
        found = self._matches(text)
        if found is None:
            return []
        pos, m = found
        match = np.full(len(pos), m)
        span = min(MAX_MATCH_LEN, len(text)) - m if m == self.n_key else 0
        if span > 0:  # extend the matches backwards: the count of leading agreements before the key
            back = self.tokens[np.maximum(pos[:, None] - np.arange(m, m + span), 0)]
            back[pos[:, None] - np.arange(m, m + span) < 0] = -1
            agree = back == np.asarray(text[-1 - m:-1 - m - span:-1] if m + span < len(text) else text[-1 - m::-1])
            match += np.where(agree.all(1), span, agree.argmin(1))
        best = int(match.max())
        follow = self.tokens[pos[match == best][:, None] + 1 + np.arange(k)].tolist()
        firsts = Counter(row[0] for row in follow)
        out = []
        for first, count in firsts.most_common(branches):
            if first == self.sep:
                continue
            rows = [row for row in follow if row[0] == first]
            toks, shares, counts = [first], [count / len(follow)], [count]
            for d in range(1, k):
                if len(rows) == 1:  # one match left: the rest of its row (the usual case after a few tokens)
                    rest = rows[0][d:]
                    rest = rest[:rest.index(self.sep)] if self.sep in rest else rest
                    toks += rest
                    shares += [1.0] * len(rest)
                    counts += [1] * len(rest)
                    break
                token, c = Counter(row[d] for row in rows).most_common(1)[0]
                if token == self.sep:
                    break
                toks.append(token)
                shares.append(c / len(rows))
                counts.append(c)
                rows = [row for row in rows if row[d] == token]
            out.append(Continuation(toks, best, shares, counts))
        return out


class Datastore(Retrieval):
    """A token array of the target's outputs with a suffix index for continuation lookups."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, meta: dict | None = None):
        self.bits, self.sep, self.n_key = key_layout(vocab_size)
        self.vocab_size, self.meta = int(vocab_size), meta or {}
        tail = np.full(MAX_MATCH_LEN + 1, self.sep, dtype=np.int64)  # lookups read past the end
        self.tokens = np.concatenate([tokens, tail]).astype(np.int32)
        n = len(tokens)
        padded = np.concatenate([np.full(self.n_key - 1, self.sep, dtype=np.uint64), tokens.astype(np.uint64)])
        keys = np.zeros(n, dtype=np.uint64)
        for j in range(self.n_key):  # token i - j goes to bits [64 - bits * (j + 1), 64 - bits * j)
            shift = np.uint64(64 - self.bits * (j + 1))
            keys |= padded[self.n_key - 1 - j:self.n_key - 1 - j + n] << shift
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def __len__(self) -> int:
        return len(self.tokens) - MAX_MATCH_LEN - 1

    def _range(self, suffix: list[int]) -> tuple[int, int]:
        lo = 0
        for j, t in enumerate(reversed(suffix)):
            lo |= int(t) << (64 - self.bits * (j + 1))
        hi = lo | ((1 << (64 - self.bits * len(suffix))) - 1)
        return (int(np.searchsorted(self.keys, np.uint64(lo), "left")),
                int(np.searchsorted(self.keys, np.uint64(hi), "right")))

    def _matches(self, text: list[int]) -> tuple[np.ndarray, int] | None:
        for m in range(min(self.n_key, len(text)), 0, -1):
            a, b = self._range(text[-m:])
            if b > a:  # the last MAX_MATCHES in index order: the latest on a full key
                return self.order[a:b][-MAX_MATCHES:], m
        return None


def separator(vocab_size: int) -> int:
    """SEP, the id that ends every example in a datastore: all ones, just above the vocabulary."""
    return (1 << int(vocab_size).bit_length()) - 1


def example_tokens(examples: list, vocab_size: int) -> np.ndarray:
    """The datastore's token array for `examples`: per example the last PROMPT_TAIL prompt tokens and the
    whole response, examples separated by SEP (the all-ones id just above the vocabulary)."""
    sep = separator(vocab_size)
    return np.concatenate([np.asarray(e.prompt_ids[-PROMPT_TAIL:] + e.response_ids + [sep], dtype=np.int64)
                           for e in examples])


def build_datastore(data: str | Path, vocab_size: int, max_shards: int | None = None,
                    extra: list[str | Path] = ()) -> tuple[np.ndarray, dict]:
    """The token array (example_tokens) of a distillation dataset (its first `max_shards` shards, then every
    shard of each `extra` dataset), checked against the vocabulary, and its meta."""
    examples = load_dataset(data, max_shards) + [e for x in extra for e in load_dataset(x)]
    if not examples:
        raise D3DError(f"{data} holds no examples")
    tokens = example_tokens(examples, vocab_size)
    sep = separator(vocab_size)
    if tokens[tokens != sep].max(initial=0) >= vocab_size:
        raise D3DError(f"{data} holds token ids >= the vocabulary size {vocab_size}: built for another target?")
    meta = {"data": str(data), "examples": len(examples), "tokens": int(len(tokens)),
            "response_tokens": sum(len(e.response_ids) for e in examples), "max_shards": max_shards}
    if extra:
        meta["extra_data"] = [str(x) for x in extra]
    return tokens, meta


def save_datastore(path: str | Path, tokens: np.ndarray, vocab_size: int, meta: dict) -> None:
    dtype = np.uint16 if vocab_size < (1 << 16) else np.uint32
    sep = separator(vocab_size)
    stored = np.where(tokens == sep, np.iinfo(dtype).max, tokens).astype(dtype)
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=stored, vocab_size=np.int64(vocab_size), meta=np.array(json.dumps(meta)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), buf.getvalue())


def load_datastore(path: str | Path, vocab_size: int | None = None) -> Datastore:
    """A datastore file, checked against the target's vocabulary size when given."""
    path = Path(path)
    if not path.is_file():
        raise D3DError(f"no datastore at {path}; build one with `d3d datastore --data DIR --out {path}`")
    try:
        z = np.load(path)
        stored, size, meta = z["tokens"], int(z["vocab_size"]), json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise D3DError(f"{path} is not a d3d datastore, or is truncated ({first_line(e)})") from None
    if vocab_size is not None and size != vocab_size:
        raise D3DError(f"{path} was built for a vocabulary of {size} tokens; the target has {vocab_size}")
    sep = separator(size)
    tokens = stored.astype(np.int64)
    tokens[stored == np.iinfo(stored.dtype).max] = sep
    return Datastore(tokens, size, meta | {"file": str(path)})


def shipped_datastore(model_dir: str | Path) -> Path | None:
    """The datastore shipped for a target (by the target folder's name), if any."""
    path = SHIPPED / f"{Path(model_dir).name}.npz"
    return path if path.is_file() else None
