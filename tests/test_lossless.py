"""Speculative decoding is lossless.

Greedy, on the real default target: every proposer (n-gram, random garbage, a perfect or noisy oracle)
yields exactly plain decoding's tokens, EOS and max_new_tokens included.
Sampling, on a tiny random model whose output distribution can be enumerated exactly: plain and
speculative sampling both pass a chi-square goodness-of-fit test against that exact distribution, and
the same test rejects a deliberately broken acceptance rule.
"""
from __future__ import annotations

import pytest
import torch

import d3d.decoding.engine
from d3d.decoding.engine import generate
from d3d.decoding.proposer import Proposer
from d3d.methods.catalog import make_runner
from d3d.decoding.verify import SamplingParams, greedy_tokens, leading_matches, probs_from_logits, sample, verify
from helpers import EOS, V, StubTokenizer, on_cpu_layers, tiny_drafter, tiny_model
from sampling_law import (ASYNC_OPTIONS, BLOCK_TINY, FIRST, MAX_NEW_TINY, N_ALL, NOISE, PARAMS_ID, PROMPT, PROMPT_ALL,
                          TEMP, TOP_K, TOP_P, TRUNCATED, chi2_pvalue, draw, exact_law, method_drafter, method_runner,
                          spec_draw)

GREEDY = SamplingParams()
MAX_NEW = 64


class Oracle(Proposer):
    """Proposes the known continuation `reference` (prompt + output ids), each draft token replaced by a
    random one with probability `noise`. Checks that the engine shows it exactly the verified text."""

    name = "oracle"

    def __init__(self, reference: list[int], noise: float = 0.0, vocab: int = 0, seed: int = 0):
        self.reference, self.noise, self.vocab, self.seed = reference, noise, vocab, seed

    def reset(self, prompt_ids):
        self.g = torch.Generator().manual_seed(self.seed)

    def propose(self, tokens, k):
        assert tokens == self.reference[:len(tokens)]
        draft = self.reference[len(tokens):len(tokens) + k]
        for i in range(len(draft)):
            if float(torch.rand(1, generator=self.g)) < self.noise:
                draft[i] = int(torch.randint(self.vocab, (1,), generator=self.g))
        return draft, None


class Garbage(Proposer):
    """Proposes k uniformly random tokens."""

    name = "garbage"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.seed = vocab, seed

    def reset(self, prompt_ids):
        self.g = torch.Generator().manual_seed(self.seed)

    def propose(self, tokens, k):
        return torch.randint(self.vocab, (k,), generator=self.g).tolist(), None


def test_greedy_acceptance_counts_leading_matches():
    """The one acceptance count (verify, the replayed and the teacher-forced tau): matches up to the first miss."""
    assert [leading_matches(m) for m in ([], [False], [True, True], [True, False, True])] == [0, 0, 2, 1]
    logits = torch.nn.functional.one_hot(torch.tensor([5, 6, 7, 8]), 10).float()  # the target says 5 6 7 8
    drafts = ([5, 6, 7], [5, 9, 7], [], [1])
    assert [verify(d, logits, GREEDY, None) for d in drafts] == [(3, 8), (1, 6), (0, 5), (0, 5)]


