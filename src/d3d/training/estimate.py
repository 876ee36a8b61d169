"""Fast acceptance-length estimate: replay synchronous greedy D3D against cached target continuations.

At temperature 0 the verified text of a speculative run is, by losslessness, the target's greedy
continuation. So given that continuation, every round of a synchronous run can be replayed with the
drafter alone: draft after the verified prefix, count the leading draft tokens that agree with the
continuation, advance by that count + 1. The result equals a real `d3d` run's acceptance lengths
(same drafter, whole blocks, drafted as D3DProposer drafts them: Drafter.draft_logits) without a single target
forward.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..drafters.drafter import Drafter
from ..decoding.verify import leading_matches


@torch.no_grad()
def replay_acceptance(drafter: Drafter, prompt_ids: list[int], continuation: list[int],
                      max_new_tokens: int) -> list[int]:
    """Acceptance lengths of synchronous greedy D3D whose target output is `continuation`."""
    B = drafter.block_size
    drafter.setup_cache(1, len(prompt_ids) + len(continuation) + B + 1)
    drafter.cached_tokens = []
    out, pos = [], 1  # the first token comes from the target's prefill
    while pos < len(continuation):
        k = min(B - 1, max_new_tokens - pos - 1)
        context = prompt_ids + continuation[:pos]
        draft = drafter.draft_ids[drafter.draft_logits(context, k).argmax(-1)].tolist() if k > 0 else []
        n = leading_matches(d == c for d, c in zip(draft, continuation[pos:]))
        out.append(n + 1)
        pos += n + 1
    return out


def mean_tau(drafter: Drafter, prompts: list[list[int]], continuations: list[list[int]],
             max_new_tokens: int) -> float:
    """Mean acceptance length over all rounds of all prompts (the `tau` that `d3d bench` reports)."""
    lengths = [a for p, c in zip(prompts, continuations) for a in replay_acceptance(drafter, p, c, max_new_tokens)]
    return sum(lengths) / max(1, len(lengths))


def greedy_continuations(model, tokenizer, texts: dict[str, list[str]], max_new_tokens: int,
                         cache: Path | None = None, desc: str = "continuations") -> dict[str, list[tuple]]:
    """{set name: [(prompt ids, the target's greedy continuation), ...]} of the given user messages,
    cached in `cache` (JSON, by max_new_tokens, set and message; written after every prompt), so that a
    resumed or repeated call only generates what is missing."""
    from tqdm import tqdm

    from ..atomic import atomic_write_json
    from ..decoding.engine import generate
    from ..corpus.prompts import encode_prompt

    done = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    store = done.setdefault(f"max_new_tokens={max_new_tokens}", {})
    out = {name: [] for name in texts}
    todo = [(name, text) for name, ts in texts.items() for text in ts]
    for name, text in tqdm(todo, desc=desc, mininterval=2):
        rows = store.setdefault(name, {})
        if text not in rows:
            ids = encode_prompt(tokenizer, text)
            rows[text] = [ids, generate(model, tokenizer, ids, max_new_tokens=max_new_tokens).token_ids]
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(cache, done)
        out[name].append(tuple(rows[text]))
    return out


def benchmark_continuations(model, tokenizer, benchmarks: list[str], limit: int, max_new_tokens: int,
                            cache: Path | None = None) -> dict[str, list[tuple[list[int], list[int]]]]:
    """greedy_continuations of the first `limit` prompts (first turns) of each benchmark."""
    from ..corpus.prompts import benchmark_prompts, first_turn

    texts = {b: [first_turn(it) for it in benchmark_prompts(b, limit)] for b in benchmarks}
    return greedy_continuations(model, tokenizer, texts, max_new_tokens, cache, desc="benchmark continuations")


WHOLE_TARGET = "whole-target"  # `d3d estimate --drafters NAME=whole-target`: the untrained token-shift drafter made of the whole target


def whole_target_drafter(model, tokenizer, target_name: str, block_size: int = 16) -> Drafter:
    """The whole target converted to a token-shift block-diffusion drafter, untrained: every layer shared
    with the target (cfg.from_target), so its checkpoint holds only the norm, mask embedding and ids."""
    from ..drafters.convert import drafter_from_target

    d = drafter_from_target(model, tokenizer, target_name, list(range(model.args.n_layers)), block_size, shift=True)
    d.cfg.from_target = list(range(model.args.n_layers))
    return d.eval().requires_grad_(False)


def estimate_tau(drafter: Drafter, conts: dict[str, list[tuple[list[int], list[int]]]],
                 max_new_tokens: int) -> dict:
    """Replayed greedy tau of `drafter` on benchmark continuations (benchmark_continuations): over all
    rounds, per benchmark, their mean, the share of rounds whose first draft token was accepted, and `reach`:
    for each draft position k = 1 .. block - 1, the share of rounds that accepted it (the tau-by-position curve;
    tau is 1 + its sum)."""
    t0 = time.time()
    by_bench = {b: [a for p, c in rows for a in replay_acceptance(drafter, p, c, max_new_tokens)]
                for b, rows in conts.items()}
    lengths = [a for ls in by_bench.values() for a in ls]
    per = {b: round(sum(ls) / max(1, len(ls)), 4) for b, ls in by_bench.items()}
    n = max(1, len(lengths))
    reach = [round(sum(a > k for a in lengths) / n, 4) for k in range(1, drafter.block_size)]
    return {"tau": round(sum(lengths) / n, 4), "per_benchmark": per,
            "mean": round(sum(per.values()) / max(1, len(per)), 4), "rounds": len(lengths),
            "first_draft_accepted": reach[0] if reach else 0.0, "reach": reach,
            "prompts": sum(len(r) for r in conts.values()), "estimate_s": round(time.time() - t0, 1)}
