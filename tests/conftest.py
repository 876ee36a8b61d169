"""Shared fixtures: the real default target (loaded once per session) and a few real prompts."""
from __future__ import annotations

import os

import pytest
import torch

from d3d.decoding.engine import generate
from d3d.runtime.loading import load_target
from d3d.corpus.prompts import benchmark_prompts, encode_prompt
from helpers import tiny_model

CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer, model_dir) of the embedded default target, SmolLM2-135M-Instruct in fp32.

    One thread by default: on a shared 2-core machine a second torch thread waits for a busy core at every
    op (measured: a 6-token forward takes 2-3 s with 2 threads vs 0.13 s with 1 while another job runs).
    D3D_TEST_THREADS overrides it."""
    torch.set_num_threads(int(os.environ.get("D3D_TEST_THREADS", "1")))
    return load_target(None)


def pytest_collection_modifyitems(items):
    """Every test that loads the real default target (the smol fixture, directly or through another) is slow."""
    for item in items:
        if "smol" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


def real_prompts(tokenizer, n_gsm8k: int = 5) -> list[list[int]]:
    """Chat-templated token ids of the first `n_gsm8k` GSM8K test questions, then CHAT_PROMPTS."""
    texts = benchmark_prompts("gsm8k", n_gsm8k) + CHAT_PROMPTS
    return [encode_prompt(tokenizer, t) for t in texts]


@pytest.fixture(scope="session")
def prompt_ids(smol) -> list[list[int]]:
    return real_prompts(smol[1])


@pytest.fixture(scope="session")
def short_answer_ids(smol) -> list[int]:
    """A prompt the default target answers in about 8 tokens, ending with EOS."""
    return encode_prompt(smol[1], "What is the capital of France? Answer briefly.")


AR_TOKENS = 64


@pytest.fixture(scope="session")
def ar_tokens(smol):
    """(prompt ids, n) -> the first n tokens of plain greedy decoding of the default target in fp32: one
    AR_TOKENS-token run per prompt, shared by every test of the worker (greedy decoding's first n tokens are
    those of any longer run of the same runtime; test_lossless checks it)."""
    model, tok, _ = smol
    memo: dict[tuple[int, ...], list[int]] = {}

    def tokens(ids: list[int], n: int) -> list[int]:
        assert n <= AR_TOKENS, f"ar_tokens holds {AR_TOKENS} tokens per prompt, not {n}"
        if tuple(ids) not in memo:
            memo[tuple(ids)] = generate(model, tok, ids, max_new_tokens=AR_TOKENS).token_ids
        return memo[tuple(ids)][:n]

    return tokens


@pytest.fixture(scope="module")
def tiny():
    """The law tests' tiny target (helpers.tiny_model), one per module, on one thread: thousands of
    tiny forwards, where threading only adds overhead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model()
    torch.set_num_threads(threads)
