"""Exact output laws of plain sampling on tiny models, and a goodness-of-fit test against them.

The reference law is computed here in float64 by sorting, apart from d3d.decoding.verify.probs_from_logits, so a
mistake there (temperature, top-k, top-p) cannot hide by being in both the engines and the reference.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable

import torch
from scipy import stats

from d3d.decoding.engine import generate
from d3d.decoding.verify import SamplingParams, probs_from_logits, sample
from helpers import V, StubTokenizer, on_cpu_layers, tiny_datastore, tiny_drafter, tiny_model


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


# --------------------------------------------------------------------------------------------
# The law tests' settings, and every speculative method as a harness on the tiny target

PROMPT = [1, 2, 3]
N_SAMPLES = 1500
MAX_NEW_TINY = 4  # with BLOCK_TINY = 4 the first round drafts 2 tokens after the prefill's token
BLOCK_TINY = 4
NOISE = 0.08  # the one-hot drafter's output-layer noise: it agrees with the target about half the time
TEMP = SamplingParams(temperature=0.8)
TRUNCATED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)


def spec_draw(model, params: SamplingParams, proposer=None) -> tuple[list[tuple[int, ...]], Counter]:
    """N_SAMPLES outputs of synchronous speculative sampling (plain sampling without a proposer); sample i
    uses seed i and a proposer made with seed 10**6 + i."""
    def run(p):
        prop = None if proposer is None else proposer(10**6 + p.seed)
        return generate(model, StubTokenizer(), PROMPT, p, MAX_NEW_TINY, block_size=BLOCK_TINY, proposer=prop)

    return draw(run, params, N_SAMPLES)


PROMPT_ALL = [1, 2, 3, 1, 2]  # a repeat, so that n-gram lookup finds matches
FIRST = 4                     # the law of the first 4 tokens ...
MAX_NEW_ALL = 6               # ... of generations long enough for several rounds (packed blocks, trees)
N_ALL = 1200
ASYNC_OPTIONS = {"d3d-async": {}, "d3d-async max_candidates=2": {"max_candidates": 2},
                 "d3d-async successor_slots=2": {"successor_slots": 2}, "d3d-async head_all": {"head_all": True},
                 "d3d-async pack=False": {"pack": False}}
TOP_K = SamplingParams(temperature=0.8, top_k=3)  # top-k alone, and top-p alone: each cut on its own
TOP_P = SamplingParams(temperature=0.8, top_p=0.8)
PARAMS_ID = {id(TEMP): "temperature", id(TRUNCATED): "top_k+top_p", id(TOP_K): "top_k", id(TOP_P): "top_p"}


def method_drafter(method: str):
    """The tiny fp32 drafter `method` drafts with in this harness (None for ngram and lookup-tree): for the
    D3D methods an untrained D3D drafter copied from a noisy copy of the target (helpers.tiny_drafter),
    for ar-draft a causal drafter of that noisy copy's layers, for dflash a DFlash drafter of the target's first
    layer reading both its layers (its fusion layer random), for draft-model the noisy copy itself."""
    from d3d.methods.draftmodel import DraftModel
    from d3d.drafters.convert import drafter_from_target

    if method in ("ngram", "lookup-tree"):
        return None
    if method == "draft-model":
        return DraftModel(tiny_model(noise=NOISE))
    if method == "ar-draft":
        d = drafter_from_target(tiny_model(noise=NOISE), StubTokenizer(), "tiny", [0, 1], BLOCK_TINY, kind="ar")
        return on_cpu_layers(d.eval().requires_grad_(False))
    if method == "dflash":  # its own forward stays in PyTorch, as d3d loads it
        with torch.random.fork_rng():
            torch.manual_seed(5)
            d = drafter_from_target(tiny_model(), StubTokenizer(), "tiny", [0], BLOCK_TINY, kind="dflash",
                                    target_layers=[0, 1])
        return d.eval().requires_grad_(False)
    return tiny_drafter(tiny_model(noise=NOISE), BLOCK_TINY)


def method_runner(method: str, target, drafter):
    """params -> result of `method` on PROMPT_ALL (d3d-async without overlap: the same computation);
    `drafter` is the method's drafter (method_drafter's kind; a DraftModel for draft-model)."""
    from d3d.methods.ar_draft import ARDraftProposer
    from d3d.decoding.async_engine import generate_async
    from d3d.methods.dflash import DFlashProposer
    from d3d.methods.draftmodel import DraftModelProposer
    from d3d.methods.ngram import NgramProposer
    from d3d.methods.d3d import D3DProposer
    from d3d.decoding.tree import generate_tree
    from d3d.methods.tree import TreeProposer
    from d3d.decoding.treecost import WidthCost

    tok = StubTokenizer()
    if method == "ar":
        return lambda p: generate(target, tok, PROMPT_ALL, p, MAX_NEW_ALL)
    if method == "d3d-async sized":  # its synchronous schedule, drafts sized alone as d3d's (d3d.decoding.budget)
        from d3d.decoding.budget import DraftLength

        length = DraftLength(WidthCost({1: 1.0, 2: 1.1, 8: 1.6}), BLOCK_TINY - 1, draft_s=lambda n: 0.2 + 0.05 * n)
        return lambda p: generate_async(target, tok, PROMPT_ALL, p, MAX_NEW_ALL, drafter=drafter, overlap=False,
                                        pack=False, length=length)
    if method in ASYNC_OPTIONS:
        return lambda p: generate_async(target, tok, PROMPT_ALL, p, MAX_NEW_ALL, drafter=drafter, overlap=False,
                                        **ASYNC_OPTIONS[method])
    if method == "d3d-tree":  # with a cost model: trees cut by width and the drafter skipped when it does not pay
        cost = WidthCost({1: 1.0, 2: 1.2, 8: 1.6}, overhead=0.9)  # skips the drafter in about half the rounds
        tree = TreeProposer(D3DProposer(drafter, V, max_len=64), budget=8, cost=cost)
        return lambda p: generate_tree(target, tok, PROMPT_ALL, p, MAX_NEW_ALL, proposer=tree, max_depth=3)
    if method == "suffix":  # arctic-inference's suffix trees over the prompt and the earlier samples' outputs
        from d3d.methods.suffix import SuffixProposer, SuffixRunner, suffix_cache

        run = SuffixRunner(target, tok, SuffixProposer(suffix_cache(), budget=8))
        return lambda p: run(PROMPT_ALL, params=p, max_new_tokens=MAX_NEW_ALL)
    if method == "lookup-tree":  # n-gram matches and continuations retrieved from the target's own samples
        tree = TreeProposer(None, budget=8, cost=WidthCost({1: 1.0, 2: 1.2, 8: 1.6}),
                            datastore=tiny_datastore(target, PROMPT_ALL))
        return lambda p: generate_tree(target, tok, PROMPT_ALL, p, MAX_NEW_ALL, proposer=tree, max_depth=3)
    if method == "ngram":  # with a cost model: drafts cut by their estimated chance against the width's cost
        proposer = NgramProposer(cost=WidthCost({1: 1.0, 2: 1.1, 8: 1.6}))
    elif method in ("ar-draft", "draft-model", "dflash"):
        make = {"ar-draft": ARDraftProposer, "draft-model": DraftModelProposer, "dflash": DFlashProposer}[method]
        proposer = make(drafter, V, max_len=64)
    elif method == "d3d":
        proposer = D3DProposer(drafter, V, max_len=64)
    elif method == "d3d sized":  # drafts sized by d3d.decoding.budget alone: lengths vary with the acceptance seen
        from d3d.decoding.budget import DraftLength

        proposer = D3DProposer(drafter, V, max_len=64)
        proposer.length = DraftLength(WidthCost({1: 1.0, 2: 1.1, 8: 1.6}), BLOCK_TINY - 1, draft_s=lambda n: 0.2 + 0.05 * n)
    else:
        raise ValueError(f"method_runner has no harness for method {method!r}")
    return lambda p: generate(target, tok, PROMPT_ALL, p, MAX_NEW_ALL, proposer=proposer, block_size=BLOCK_TINY)