def test_greedy_tokens_equal_torch_argmax():
    """The NumPy argmax (fp32 on the CPU) picks what torch.argmax picks: the first maximum, on any view."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4096, generator=g).round(decimals=1)  # rounded: many exact ties at the top
    logits[2, [7, 3000]] = 50.0
    for x in (logits, logits[1], logits[:, ::3], logits.t().contiguous().t(), logits.to(torch.bfloat16)):
        assert greedy_tokens(x) == x.argmax(-1).tolist()
    assert greedy_tokens(logits)[2] == 7


@pytest.fixture(scope="module")
def cases(smol, prompt_ids):
    """(prompt ids, plain greedy result) for 3 GSM8K questions and 2 chat prompts, 64 new tokens each."""
    model, tok, _ = smol
    out = []
    for ids in prompt_ids[:3] + prompt_ids[-2:]:
        res = generate(model, tok, ids, GREEDY, MAX_NEW)
        assert res.new_tokens == MAX_NEW and res.finish_reason == "length"
        out.append((ids, res))
    return out


def test_ngram_greedy_equals_plain_decoding(smol, cases):
    model, tok, model_dir = smol
    ngram = make_runner("ngram", model, tok, model_dir)
    accepted = []
    for ids, ar in cases:
        res = ngram(ids, params=GREEDY, max_new_tokens=MAX_NEW)
        assert res.token_ids == ar.token_ids
        assert res.text == ar.text
        assert sum(res.acceptance_lengths) == MAX_NEW - 1  # every round's tokens counted, first one from prefill
        accepted += res.acceptance_lengths
    assert max(accepted) > 2  # drafts were really accepted, not just corrected one token at a time


def test_ngram_cuts_drafts_to_what_pays():
    """With verification twice as dear at 16 tokens as at 1, a copy that is rarely right is cut to nothing
    and one that is nearly always right is kept whole; the estimate follows what the text did next."""
    from d3d.methods.ngram import NgramProposer
    from d3d.decoding.treecost import WidthCost

    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 5, 6]  # "5 6" matched: copy 7 8 9 ...
    ngram = NgramProposer(cost=WidthCost({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.5, 16: 2.0}))
    for p_right, want in ((0.01, 0), (0.99, 10)):
        ngram.reset(text)
        ngram.hits[2] = [p_right * 100, 100.0]
        assert len(ngram.propose(text, 15)[0]) == want
    ngram.reset(text)
    before = ngram.hits[2][0] / ngram.hits[2][1]
    ngram.propose(text, 15)
    ngram.propose(text + [7, 8, 42], 15)  # the round kept two copied tokens, then the text went its own way
    right, tried = ngram.hits[2]
    assert (right, tried) == pytest.approx((0.9 * 1 + 2, 0.9 * 2 + 3)) and right / tried > before


def test_d3d_sizes_its_drafts_alone_to_what_pays():
    """Alone, a DraftLength with the drafter's cost by length verifies the length that maximises expected tokens
    per second: where 16 rows cost 3.5 times one (the int4 pair) and each position is right 3 times in 4, a few
    drafts; where a forward of 16 rows costs what one does and drafts are nearly always right, the whole block;
    where they are nearly always wrong, none (then a short probe every PROBE_ROUNDS rounds). Without a drafting cost it leaves k alone."""
    from d3d.decoding.budget import PROBE_LENGTH, PROBE_ROUNDS, DraftLength
    from d3d.decoding.treecost import WidthCost

    steep, flat = WidthCost({1: 0.035, 2: 0.038, 4: 0.045, 8: 0.065, 16: 0.122}), WidthCost({1: 0.03, 16: 0.031})

    def length(cost, right: float) -> DraftLength:
        d = DraftLength(cost, 15, draft_s=lambda n: 0.015 + 0.002 * n)
        d.counts = [[right * 100, 100.0] for _ in range(15)]
        return d

    assert 3 <= length(steep, 0.75).choose(15) <= 8
    assert length(flat, 0.97).choose(15) == 15 and length(flat, 0.75).choose(15) > length(steep, 0.75).choose(15)
    assert length(steep, 0.75).choose(2) <= 2
    never = length(steep, 0.01)
    assert [never.choose(15) for _ in range(PROBE_ROUNDS + 1)] == [0] * PROBE_ROUNDS + [PROBE_LENGTH]
    assert DraftLength(steep, 15).choose(15) == 15  # no drafting cost, no batch: the whole block


def test_sized_d3d_greedy_equals_plain_decoding(smol, cases, monkeypatch):
    """`d3d` as built by default (its drafts sized by d3d.decoding.budget, each a pass of fewer slots) gives plain
    decoding's tokens with drafts accepted; the costs are fixed here (a forward of 16 rows twice one row, a
    cheap drafter), since measured ones decide by this machine's timings."""
    import d3d.decoding.treecost as treecost

    model, tok, model_dir = smol
    monkeypatch.setattr(model, "_d3d_width_curve", (torch.get_num_threads(), {1: 1.0, 2: 1.02, 4: 1.1, 8: 1.4, 16: 2.0}),
                        raising=False)
    monkeypatch.setattr(treecost, "drafter_costs", lambda proposer, slots, **kw: {s: 0.01 * s for s in slots})
    run = make_runner("d3d", model, tok, model_dir)
    assert run.settings["sized"] and run.settings["draft_k"] is None
    lengths, sized = [], run.fn.keywords["proposer"].length
    for ids, ar in cases[:3]:
        res = run(ids, params=GREEDY, max_new_tokens=MAX_NEW)
        assert res.token_ids == ar.token_ids
        lengths += res.acceptance_lengths
    assert max(lengths) >= 2  # drafts were accepted
    assert run.fn.keywords["proposer"].length is sized and sized.counts[0][1] > 2.0  # one DraftLength, kept, observing


