"""The reference methods `hf` and `hf-lookup`: transformers' own `generate`, plain and with prompt-lookup
assisted generation.

The reference methods are what a user would run without d3d, on the same weights and prompts. Each
target forward is observed with hooks: the first one is the prefill (its end splits prefill from decode
time), and the cache length at the start of every later forward gives each round's acceptance length,
so tau is measured the same way as for our methods.
"""
from __future__ import annotations

import time

import torch

from ..decoding.engine import PREFILL_CHUNK, GenerationResult, LogprobRecorder, check_stop, sync_device
from ..runtime.hf import load_hf_model
from .registry import Method, register
from ..decoding.verify import SamplingParams

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
MAX_MATCHING_NGRAM = 2     # transformers' default


class HFRunner:
    """runner(prompt_ids, params=..., max_new_tokens=..., stop=...) -> GenerationResult via model.generate."""

    def __init__(self, model, tokenizer, prompt_lookup: bool):
        self.model, self.tokenizer, self.prompt_lookup = model, tokenizer, prompt_lookup
        self.starts: list[int] = []
        self.ends: list[float] = []
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(lambda *_: self.ends.append(time.perf_counter()))

    def _pre(self, module, args, kwargs):
        """Record the position of the first token this forward feeds (= tokens already cached)."""
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        if pos is not None:
            self.starts.append(int(pos.reshape(-1)[0]))
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.starts.append(cache.get_seq_length() if cache is not None else 0)

    @torch.no_grad()
    def __call__(self, prompt_ids: list[int], params: SamplingParams | None = None, max_new_tokens: int = 128,
                 stop: list[str] | None = None, on_round=None, logprobs: LogprobRecorder | None = None,
                 prefill_check=None) -> GenerationResult:
        """prefill_check(): called before each PREFILL_CHUNK-token slice of the prompt; it raises to stop."""
        params, stop = params or SamplingParams(), check_stop(stop)
        kw = {"max_new_tokens": max_new_tokens, "pad_token_id": self.tokenizer.eos_token_id}
        if params.greedy:
            kw |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        else:
            kw |= {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                   "top_k": params.top_k or None}
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if self.prompt_lookup:
            kw |= {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "max_matching_ngram_size": MAX_MATCHING_NGRAM}
        if stop:
            kw |= {"stop_strings": stop, "tokenizer": self.tokenizer}
        if logprobs is not None:  # the raw logits of each new token, before any sampling processor
            kw |= {"output_logits": True, "return_dict_in_generate": True}
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt_ids], device=device)
        t0 = time.perf_counter()
        if prefill_check is not None:
            kw["cache"] = self._prefill_in_slices(ids[:, :-1], prefill_check)
        self.starts, self.ends = [], []  # generate's own forwards: the first ends the prefill
        out = self.model.generate(ids, **kw)
        sync_device(device)
        t1 = time.perf_counter()
        if logprobs is not None:
            out, rows = out.sequences, torch.cat(out.logits)
        ids = out[0, len(prompt_ids):].tolist()
        res = GenerationResult(prompt_ids=list(prompt_ids), token_ids=ids, prefill_s=self.ends[0] - t0,
                               decode_s=t1 - self.ends[0], text=self.tokenizer.decode(ids, skip_special_tokens=True))
        res.finish_reason = "eos" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
        # round i starts where the cache ends; the last round verified up to the final token
        starts = self.starts[1:] + [len(prompt_ids) + len(ids) - 1]
        res.acceptance_lengths = [b - a for a, b in zip(starts, starts[1:]) if b > a]
        if logprobs is not None:
            logprobs.add(rows, ids)
            res.logprobs = logprobs.entries
        if on_round is not None:  # transformers gives no per-round hook here: one chunk at the end
            on_round(ids, max(0, len(ids) - 1 - len(res.acceptance_lengths)))
        return res

    def _prefill_in_slices(self, ids: torch.Tensor, check):
        """A cache holding `ids`, filled a slice at a time with check() before each; generate() then runs
        only the rest of the prompt (it starts from the cache's length)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for a in range(0, ids.shape[1], PREFILL_CHUNK):
            check()
            self.model(input_ids=ids[:, a:a + PREFILL_CHUNK], cache=cache, use_cache=True)
        check()
        return cache


HF = register(Method("hf", lambda s: HFRunner(load_hf_model(s.model_dir, s.device), s.tokenizer, prompt_lookup=False),
                     help="reference: transformers' generate", own_prefill=True))
HF_LOOKUP = register(Method(
    "hf-lookup", lambda s: HFRunner(load_hf_model(s.model_dir, s.device), s.tokenizer, prompt_lookup=True),
    help="reference: transformers' prompt-lookup assisted generation", own_prefill=True))
