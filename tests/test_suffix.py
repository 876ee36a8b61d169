"""The suffix reference (SuffixDecoding through arctic-inference's suffix trees, verified as a token tree):
lossless when greedy and when sampling, learns from the prompt and from earlier responses (not from
earlier responses with learning off), and fails with one line when arctic-inference is missing."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import d3d.decoding.tokentree
from d3d.decoding.engine import generate
from d3d.errors import D3DError
from d3d.methods.catalog import make_runner
from d3d.corpus.prompts import encode_prompt
from d3d.methods.registry import REGISTRY
from d3d.methods.suffix import SUFFIX_DEFAULTS, SuffixProposer, SuffixRunner, suffix_cache
from d3d.decoding.verify import SamplingParams
from helpers import EOS, SUFFIX_EXTRA, StubTokenizer, tiny_model
from sampling_law import chi2_pvalue, draw, exact_law, no_residual_update

try:
    import arctic_inference.suffix_decoding  # noqa: F401
    MISSING = None
except ImportError as e:
    MISSING = str(e)
needs_arctic = pytest.mark.skipif(MISSING is not None, reason=f"needs the suffix extra ({MISSING}): {SUFFIX_EXTRA}")

GREEDY = SamplingParams()
PROMPT = [1, 2, 3, 1, 2]


def tiny_runner(model, budget: int = 8, **options) -> SuffixRunner:
    return SuffixRunner(model, StubTokenizer(), SuffixProposer(suffix_cache(), budget, **options))


def test_a_missing_package_is_a_one_line_error(monkeypatch):
    assert "suffix" in REGISTRY  # registered whether or not the package is there
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import fails as if not installed
    with pytest.raises(D3DError, match=r'pip install --no-build-isolation -e "\.\[suffix\]"') as e:
        make_runner("suffix", tiny_model(), StubTokenizer(), Path("tiny"))
    assert "\n" not in str(e.value) and "arctic-inference==0.3.0" in str(e.value)


@needs_arctic
def test_the_tree_is_the_caches_speculation_cut_to_depth_and_budget():
    """Earlier responses 1 2 3 4, 1 2 3 7, 1 2 9: after ... 1 2 the global tree continues with 3 (2 of 3)
    then 4 or 7, or with 9; the local tree (prompt 0 and the response 1 2) has nothing after 1 2."""
    cache = suffix_cache()
    for i, response in enumerate([[1, 2, 3, 4], [1, 2, 3, 7], [1, 2, 9]]):
        cache.start_request(f"earlier{i}", [5, 6])
        cache.add_active_response(f"earlier{i}", response)
        cache.stop_request(f"earlier{i}")
    proposer = SuffixProposer(cache, budget=16, max_spec_factor=4.0)
    proposer.reset([0])
    tree = proposer.propose([0, 1, 2], k=8)
    edges = {(tree.tokens[tree.parents[i]], tree.tokens[i]) for i in range(1, len(tree))}
    assert tree.tokens[0] == 2 and edges == {(2, 3), (2, 9), (3, 4), (3, 7)}
    assert [tree.tokens[c.child] for c in tree.cands[0]] == [3, 9]  # most likely first
    assert tree.sources[1:] == [{"suffix"}] * (len(tree) - 1) and proposer.match_lens == [2]
    assert sorted(proposer.propose([0, 1, 2], k=1).tokens[1:]) == [3, 9]  # no node deeper than k
    small = SuffixProposer(cache, budget=2, max_spec_factor=4.0)
    small.reset([0])
    assert small.propose([0, 1, 2], k=8).tokens == [2, 3]  # budget counts the root
    assert proposer.propose([0, 1, 2], k=0).tokens == [2]
    # the default factor (1.0) allows as many tokens as the match is long: 2 after "1 2"
    proposer.max_spec_factor = SUFFIX_DEFAULTS["max_spec_factor"]
    assert len(proposer.propose([0, 1, 2], k=8)) == 3


@needs_arctic
def test_tiny_greedy_is_plain_decoding_and_requests_close(tiny):
    runner = tiny_runner(tiny)
    path = tiny_runner(tiny, use_tree_spec=False)  # vLLM's single-path speculation
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], PROMPT, [4, 4, 0, 6]):
        ar = generate(tiny, StubTokenizer(), prompt, GREEDY, 30)
        for run in (runner, path, runner):  # the second time with this response in the global tree
            res = run(prompt, params=GREEDY, max_new_tokens=30)
            assert res.token_ids == ar.token_ids and res.finish_reason == ar.finish_reason
            assert max(res.tree_sizes) <= 8 and sum(res.acceptance_lengths) == len(res.token_ids) - 1
    cache = runner.proposer.cache
    assert not cache.active_requests and len(cache.cached_requests) == 6  # every response stays cached
    assert sum(res.acceptance_lengths) > 2 * len(res.acceptance_lengths)  # a response seen before: tau > 2

    def cancel(chunk, accepted):
        if len(seen) == 3:
            raise RuntimeError("client went away")
        seen.append(chunk)

    seen = []
    with pytest.raises(RuntimeError):
        runner(PROMPT, params=GREEDY, max_new_tokens=30, on_round=cancel)
    assert not cache.active_requests  # closed all the same; the next request starts cleanly
    assert runner(PROMPT, params=GREEDY, max_new_tokens=30).token_ids == \
        generate(tiny, StubTokenizer(), PROMPT, GREEDY, 30).token_ids


@needs_arctic
def test_with_learning_off_a_generation_drafts_as_if_it_were_the_first(tiny):
    """Learning on (the default): the second of two identical generations drafts from the first's response
    in the global tree, so it needs fewer rounds, and forget() empties that tree. Learning off (--no-learn,
    learn=False): the cache keeps no global tree, so the second runs round for round as the first. Every
    output is plain decoding's."""
    prompt = [4, 4, 0, 6]
    ar = generate(tiny, StubTokenizer(), prompt, GREEDY, 30)
    on, off = (make_runner("suffix", tiny, StubTokenizer(), Path("tiny"), block_size=8, learn=learn)
               for learn in (None, False))
    assert on.settings["learn"] is True and on.settings["max_cached_requests"] == SUFFIX_DEFAULTS["max_cached_requests"]
    assert off.settings["learn"] is False and off.settings["max_cached_requests"] == 0 and not hasattr(off, "forget")
    runs = {runner: [runner(prompt, params=GREEDY, max_new_tokens=30) for _ in range(2)] for runner in (on, off)}
    assert all(r.token_ids == ar.token_ids for pair in runs.values() for r in pair)
    first, second = runs[on]
    assert len(second.acceptance_lengths) < len(first.acceptance_lengths)
    first, second = runs[off]
    assert second.acceptance_lengths == first.acceptance_lengths and second.tree_sizes == first.tree_sizes
    assert not off.fn.__self__.proposer.cache.cached_requests
    on.forget()
    assert on(prompt, params=GREEDY, max_new_tokens=30).acceptance_lengths == runs[on][0].acceptance_lengths
    on.forget()
    on.learn(prompt, ar.token_ids)  # a resumed bench replays a generation: as if it had run here
    assert on(prompt, params=GREEDY, max_new_tokens=30).acceptance_lengths == runs[on][1].acceptance_lengths
    assert not on.fn.__self__.proposer.cache.active_requests