def test_oracle_and_noisy_oracle_equal_plain_decoding(smol, cases):
    model, tok, _ = smol
    vocab = model.args.vocab_size
    for i, (ids, ar) in enumerate(cases):
        reference = ids + ar.token_ids
        res = generate(model, tok, ids, GREEDY, MAX_NEW, proposer=Oracle(reference))
        assert res.token_ids == ar.token_ids
        assert res.tau > 12  # 63 tokens after the prefill in 4 blocks of 16
        if i < 2:
            res = generate(model, tok, ids, GREEDY, MAX_NEW, proposer=Oracle(reference, 0.15, vocab, seed=i))
            assert res.token_ids == ar.token_ids
            assert len(set(res.acceptance_lengths)) >= 4  # rejections at many different depths


def test_garbage_proposer_equals_plain_decoding(smol, cases):
    model, tok, _ = smol
    ids, ar = cases[3]
    res = generate(model, tok, ids, GREEDY, 24, proposer=Garbage(model.args.vocab_size))
    assert res.token_ids == ar.token_ids[:24]
    assert res.rounds >= 20  # nearly every draft rejected


def test_a_shorter_plain_run_is_a_prefix_of_a_longer_one(smol, cases, ar_tokens):
    """What the shared ar_tokens fixture (conftest.py) relies on: n tokens of plain greedy decoding are the
    first n of any longer run, whatever the cache size the run sets up."""
    model, tok, _ = smol
    ids, ar = cases[-1]
    for n in (3, 29):
        assert generate(model, tok, ids, GREEDY, n).token_ids == ar.token_ids[:n] == ar_tokens(ids, n)


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_max_new_tokens_is_exact(smol, cases, max_new):
    model, tok, _ = smol
    ids, ar = cases[0]
    res = generate(model, tok, ids, GREEDY, max_new, proposer=Oracle(ids + ar.token_ids))
    assert res.token_ids == ar.token_ids[:max_new]
    assert res.finish_reason == "length"


def test_eos_inside_an_accepted_block(smol, short_answer_ids):
    model, tok, _ = smol
    ids = short_answer_ids
    ar = generate(model, tok, ids, GREEDY, 32)
    assert ar.finish_reason == "eos" and ar.token_ids[-1] == tok.eos_token_id and ar.new_tokens < 20
    filler = ar.token_ids[:8]  # drafts after EOS: the target verifies past EOS, the engine must cut there
    res = generate(model, tok, ids, GREEDY, 32, proposer=Oracle(ids + ar.token_ids + filler))
    assert res.token_ids == ar.token_ids
    assert res.finish_reason == "eos" and res.text == ar.text
    assert res.rounds == 1 and res.acceptance_lengths[0] > ar.new_tokens - 1  # verified beyond EOS, then cut


# --------------------------------------------------------------------------------------------
# Sampling on a tiny random model

Q = torch.softmax(1.5 * torch.randn(V, generator=torch.Generator().manual_seed(1)), -1)  # a wrong draft law


