"""Exact output laws of plain sampling on tiny models, and a goodness-of-fit test against them.

The reference law is computed here in float64 by sorting, apart from d3d.verify.probs_from_logits, so a
mistake there (temperature, top-k, top-p) cannot hide by being in both the engines and the reference.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable

import torch
from scipy import stats

from d3d.datastore import Datastore
from d3d.drafter import Drafter, drafter_from_target
from d3d.target import ModelArgs, Transformer
from d3d.verify import SamplingParams, probs_from_logits, sample

V = 8
EOS = 7


def reference_law(logits: list[float], params: SamplingParams) -> list[float]:
    """The sampling law of one logits row: divide by the temperature, keep the top_k largest (0 = all),
    softmax, then keep the most likely tokens, best first, until their mass reaches top_p; renormalise."""
    z = [x / params.temperature for x in logits]
    ranked = sorted(range(len(z)), key=lambda i: z[i], reverse=True)
    kept = ranked[:params.top_k] if params.top_k else ranked
    top = z[kept[0]]
    weight = {i: math.exp(z[i] - top) for i in kept}
    total = sum(weight.values())
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= params.top_p:
            break
        nucleus.append(i)
        mass += weight[i] / total
    norm = sum(weight[i] for i in nucleus)
    law = [0.0] * len(z)
    for i in nucleus:
        law[i] = weight[i] / norm
    return law


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
        for s, row in zip(seqs, logits.double().tolist()):
            for t, p in enumerate(reference_law(row, params)):
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


# --------------------------------------------------------------------------------------------
# Tiny models whose laws can be enumerated


class StubTokenizer:
    eos_token_id = EOS

    def get_vocab(self):
        return {f"t{i}": i for i in range(V)}

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text, add_special_tokens=True):
        """Bytes mod V: what --quantize int8 reads its calibration text through (d3d.quantize)."""
        return [b % V for b in text.encode()]


def tiny_model(noise: float = 0.0) -> Transformer:
    """The tiny target (same weights every time), or with `noise` added to its output layer: a drafter
    that agrees with it only part of the time."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(ModelArgs(vocab_size=V, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                      intermediate_size=64, norm_eps=1e-5, rope_theta=10000, max_seq_len=64))
        model.output.weight.data.add_(noise * torch.randn(model.output.weight.shape))
    model.output.weight.data.mul_(2.5)  # peakier next-token laws, far from uniform
    return model.eval().requires_grad_(False)


def tiny_drafter(target: Transformer, block: int = 4) -> Drafter:
    """An untrained D3D drafter copied from the tiny target's layers: right part of the time."""
    return drafter_from_target(target, StubTokenizer(), "tiny", [0, 1], block).eval().requires_grad_(False)


def tiny_datastore(target: Transformer, prompt: list[int], n: int = 24) -> Datastore:
    """A datastore of the tiny target's own sampled continuations of `prompt` (temperature 1, 6 tokens
    each), as `d3d datastore` makes one of distillation data: often, not always, what it says next."""
    from d3d.engine import generate

    sep = (1 << V.bit_length()) - 1
    tokens = []
    for seed in range(n):
        res = generate(target, StubTokenizer(), prompt, SamplingParams(temperature=1.0, seed=1000 + seed), 6)
        tokens += prompt[-2:] + res.token_ids + [sep]
    return Datastore(torch.tensor(tokens).numpy(), V)


def draw(run: Callable[[SamplingParams], object], params: SamplingParams, n: int,
         first: int | None = None) -> tuple[list[tuple[int, ...]], Counter]:
    """n independent outputs of run(params with seed i) (their first `first` tokens) and the histogram
    of acceptance lengths."""
    outputs, rounds = [], Counter()
    for i in range(n):
        res = run(SamplingParams(params.temperature, params.top_k, params.top_p, seed=i))
        outputs.append(tuple(res.token_ids[:first]))
        rounds.update(res.acceptance_lengths)
    return outputs, rounds


def no_residual_update(cands, row, params, generator):
    """Broken: every sibling is tested against the target's law p itself, as if it were the only one."""
    p = probs_from_logits(row, params)
    for c in cands:
        if float(torch.rand(1, generator=generator)) < float(p[c.token]):
            return c.child, c.token
    return None, sample(p, generator)
