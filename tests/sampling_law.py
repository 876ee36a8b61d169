"""Exact output laws of plain sampling on tiny models, and a goodness-of-fit test against them."""
from __future__ import annotations

from collections import Counter

import torch
from scipy import stats

from d3d.verify import SamplingParams, probs_from_logits


@torch.no_grad()
def exact_law(model, prompt: list[int], params: SamplingParams, steps: int, eos: int) -> dict[tuple[int, ...], float]:
    """Probability of every possible first `steps` tokens of plain sampling (fewer when EOS comes first),
    by enumerating the tree of continuations with batched forwards."""
    dist, frontier = {}, {(): 1.0}
    for step in range(steps):
        if not frontier:
            break
        seqs = list(frontier)
        model.setup_cache(len(seqs), len(prompt) + step)
        logits = model(torch.tensor([prompt + list(s) for s in seqs]), last_only=True)[:, -1]
        nxt = {}
        for s, probs in zip(seqs, probs_from_logits(logits, params).double().tolist()):
            for t, p in enumerate(probs):
                if p > 0:
                    (dist if t == eos or step == steps - 1 else nxt)[s + (t,)] = frontier[s] * p
        frontier = nxt
    return dist


def chi2_pvalue(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of `samples` to `dist`: outcomes expected fewer than 5 times are pooled into one
    cell (with any impossible outcome), merged into the smallest kept cell if still under 5."""
    n, counts = len(samples), Counter(samples)
    kept = [s for s in sorted(dist, key=dist.get, reverse=True) if dist[s] * n >= 5]
    observed = [counts[s] for s in kept]
    expected = [dist[s] * n for s in kept]
    rest_obs, rest_exp = n - sum(observed), n - sum(expected)
    if rest_exp >= 5:
        observed.append(rest_obs)
        expected.append(rest_exp)
    else:
        observed[-1] += rest_obs
        expected[-1] += rest_exp
    return float(stats.chisquare(observed, expected).pvalue)