class SampledProposer(Proposer):
    """Drafts i.i.d. from the fixed distribution Q, which ignores the context, and says so (q = Q)."""

    name = "sampled"

    def __init__(self, seed: int):
        self.seed = seed

    def reset(self, prompt_ids):
        self.g = torch.Generator().manual_seed(self.seed)

    def propose(self, tokens, k):
        return torch.multinomial(Q, k, replacement=True, generator=self.g).tolist(), Q.expand(k, V)


class GreedyDrafter(Proposer):
    """A deterministic drafter that gives no q (one-hot): the greedy tokens of `model` (memoized)."""

    name = "greedy"

    def __init__(self, model):
        self.model = model
        self.next = {}

    def reset(self, prompt_ids):
        pass

    @torch.no_grad()
    def propose(self, tokens, k):
        seq = list(tokens)
        for _ in range(k):
            key = tuple(seq)
            if key not in self.next:
                self.next[key] = int(self.model(torch.tensor([seq]))[0, -1].argmax())
            seq.append(self.next[key])
        return seq[len(tokens):], None


@pytest.fixture(scope="module")
def proposers(tiny):
    """Proposer factories (seed -> proposer) by kind: drafts sampled from Q and q = Q, or greedy drafts of a
    noisy copy of the target and q = None."""
    drafter = GreedyDrafter(tiny_model(noise=NOISE))
    return {"sampled_q": SampledProposer, "one_hot": lambda seed: drafter}


def accept_every_draft(draft, target_logits, params, generator, draft_probs=None):
    return len(draft), sample(probs_from_logits(target_logits[len(draft)], params), generator)


def resample_from_p_on_rejection(draft, target_logits, params, generator, draft_probs=None):
    accepted, token = verify(draft, target_logits, params, generator, draft_probs)
    if accepted < len(draft):
        token = sample(probs_from_logits(target_logits[accepted], params), generator)
    return accepted, token


def test_exact_distribution_is_a_distribution(tiny):
    for params in (TEMP, TRUNCATED):
        dist = exact_law(tiny, PROMPT, params, MAX_NEW_TINY, EOS)
        assert abs(sum(dist.values()) - 1) < 1e-5
        assert max(dist.values()) < 0.3 and any(s[-1] == EOS and len(s) < MAX_NEW_TINY for s in dist)


