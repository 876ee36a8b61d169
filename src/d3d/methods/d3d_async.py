"""The `d3d-async` method: D3D with the successor block drafted for every outcome while the target verifies
(the loop: d3d.decoding.async_engine)."""
from __future__ import annotations

from functools import partial

import torch

from ..decoding.async_engine import generate_async, round_costs
from ..decoding.engine import GenerationResult
from ..drafters.kinds import D3D
from .d3d import fitted_length
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
    """The overlap where it pays: both schedules' rounds are timed when the method is built (round_costs, a
    second or a few on a CPU), and where drafting every successor beside the verification is not faster than
    drafting after it (on one CPU the two halves of the cores each run slower than all of them), every round
    drafts synchronously, on all the threads, as `d3d` does, its drafts sized as `d3d` sizes them (or of
    `draft_k` tokens)."""
    d = s.drafter(D3D, "d3d-async", device=s.draft_device or s.device)
    on_cpu = str(next(d.parameters()).device) == "cpu" == s.device
    costs = round_costs(s.model, d, split_threads=on_cpu)
    pack = costs["overlap"] < costs["sync"]
    fixed = s.options.get("draft_k")
    length = fitted_length(s.model, d) if not pack and fixed is None else None
    run = partial(generate_async, s.model, s.tokenizer, drafter=d, draft_device=s.draft_device, pack=pack,
                  overlap=pack, length=length, draft_k=None if pack else fixed)
    return Runner(_split_cpu_threads(run) if on_cpu and pack else run, block_size=d.block_size,
                  schedule="overlap" if pack else "sync", round_s={k: round(v, 5) for k, v in costs.items()},
                  draft_k=fixed, sized=length is not None)


D3D_ASYNC = register(Method("d3d-async", _async_runner, drafter_kind=D3D.name,
                            help="D3D with the next block drafted for every outcome while the target verifies"))
