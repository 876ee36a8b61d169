"""OpenAI-shaped bodies of d3d serve's completions: the whole answer, and the server-sent events of a
streamed one (with the `d3d` object per round that the web page draws; see the package docstring)."""
from __future__ import annotations

import json
import time

from .events import Done, Round
from .requests import FINISH


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: the prompt tokens not fed (prefix reuse)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def summary(res, method: str) -> dict:
    """The `d3d` object of a finished generation."""
    return {"method": method, "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 2),
            "rounds": res.rounds, "new_tokens": res.new_tokens, "finish_reason": res.finish_reason}


def completion_body(done: Done, rid: str, chat: bool, model: str, method: str, prompt_tokens: int) -> dict:
    """A whole (non-streamed) completion."""
    res = done.result
    choice = {"index": 0, "logprobs": done.logprobs, "finish_reason": FINISH.get(res.finish_reason, res.finish_reason)}
    choice |= {"message": {"role": "assistant", "content": res.text}} if chat else {"text": res.text}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, res.new_tokens, done.cached_tokens),
            "d3d": summary(res, method) | {"acceptance_lengths": res.acceptance_lengths}}


class StreamShaper:
    """The chunks of one streamed completion, and the running tau and tokens/s its rounds report (the
    prefill's token in neither, as everywhere in d3d)."""

    def __init__(self, rid: str, chat: bool, model: str):
        self.chat = chat
        self.base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.new_tokens, self.rounds, self.round_tokens, self.t_first = 0, 0, 0, None

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, logprobs=None, **extra) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            c = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self.base | {"choices": [c]} | extra

    def role(self) -> str:
        return sse(self.chunk(None, role=True))

    def round(self, ev: Round) -> str:
        self.new_tokens += len(ev.ids)
        if self.t_first is None:
            self.t_first = ev.t
        else:
            self.rounds, self.round_tokens = self.rounds + 1, self.round_tokens + ev.accepted + 1
        segments = [{"text": s, "draft": d} for s, d in ev.segments if s]
        info = {"accepted": ev.accepted, "tokens": ev.ids, "segments": segments, "new_tokens": self.new_tokens,
                "rounds": self.rounds,
                "tau": round(self.round_tokens / self.rounds, 4) if self.rounds else 1.0,
                "tokens_per_s": round((self.new_tokens - 1) / (ev.t - self.t_first), 2) if ev.t > self.t_first else 0.0,
                "prefill": self.rounds == 0}
        if ev.branch is not None:
            info["branch"] = ev.branch
        return sse(self.chunk("".join(s["text"] for s in segments), logprobs=ev.logprobs, d3d=info))

    def done(self, ev: Done, method: str, prompt_tokens: int, include_usage: bool) -> list[str]:
        res, out = ev.result, []
        if ev.tail:
            out.append(sse(self.chunk(ev.tail, d3d={"accepted": 0, "tokens": [],
                                                    "segments": [{"text": ev.tail, "draft": False}]})))
        out.append(sse(self.chunk(None, FINISH.get(res.finish_reason, res.finish_reason), d3d=summary(res, method))))
        if include_usage:
            out.append(sse(self.base | {"choices": [], "usage": usage(prompt_tokens, res.new_tokens, ev.cached_tokens)}))
        return out