@pytest.mark.slow
def test_plain_sampling_matches_exact_distribution(tiny):
    samples, _ = spec_draw(tiny, TEMP)
    assert chi2_pvalue(samples, exact_law(tiny, PROMPT, TEMP, MAX_NEW_TINY, EOS)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("params", [TEMP, TRUNCATED], ids=["temperature", "top_k+top_p"])
@pytest.mark.parametrize("kind", ["sampled_q", "one_hot"])
def test_speculative_sampling_is_lossless(tiny, proposers, params, kind):
    dist = exact_law(tiny, PROMPT, params, MAX_NEW_TINY, EOS)
    samples, rounds = spec_draw(tiny, params, proposers[kind])
    assert set(samples) <= set(dist)  # never a token that top-k / top-p removed
    assert rounds[1] > 100 and rounds[3] > 50  # both rejections and fully accepted blocks + bonus occur
    assert chi2_pvalue(samples, dist) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("broken", [accept_every_draft, resample_from_p_on_rejection])
@pytest.mark.parametrize("kind", ["sampled_q", "one_hot"])
def test_the_statistic_catches_a_broken_rule(tiny, proposers, monkeypatch, broken, kind):
    monkeypatch.setattr(d3d.decoding.engine, "verify", broken)
    samples, _ = spec_draw(tiny, TEMP, proposers[kind])
    assert chi2_pvalue(samples, exact_law(tiny, PROMPT, TEMP, MAX_NEW_TINY, EOS)) < 1e-6


# --------------------------------------------------------------------------------------------
# Every speculative method, on the tiny target with an untrained D3D drafter copied from it
# (d3d-tree with top-k + top-p, and a broken tree rule, are in test_tree.py)

CASES = [("ngram", TRUNCATED), ("d3d", TEMP), ("d3d", TRUNCATED), ("d3d sized", TRUNCATED), ("d3d-async sized", TEMP),
         ("d3d-tree", TEMP), ("lookup-tree", TRUNCATED)] + \
    [(name, TRUNCATED) for name in ASYNC_OPTIONS] + \
    [("ar-draft", TOP_K), ("ar-draft", TOP_P), ("dflash", TOP_K), ("dflash", TOP_P)]


@pytest.mark.slow
@pytest.mark.parametrize("method,params", CASES, ids=[f"{m}-{PARAMS_ID[id(p)]}" for m, p in CASES])
def test_every_speculative_method_keeps_the_law(tiny, method, params):
    run = method_runner(method, tiny, method_drafter(method))
    samples, rounds = draw(run, params, N_ALL, FIRST)
    dist = exact_law(tiny, PROMPT_ALL, params, FIRST, EOS)
    assert set(samples) <= set(dist)
    assert sum(n for length, n in rounds.items() if length > 1) > 100  # drafts really were accepted
    assert chi2_pvalue(samples, dist) > 1e-3


@pytest.mark.parametrize("method", ["d3d", "d3d-tree", "d3d-async"])
def test_the_drafter_reads_the_prompt_in_the_prefill_phase(tiny, monkeypatch, method):
    """A drafter's pass over the prompt is part of the time to first token (prefill_s), as the target's
    is, not of the decoding rounds that tokens/s measures; d3d-async's worker runs it beside the target's
    prefill, and the synchronous methods now count it the same way."""
    import time

    drafter = tiny_drafter(tiny_model(noise=NOISE), BLOCK_TINY)
    read, extend = [], drafter.extend

    def slow_extend(tokens):
        read.append(list(tokens))
        time.sleep(0.5)
        extend(tokens)

    monkeypatch.setattr(drafter, "extend", slow_extend)
    res = method_runner(method, tiny, drafter)(GREEDY)
    assert read[0] == PROMPT_ALL and len(read) == 1  # once, the prompt; rounds feed only what is new
    assert res.prefill_s >= 0.5 > res.decode_s


# The shipped drafters draft from a reduced vocabulary (draft index -> token id through draft_ids): the
# law holds with one here too, and the per-method harness rejects a broken rule in every engine.
REDUCED_VOCAB = torch.tensor([0, 1, 3, 4, 6])  # 5 of the 8 tokens: the drafter can never propose 2, 5 or 7
REDUCED_CASES = [("d3d", TEMP), ("d3d-tree", TRUNCATED), ("d3d-async", TRUNCATED)]


def reduced_vocab_drafter():
    from d3d.drafters.convert import drafter_from_target

    return on_cpu_layers(drafter_from_target(tiny_model(noise=NOISE), StubTokenizer(), "tiny", [0, 1], BLOCK_TINY,
                                             draft_ids=REDUCED_VOCAB).eval().requires_grad_(False))


@pytest.mark.slow
@pytest.mark.parametrize("method,params", REDUCED_CASES, ids=[m for m, _ in REDUCED_CASES])
def test_a_reduced_draft_vocabulary_keeps_the_law(tiny, method, params):
    run = method_runner(method, tiny, reduced_vocab_drafter())
    samples, rounds = draw(run, params, N_ALL, FIRST)
    dist = exact_law(tiny, PROMPT_ALL, params, FIRST, EOS)
    assert set(samples) <= set(dist)
    assert sum(n for length, n in rounds.items() if length > 1) > 100  # drafts really were accepted
    assert chi2_pvalue(samples, dist) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("method", ["d3d", "d3d-async"])
def test_the_method_harness_catches_a_broken_rule(tiny, monkeypatch, method):
    """d3d-async runs in the same loop as d3d (its proposer drafts between the loop's verbs), so one
    broken verification rule reaches both."""
    monkeypatch.setattr(d3d.decoding.engine, "verify", accept_every_draft)
    run = method_runner(method, tiny, tiny_drafter(tiny_model(noise=NOISE), BLOCK_TINY))
    samples, _ = draw(run, TEMP, N_ALL, FIRST)
    assert chi2_pvalue(samples, exact_law(tiny, PROMPT_ALL, TEMP, FIRST, EOS)) < 1e-6
