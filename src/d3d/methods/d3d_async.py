"""The `d3d-async` method: D3D with the successor block drafted for every outcome while the target verifies
(the loop: d3d.decoding.async_engine)."""
from __future__ import annotations

from functools import partial

import torch

from ..decoding.async_engine import generate_async
from ..decoding.engine import GenerationResult
from ..drafters.kinds import D3D
from .registry import Method, Runner, Setup, register


def _split_cpu_threads(run):
    """On one CPU the verifier (main thread) and the drafter (worker thread) each run their own OpenMP
    team; with the full thread count on both, 2 x N threads fight over N cores and both collapse. So
    each side gets half the cores while an asynchronous generation runs."""

    def wrapped(*args, **kwargs) -> GenerationResult:
        n = torch.get_num_threads()
        torch.set_num_threads(max(1, n // 2))
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapped


def _async_runner(s: Setup):
    d = s.drafter(D3D, "d3d-async", device=s.draft_device or s.device)
    run = partial(generate_async, s.model, s.tokenizer, drafter=d, draft_device=s.draft_device)
    on_cpu = str(next(d.parameters()).device) == "cpu" == s.device
    return Runner(_split_cpu_threads(run) if on_cpu else run, block_size=d.block_size)


D3D_ASYNC = register(Method("d3d-async", _async_runner, drafter_kind=D3D.name,
                            help="D3D with the next block drafted for every outcome while the target verifies"))
