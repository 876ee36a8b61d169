"""The decoding methods by name: each becomes a function prompt_ids -> GenerationResult on one target."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from .engine import GenerationResult, generate
from .ngram import NgramProposer
from .target import D3DError

METHODS = ("ar", "ngram")
BEST_METHOD = "ngram"  # what `d3d demo` compares against plain decoding

Runner = Callable[..., GenerationResult]


def make_runner(method: str, model, tokenizer, model_dir: Path, drafter: str | None = None,
                block_size: int = 16) -> Runner:
    """A function (prompt_ids, params=..., max_new_tokens=..., stop=...) -> GenerationResult."""
    if method == "ar":
        return partial(generate, model, tokenizer)
    if method == "ngram":
        return partial(generate, model, tokenizer, proposer=NgramProposer(), block_size=block_size)
    raise D3DError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def parse_methods(spec: str) -> list[str]:
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise D3DError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not methods:
        raise D3DError("no method given")
    return methods
