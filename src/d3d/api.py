"""The Python API: `from d3d import load; gen = load(); print(gen.generate("Hello!"))`.

`load` reads the target once (and the drafter, for drafter-based methods); the returned `Generator`
answers prompts one at a time (a lock serialises callers from several threads, since the target's KV
cache is shared). The server (d3d.server) drives the same object. With `learn` (the default), the tree
methods (lookup-tree, d3d-tree) and suffix also draft from the Generator's own earlier answers (bounded:
`learn_tokens`, for suffix a number of answers; `Generator.forget()` empties it); the output is the
target's either way.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch

from .decoding.engine import GenerationResult, LogprobRecorder, validate_request
from .errors import D3DError
from .runtime.loading import load_target
from .methods.catalog import best_method, check_quantize, check_quantize_drafter, make_runner, parse_methods
from .methods.registry import REGISTRY, check_method_options, get
from .corpus.prompts import encode_prompt
from .decoding.verify import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict]:
    """Chat messages as the tokenizer's chat template wants them: a non-empty list of
    {"role": system|user|assistant, "content": str}; OpenAI-style content lists of text parts are joined.
    Raises D3DError with a message naming the offending field."""
    if not isinstance(messages, list):
        raise D3DError("'messages' must be a list of {role, content} objects")
    if not messages:
        raise D3DError("'messages' must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise D3DError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise D3DError(f"messages[{i}].role: unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise D3DError(f"messages[{i}].content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise D3DError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise D3DError("empty prompt: every message is empty")
    return out


class Generator:
    """One target + one decoding method. Build it with `load()`."""

    def __init__(self, model, tokenizer, model_dir: Path, method: str, runner: Callable[..., GenerationResult],
                 block_size: int = 16, build_runner: Callable | None = None):
        self.model, self.tokenizer, self.model_dir = model, tokenizer, Path(model_dir)
        self.method, self.runner, self.block_size = method, runner, block_size
        self.build_runner = build_runner  # model -> a runner of the same method and options (on_slots)
        self._lock = threading.Lock()

    @property
    def batches(self) -> bool:
        """Whether this method can run on batch slots (Method.batches; on_slots)."""
        info = REGISTRY.get(self.method)
        return self.build_runner is not None and info is not None and info.batches

    def on_slots(self, slots: list) -> list["Generator"]:
        """A Generator per batch slot (d3d.scheduler.SlotModel), each with a runner of its own built like this
        one's (the same method and options): concurrent generations on one batched target."""
        if not self.batches:
            raise D3DError(f"method {self.method} does not run batched")
        return [Generator(slot, self.tokenizer, self.model_dir, self.method, self.build_runner(slot), self.block_size)
                for slot in slots]

    @property
    def name(self) -> str:
        """The model's name (its folder), as served in /v1/models."""
        return self.model_dir.name

    @property
    def context_window(self) -> int:
        return self.model.args.max_seq_len

    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Token ids of a prompt: a string goes through the chat template as one user message (unless
        `raw`); a list of chat messages is checked (check_messages) and goes through the chat template whole."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise D3DError("empty prompt")
        else:
            if raw:
                raise D3DError("raw=True takes a string prompt, not chat messages")
            prompt = check_messages(prompt)
        return encode_prompt(self.tokenizer, prompt, raw, sep="\n")

    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Raise D3DError if the request cannot run (empty, max_new_tokens <= 0, context overflow)."""
        validate_request(self.model, prompt_ids, max_new_tokens, self.block_size)

    def run(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
            stop: list[str] | None = None, on_round=None, logprobs: LogprobRecorder | None = None,
            on_branch=None, prefill_check=None) -> GenerationResult:
        """Generate from token ids (serialised: one generation at a time). logprobs: a LogprobRecorder to
        record every emitted token's target logprobs in (res.logprobs; D3DError if the method cannot).
        on_branch(branch): with the tree methods, each round's accepted branch, before on_round (else never).
        prefill_check(): with the methods on a runtime of their own (Method.own_prefill), called before each
        slice of the prompt's pass; it raises to stop (d3d serve's cancel and deadline)."""
        self.check(prompt_ids, max_new_tokens)
        info = REGISTRY.get(self.method)  # None for a runner built outside the registry
        if logprobs is not None and info is not None and not info.logprobs:
            raise D3DError(f"method {self.method} does not report logprobs")
        extra = {} if logprobs is None else {"logprobs": logprobs}
        if on_branch is not None and info is not None and info.branches:
            extra["on_branch"] = on_branch
        if prefill_check is not None and info is not None and info.own_prefill:
            extra["prefill_check"] = prefill_check
        with self._lock:
            return self.runner(prompt_ids, params=params, max_new_tokens=max_new_tokens, stop=stop or None,
                               on_round=on_round, **extra)

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
                 raw: bool = False, top_k: int = 0, return_result: bool = False, on_round=None):
        """The answer's text (a str), or the whole GenerationResult with `return_result=True` (token_ids,
        acceptance_lengths, tau, tokens_per_s, finish_reason, text, ...).

        prompt: a user message (through the chat template unless `raw`) or a list of chat messages.
        temperature 0 = greedy (exactly the target's own output); stop: string(s) that end the answer
        (not included); on_round(chunk_token_ids, accepted_drafts) is called after every round.
        """
        params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed)
        if isinstance(stop, str):
            stop = [stop]
        res = self.run(self.encode(prompt, raw), params, max_new_tokens, stop, on_round)
        return res if return_result else res.text

    __call__ = generate

    def forget(self) -> bool:
        """Drop what the method learned from this Generator's earlier generations (lookup-tree, d3d-tree
        and suffix with learning on); False if it learns nothing."""
        from .bench.harness import forget_history

        with self._lock:
            return forget_history(self.runner)

    def __repr__(self) -> str:
        return f"Generator(model={self.name!r}, method={self.method!r})"


def load(target: str | None = None, method: str | None = None, drafter: str | None = None,
         threads: int | None = None, device: str = "cpu", block_size: int = 16,
         quantize: str | None = None, compile: bool = False, quantize_drafter: str | None = None,
         tree_budget: int | None = None, datastore: str | None = None, ar_draft_k: int | None = None,
         draft_k: int | None = None, learn: bool | None = True, learn_tokens: int | None = None) -> Generator:
    """Load a target and a decoding method; returns a Generator (see Generator.generate).

    target: a Hugging Face model folder or .gguf file (None = the embedded SmolLM2-135M-Instruct);
    method: a registered method name (d3d.methods.registry; default: the target's best_method); drafter: checkpoint for drafter-based
    methods (None = the one shipped for the target), for draft-model the draft model (a known name, a HF
    folder or a .gguf file with the target's tokenizer); threads: torch CPU threads (None = leave torch's
    setting alone; it is process-wide); quantize: None (fp32) or "int8" (target and drafter);
    compile: compile the target's forward passes (fastpath.compile_decode; fp32 CPU; 1-2 minutes);
    quantize_drafter: "int8" for an int8 drafter whatever the target's precision (the output is the
    target's either way; None: the drafter follows `quantize`); tree_budget, datastore, ar_draft_k, draft_k:
    the methods' options, as `--tree-budget`, `--datastore PATH|none`, `--ar-draft-k` and `--draft-k` (None:
    fitted to this device; the shipped datastore; adaptive); learn: the tree methods and suffix also draft
    from this Generator's own earlier answers (False: only the datastore and the prompt, as `--no-learn`),
    the tree methods keeping at most `learn_tokens` tokens of them (None: d3d.corpus.learned.LEARN_TOKENS, oldest
    dropped first; suffix keeps its last SUFFIX_DEFAULTS["max_cached_requests"] answers)."""
    methods = parse_methods(method or best_method(target))
    if len(methods) != 1:
        raise D3DError("load takes exactly one method")
    if threads is not None:
        if threads < 1:
            raise D3DError(f"threads must be >= 1 (got {threads})")
        torch.set_num_threads(threads)
    get(methods[0]).check_drafter(drafter, target)
    options = check_method_options({"tree_budget": tree_budget, "ar_draft_k": ar_draft_k, "draft_k": draft_k,
                                    "datastore": datastore})
    if learn_tokens is not None and learn_tokens < 2:
        raise D3DError(f"learn_tokens must be >= 2 (got {learn_tokens})")
    options |= {"learn": learn is not False, "learn_tokens": learn_tokens}  # None (the CLI's default): on
    check_quantize_drafter(quantize_drafter, methods)
    check_quantize(quantize, methods)
    model, tok, model_dir = load_target(target, device, quantize=quantize, compile=compile)
    def build(m):
        return make_runner(methods[0], m, tok, model_dir, drafter=drafter, block_size=block_size,
                           quantize_drafter=quantize_drafter, **options)

    runner = build(model)
    return Generator(model, tok, model_dir, methods[0], runner, runner.settings["block_size"], build)
