"""Request parsing for d3d serve: OpenAI request bodies -> GenRequest, or an ApiError with an OpenAI-style body."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fastapi.responses import JSONResponse

from ..api import Generator, check_messages
from ..errors import D3DError
from ..methods import registry
from ..decoding.verify import SamplingParams


STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_TOKENS = 512
MAX_BODY_BYTES = 4 << 20
MAX_STOP = 16
MAX_STOP_CHARS = 64  # the engine looks for stops in the last 32 tokens' text
MAX_TOP_LOGPROBS = 20
CHARS_PER_TOKEN = 16  # text over prompt-token cap x this many characters is refused before tokenizing
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length"}
API_PATHS = ("/v1/chat/completions", "/v1/completions")
# OpenAI parameters this server does not implement, with the values that mean "not used"
UNSUPPORTED = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
               "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
               "function_call": ("none",), "best_of": (1,), "echo": (False,), "suffix": ("",)}


class ApiError(Exception):
    """An error answered as an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or ({"Retry-After": "1"} if status == 503 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# ---------------------------------------------------------------------------------------------
# Request parsing


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool = True
    logprobs: int | None = None  # None: off; N: the chosen token's logprob and the N most likely


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise bad(f"'{key}' must be a number (got {json.dumps(v)})", key)
    if v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad(f"'{key}' must be in {rng} (got {v})", key)
    return float(v)


def _int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer (got {json.dumps(v)[:40]})", key)
    return v


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def decode_body(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"malformed JSON body: {_first_line(e)}") from None


def check_unsupported(body: dict) -> None:
    for key, unused in UNSUPPORTED.items():
        if body.get(key) is not None and body[key] not in unused:
            raise bad(f"'{key}' is not supported by this server", key, "unsupported_parameter")


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """The number of top logprobs asked for (0 = only the chosen token's), or None when not asked."""
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise bad("'logprobs' must be a boolean", "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        key, n = "top_logprobs", (top or 0) if want else None
    else:
        key, n = "logprobs", _int(body, "logprobs")
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad(f"'{key}' must be in [0, {MAX_TOP_LOGPROBS}] (got {n})", key)
    return n


def parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    try:
        "".join(stop).encode()
    except UnicodeEncodeError:
        raise bad("'stop' is not valid Unicode (lone surrogate)", "stop") from None
    return stop


def prompt_cap(gen: Generator, max_prompt_tokens: int | None = None) -> int:
    """The most prompt tokens a request may have: --max-prompt-tokens, at most what the context window
    leaves beside one block of new tokens."""
    room = gen.context_window - gen.block_size - 1
    return room if max_prompt_tokens is None else min(max_prompt_tokens, room)


def too_long(n: int, cap: int, param: str, unit: str = "tokens") -> ApiError:
    limit = cap if unit == "tokens" else cap * CHARS_PER_TOKEN
    return bad(f"prompt too long: {n} {unit}; the limit is {limit} {unit} (--max-prompt-tokens {cap}"
               + (f" x {CHARS_PER_TOKEN} characters per token, checked before tokenizing" if unit != "tokens" else "")
               + ")", param, "context_length_exceeded")


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's control-token strings (e.g. <|im_start|>), which its encoder turns into the real
    tokens wherever they appear in text."""
    names = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            names.add(str(tok))
    return sorted(n for n in names if n)


def check_special_tokens(messages: list[dict], tokenizer) -> None:
    """Refuse chat content that spells a control token: the chat template would pass it on as the real
    token, so a message could open a new turn with another role (prompt injection)."""
    names = special_tokens(tokenizer)
    for i, m in enumerate(messages):
        for name in names:
            if name in m["content"]:
                raise bad(f"messages[{i}].content contains the special token {name!r}, which chat content may "
                          "not spell (use /v1/completions to send a raw prompt)", "messages", "special_token")


def encode_prompt(body: dict, gen: Generator, chat: bool, cap: int | None = None) -> list[int]:
    """The prompt's token ids; every problem (tokenizer errors included) is an ApiError(400). cap: the
    most prompt tokens allowed (prompt_cap); text of over cap x CHARS_PER_TOKEN characters is refused
    before it is tokenized."""
    param = "messages" if chat else "prompt"
    cap = prompt_cap(gen) if cap is None else cap
    if chat:
        if "messages" not in body:
            raise bad("'messages' is required", "messages")
        try:
            prompt = check_messages(body["messages"])
        except D3DError as e:
            raise bad(str(e), "messages") from None
        chars = sum(len(m["content"]) for m in prompt)
        if chars > cap * CHARS_PER_TOKEN:
            raise too_long(chars, cap, param, "characters")
        check_special_tokens(prompt, gen.tokenizer)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = min(len(gen.tokenizer), gen.model.args.vocab_size)
            if len(prompt) > cap:
                raise too_long(len(prompt), cap, param)
            if not all(0 <= t < vocab for t in prompt):
                raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
            return list(prompt)
        if prompt is None:
            raise bad("'prompt' is required", "prompt")
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string (or a list of one string, or a list of token ids)", "prompt")
        if len(prompt) > cap * CHARS_PER_TOKEN:
            raise too_long(len(prompt), cap, param, "characters")
        if not prompt.strip():
            raise bad("empty prompt", "prompt")
    try:
        "".join(m["content"] for m in prompt).encode() if chat else prompt.encode()
    except UnicodeEncodeError:
        raise bad(f"'{param}' is not valid Unicode (lone surrogate)", param) from None
    try:
        return gen.encode(prompt, raw=not chat)
    except D3DError as e:
        raise bad(str(e), param) from None
    except Exception as e:  # the tokenizer's own errors, e.g. a lone surrogate in a string
        raise bad(f"cannot tokenize '{param}': {_first_line(e)}", param) from None


def parse_request(body, gen: Generator, chat: bool, max_prompt_tokens: int | None = None) -> GenRequest:
    """Validate an OpenAI-style request body; every problem is an ApiError(400). max_prompt_tokens: the
    prompt-token cap (None: what the context window allows)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("'model' must be a string", "model")
    check_unsupported(body)
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    logprobs = parse_logprobs(body, chat)
    info = registry.REGISTRY.get(gen.method)  # None for a runner built outside the registry
    if logprobs is not None and info is not None and not info.logprobs:
        raise bad(f"logprobs are not available with method {gen.method}", "logprobs")
    stop = parse_stop(body)
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k") or 0
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0 (got {top_k})", "top_k")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=_int(body, "seed"))
    except D3DError as e:
        raise bad(str(e), "seed" if "seed" in str(e) else None) from None
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key)
    if max_tokens is not None and max_tokens <= 0:
        raise bad(f"'{key}' must be > 0 (got {max_tokens})", key)

    cap = prompt_cap(gen, max_prompt_tokens)
    prompt_ids = encode_prompt(body, gen, chat, cap)
    if not prompt_ids:
        raise bad("empty prompt", "messages" if chat else "prompt")
    if len(prompt_ids) > cap:
        raise too_long(len(prompt_ids), cap, "messages" if chat else "prompt")
    room = gen.context_window - len(prompt_ids) - gen.block_size
    if room <= 0:
        raise bad(f"prompt too long: {len(prompt_ids)} tokens leave no room in the context window "
                  f"({gen.context_window} tokens)", "messages" if chat else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    try:
        gen.check(prompt_ids, max_tokens)
    except D3DError as e:
        raise bad(f"'{key}' too large: {e}", key, "context_length_exceeded") from None
    return GenRequest(prompt_ids, params, max_tokens, stop, stream, bool(opts.get("include_usage", False)), chat,
                      logprobs)


# ---------------------------------------------------------------------------------------------
# Incremental text