@needs_arctic
def test_greedy_equals_plain_decoding_and_learns_from_the_prompt_and_earlier_responses(smol, prompt_ids):
    model, tok, model_dir = smol
    runner = make_runner("suffix", model, tok, model_dir)
    assert runner.settings == {"block_size": 16, "tree_budget": 16, "use_tree_spec": True,
                               "arctic_inference": "0.3.0", "learn": True, **SUFFIX_DEFAULTS}
    copy = encode_prompt(tok, "Repeat this list exactly, twice: apple, banana, cherry, dates, elderberry, fig, grape.")
    for ids in (prompt_ids[0], copy):
        ar = generate(model, tok, ids, GREEDY, 32)
        first = runner(ids, params=GREEDY, max_new_tokens=32)
        again = runner(ids, params=GREEDY, max_new_tokens=32)  # the first response is in the global tree
        assert first.token_ids == again.token_ids == ar.token_ids and first.text == ar.text
        assert again.tau >= 3.0 and again.tau > first.tau and "suffix" in again.branches
    assert first.tau > 1.3  # the copy prompt: drafts from its own prompt, on its first request


@pytest.mark.slow
@needs_arctic
def test_sampling_keeps_the_target_law_and_a_broken_rule_is_caught(tiny, monkeypatch):
    """The cache learns from every earlier sample (its trees change between draws, never within one from
    this draw's own outcomes), so each draw's law is still the target's."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    dist = exact_law(tiny, PROMPT, params, 4, EOS)
    branches = Counter()

    def run_with(runner):
        def run(p):
            res = runner(PROMPT, params=p, max_new_tokens=6)
            branches.update(res.branches)
            return res
        return run

    samples, rounds = draw(run_with(tiny_runner(tiny)), params, 1200, 4)
    assert chi2_pvalue(samples, dist) > 1e-3
    assert branches["suffix"] > 600 and rounds[3] + rounds[4] > 100  # drafts accepted, often several at once
    monkeypatch.setattr(d3d.decoding.tokentree, "_choose", no_residual_update)
    samples, _ = draw(run_with(tiny_runner(tiny)), params, 1200, 4)
    assert chi2_pvalue(samples, dist) < 1e-6
