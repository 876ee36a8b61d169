"""`d3d demo`: the best method against plain decoding on three built-in prompts (math, code, chat)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.kernels import runtime_info
from ..methods.catalog import BEST_METHOD, make_runner
from ..corpus.prompts import encode_prompt
from ..decoding.verify import SamplingParams

DEMO_PROMPTS = (
    ("math", "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May? Think step by step."),
    ("code", "Write a short Python function `is_palindrome(s)` that returns True if the string s reads the "
             "same forwards and backwards, ignoring case. Then show one example call."),
    ("chat", "What are three simple tips for getting better sleep?"),
)


def run_demo(model, tokenizer, model_dir: Path, max_new_tokens: int, method: str = BEST_METHOD) -> None:
    """Print each prompt's answer by `method`, its tau and tokens/s against `ar`, and whether the tokens
    are identical; then the mean speedup and tau."""
    ar = make_runner("ar", model, tokenizer, model_dir)
    best = make_runner(method, model, tokenizer, model_dir)
    params = SamplingParams()
    ran_on = runtime_info(getattr(model, "quantized", None) is not None)
    print(f"d3d demo: {method} vs plain autoregressive decoding (ar), greedy, "
          f"{max_new_tokens} new tokens, {torch.get_num_threads()} CPU threads on {ran_on['cpu']} "
          f"(kernels: {ran_on['kernels']})", flush=True)
    warm = encode_prompt(tokenizer, "Hello!")
    ar(warm, params=params, max_new_tokens=4)
    best(warm, params=params, max_new_tokens=4)

    speedups, taus = [], []
    for i, (kind, prompt) in enumerate(DEMO_PROMPTS, 1):
        ids = encode_prompt(tokenizer, prompt)
        a = ar(ids, params=params, max_new_tokens=max_new_tokens)
        b = best(ids, params=params, max_new_tokens=max_new_tokens)
        speedup = b.tokens_per_s / a.tokens_per_s if a.tokens_per_s > 0 else 0.0
        speedups.append(speedup)
        taus.append(b.tau)
        print(f"\n[{i}/{len(DEMO_PROMPTS)}] {kind}: {prompt}\n{'-' * 60}\n{b.text.strip()}\n{'-' * 60}")
        print(f"{method}: tau {b.tau:.2f}, {b.tokens_per_s:.1f} tok/s | ar: {a.tokens_per_s:.1f} tok/s | "
              f"speedup {speedup:.2f}x | identical to ar: {'yes' if a.token_ids == b.token_ids else 'NO'}",
              flush=True)
    print(f"\nsummary: {method} over {len(DEMO_PROMPTS)} prompts: mean speedup "
          f"{sum(speedups) / len(speedups):.2f}x, mean tau {sum(taus) / len(taus):.2f}")
