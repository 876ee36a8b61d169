"""Speculative decoding is lossless.

Greedy, on the real default target: every proposer (n-gram, random garbage, a perfect or noisy oracle)
yields exactly plain decoding's tokens, EOS and max_new_tokens included.
Sampling, on a tiny random model whose output distribution can be enumerated exactly: plain and
speculative sampling both pass a chi-square goodness-of-fit test against that exact distribution, and
the same test rejects a deliberately broken acceptance rule.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import d3d.engine
from d3d.engine import generate
from d3d.methods import make_runner
from d3d.target import ModelArgs, Transformer
from d3d.verify import SamplingParams, probs_from_logits, sample, verify
from sampling_law import chi2_pvalue, exact_law

GREEDY = SamplingParams()
MAX_NEW = 64


class Oracle:
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


class Garbage:
    """Proposes k uniformly random tokens."""

    name = "garbage"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.seed = vocab, seed

    def reset(self, prompt_ids):
        self.g = torch.Generator().manual_seed(self.seed)

    def propose(self, tokens, k):
        return torch.randint(self.vocab, (k,), generator=self.g).tolist(), None


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

V = 8
EOS = 7
PROMPT = [1, 2, 3]
N_SAMPLES = 1500
MAX_NEW_TINY = 4  # with BLOCK_TINY = 4 the first round drafts 2 tokens after the prefill's token
BLOCK_TINY = 4
NOISE = 0.08  # the one-hot drafter's output-layer noise: it agrees with the target about half the time
TEMP = SamplingParams(temperature=0.8)
TRUNCATED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
Q = torch.softmax(1.5 * torch.randn(V, generator=torch.Generator().manual_seed(1)), -1)  # a wrong draft law


class StubTokenizer:
    eos_token_id = EOS

    def decode(self, ids):
        return " ".join(map(str, ids))


class SampledProposer:
    """Drafts i.i.d. from the fixed distribution Q, which ignores the context, and says so (q = Q)."""

    name = "sampled"

    def __init__(self, seed: int):
        self.seed = seed

    def reset(self, prompt_ids):
        self.g = torch.Generator().manual_seed(self.seed)

    def propose(self, tokens, k):
        return torch.multinomial(Q, k, replacement=True, generator=self.g).tolist(), Q.expand(k, V)


class GreedyDrafter:
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


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards: threading only adds overhead
    yield tiny_model()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def proposers(tiny):
    """Proposer factories (seed -> proposer) by kind: drafts sampled from Q and q = Q, or greedy drafts of a
    noisy copy of the target and q = None."""
    drafter = GreedyDrafter(tiny_model(noise=NOISE))
    return {"sampled_q": SampledProposer, "one_hot": lambda seed: drafter}


def draw(model, params: SamplingParams, proposer=None) -> tuple[list[tuple[int, ...]], Counter]:
    """N_SAMPLES independent outputs (seed i for sample i) and the histogram of acceptance lengths."""
    outputs, rounds = [], Counter()
    for i in range(N_SAMPLES):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=i)
        res = generate(model, StubTokenizer(), PROMPT, p, MAX_NEW_TINY, block_size=BLOCK_TINY,
                       proposer=None if proposer is None else proposer(10**6 + i))
        outputs.append(tuple(res.token_ids))
        rounds.update(res.acceptance_lengths)
    return outputs, rounds


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


def test_plain_sampling_matches_exact_distribution(tiny):
    samples, _ = draw(tiny, TEMP)
    assert chi2_pvalue(samples, exact_law(tiny, PROMPT, TEMP, MAX_NEW_TINY, EOS)) > 1e-3


@pytest.mark.parametrize("params", [TEMP, TRUNCATED], ids=["temperature", "top_k+top_p"])
@pytest.mark.parametrize("kind", ["sampled_q", "one_hot"])
def test_speculative_sampling_is_lossless(tiny, proposers, params, kind):
    dist = exact_law(tiny, PROMPT, params, MAX_NEW_TINY, EOS)
    samples, rounds = draw(tiny, params, proposers[kind])
    assert set(samples) <= set(dist)  # never a token that top-k / top-p removed
    assert rounds[1] > 100 and rounds[3] > 50  # both rejections and fully accepted blocks + bonus occur
    assert chi2_pvalue(samples, dist) > 1e-3


@pytest.mark.parametrize("broken", [accept_every_draft, resample_from_p_on_rejection])
@pytest.mark.parametrize("kind", ["sampled_q", "one_hot"])
def test_the_statistic_catches_a_broken_rule(tiny, proposers, monkeypatch, broken, kind):
    monkeypatch.setattr(d3d.engine, "verify", broken)
    samples, _ = draw(tiny, TEMP, proposers[kind])
    assert chi2_pvalue(samples, exact_law(tiny, PROMPT, TEMP, MAX_NEW_TINY, EOS)) < 1e-6
