"""Streamed text and logprobs for d3d serve: text deltas linear in the text, stop strings held back."""
from __future__ import annotations

from ..decoding.engine import TokenLogprob


def _prefix_function(s: str) -> list[int]:
    """KMP: pi[i] = length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


def _overlap(text: str, s: str, pi: list[int]) -> int:
    """The longest k < len(s) such that text ends with s[:k], in O(len(s))."""
    k = 0
    for c in text[len(text) - len(s) + 1:] if len(s) > 1 else "":
        while k and c != s[k]:
            k = pi[k - 1]
        if c == s[k]:
            k += 1
    return k


class TextStreamer:
    """Turns rounds of token ids into text deltas whose concatenation is exactly the final text: EOS
    dropped, cut before the first stop string; text that might still become a stop string, or is an
    incomplete UTF-8 character, is held back until it is certain. Each push costs O(new tokens + total
    stop length): tokens are decoded in a small sliding window and stops searched only in new text."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.pi = [_prefix_function(s) for s in stop]
        self.longest = max(map(len, stop), default=1)
        self.eos = {tokenizer.eos_token_id}
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to the last piece already in self.text
        self.text = ""  # decoded so far (up to the stop, if one was found)
        self.emitted = 0
        self.cut = False

    def _decode_new(self, final: bool) -> str:
        head = self.tokenizer.decode(self.ids[self.prefix:self.read])
        whole = self.tokenizer.decode(self.ids[self.prefix:])
        if len(whole) <= len(head) or (whole.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return whole[len(head):]

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.cut:
            return ""
        self.ids += [t for t in ids if t not in self.eos]
        start = max(0, len(self.text) - self.longest + 1)
        self.text += self._decode_new(final)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.cut = self.text[:min(hits)], True
        end = len(self.text)
        if not (final or self.cut):
            end -= max((_overlap(self.text, s, pi) for s, pi in zip(self.stop, self.pi)), default=0)
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted += len(delta)
        return delta


class LogprobFormatter:
    """OpenAI `logprobs` objects from TokenLogprob entries: chat ({"content": [...]}) or legacy
    completions ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}). EOS is left out."""

    def __init__(self, tokenizer, chat: bool, top: int):
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.eos = tokenizer.eos_token_id
        self.pieces: dict[int, str] = {}
        self.offset = 0

    def piece(self, token: int) -> str:
        if token not in self.pieces:
            self.pieces[token] = self.tokenizer.decode([token])
        return self.pieces[token]

    def _entry(self, token: int, logprob: float) -> dict:
        p = self.piece(token)
        return {"token": p, "logprob": logprob, "bytes": list(p.encode("utf-8", "replace"))}

    def format(self, entries: list[TokenLogprob]) -> dict:
        entries = [e for e in entries if e.token != self.eos]
        if self.chat:
            return {"content": [self._entry(e.token, e.logprob) | {"top_logprobs": [self._entry(*t) for t in e.top]}
                                for e in entries], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if self.top else None, "text_offset": []}
        for e in entries:
            out["tokens"].append(self.piece(e.token))
            out["token_logprobs"].append(e.logprob)
            out["text_offset"].append(self.offset)
            self.offset += len(self.piece(e.token))
            if self.top:
                out["top_logprobs"].append({self.piece(t): lp for t, lp in e.top})
        return out


# ---------------------------------------------------------------------------------------------
# The generation worker
