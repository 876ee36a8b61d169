"""Asynchronous D3D on tiny random models: the packed pass's layout, its equality with synchronous
drafts, the drafter cache after a round, and losslessness of generate_async (greedy and sampling)."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from d3d.decoding.async_engine import generate_async
from d3d.drafters.drafter import Drafter
from d3d.decoding.engine import generate
from d3d.errors import D3DError
from d3d.decoding.packed import acceptance_law, keep_prefix, likely_candidates, packed_draft, packed_layout
from d3d.decoding.trace import write_chrome_trace
from d3d.decoding.verify import SamplingParams
from helpers import EOS, V, StubTokenizer, drafted_rounds, tiny_pair
from sampling_law import chi2_pvalue, exact_law

torch.set_num_threads(1)  # thousands of tiny forwards: threading only adds overhead


def fresh(d: Drafter, ctx: list[int] = ()) -> Drafter:
    d.setup_cache(1, 128)
    d.cached_tokens = []
    d.extend(list(ctx))
    return d


# --------------------------------------------------------------------------------------------
# The packed pass


def test_packed_layout_who_attends_to_whom():
    L, B = 2, 3
    positions, mask = packed_layout(L, 3, [0, 1, 2], B)
    assert positions.tolist() == [2, 3, 4, 3, 4, 5, 4, 5, 6, 5, 6, 7]
    assert mask.shape == (12, 14)
    assert mask[:, :L].all()                                         # everyone sees the cached context
    v = range(L, L + 3)                                              # key columns of V
    assert mask[:3][:, v].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not mask[:3, L + 3:].any()                                # V never sees a candidate
    for a in range(3):
        rows = range(3 + B * a, 3 + B * (a + 1))
        own = [L + r for r in rows]
        for r in rows:
            sees = set(torch.nonzero(mask[r]).flatten().tolist())
            assert sees == set(range(L)) | set(range(L, L + a + 1)) | set(own), (a, r, sees)

    positions, mask = packed_layout(5, 4, [3, 1], 2)                # a subset, in the caller's order
    assert positions.tolist() == [5, 6, 7, 8, 9, 10, 7, 8]
    assert set(torch.nonzero(mask[4]).flatten().tolist()) == set(range(9)) | {9, 10}
    assert set(torch.nonzero(mask[6]).flatten().tolist()) == set(range(7)) | {11, 12}
    with pytest.raises(ValueError):
        packed_layout(5, 4, [4], 2)


def test_each_candidate_equals_a_synchronous_draft():
    _, d = tiny_pair(32, 4)
    g = torch.Generator().manual_seed(0)
    ctx, V = torch.randint(32, (9,), generator=g).tolist(), torch.randint(32, (4,), generator=g).tolist()
    packed = packed_draft(fresh(d, ctx), V)
    assert packed.shape == (4, 4, 32)
    for a in range(4):
        sync = fresh(d).draft_block(ctx + V[:a + 1])
        assert torch.allclose(packed[a], sync, atol=1e-4), a

    hidden = packed_draft(fresh(d, ctx), V, apply_head=False)         # LM head afterwards, on one candidate
    assert torch.allclose(d.head(hidden[2]), packed[2], atol=1e-5)


def test_packing_a_subset_gives_the_same_candidates():
    _, d = tiny_pair(32, 4, seed=1)
    g = torch.Generator().manual_seed(1)
    ctx, V = torch.randint(32, (7,), generator=g).tolist(), torch.randint(32, (4,), generator=g).tolist()
    full = packed_draft(fresh(d, ctx), V)
    for subset in ([3, 1], [0], [2]):
        part = packed_draft(fresh(d, ctx), V, subset)
        assert torch.allclose(part, full[subset], atol=1e-5), subset
    short = packed_draft(fresh(d, ctx), V[:2])                          # a block cut by max_new_tokens
    assert torch.allclose(short, full[:2], atol=1e-5)


def test_drafter_cache_after_a_round_then_sync_drafts_equal_from_scratch():
    _, d = tiny_pair(32, 4, seed=2)
    g = torch.Generator().manual_seed(2)
    ctx, V = torch.randint(32, (10,), generator=g).tolist(), torch.randint(32, (4,), generator=g).tolist()
    for a in range(4):
        fresh(d, ctx)
        packed_draft(d, V, [0, a])
        assert d.cache_len == len(ctx) + 4 and d.cached_tokens == ctx + V
        keep_prefix(d, len(ctx) + a + 1)
        assert d.cache_len == len(ctx) + a + 1 and d.cached_tokens == ctx + V[:a + 1]
        verified = ctx + V[:a + 1] + [a + 20]                          # + the target's bonus token
        incremental = d.draft_block(verified)
        scratch = fresh(d).draft_block(verified)
        assert torch.allclose(incremental, scratch, atol=1e-5), a


def test_likely_candidates_follow_the_drafters_confidence():
    law = acceptance_law([0.9, 0.5, 0.1])
    assert sum(law) == pytest.approx(1.0)
    assert law == pytest.approx([0.1, 0.45, 0.405, 0.045])
    assert likely_candidates([0.9, 0.5, 0.1], 2) == [1, 2]
    assert likely_candidates([0.01, 0.9], 1) == [0]


# --------------------------------------------------------------------------------------------
# generate_async, greedy: identical to plain decoding

FAVOURED = (5, 1.5)
CONFIGS = [dict(overlap=True), dict(overlap=False), dict(max_candidates=2),
           dict(successor_slots=3, head_all=True)]


@pytest.fixture(scope="module")
def greedy_pair():
    return tiny_pair(16, 4, favour=FAVOURED)


def greedy_prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(16, (5 + i,), generator=g).tolist() for i in range(n)]


def test_greedy_equals_plain_decoding(greedy_pair):
    target, d = greedy_pair
    tok = StubTokenizer(16, eos=-1)
    accepted, hits, fallbacks = Counter(), 0, 0
    for ids in greedy_prompts():
        ar = generate(target, tok, ids, max_new_tokens=40)
        for cfg in CONFIGS:
            res = generate_async(target, tok, ids, max_new_tokens=40, drafter=d, **cfg)
            assert res.token_ids == ar.token_ids and res.finish_reason == "length" and res.text == ar.text, cfg
            assert sum(res.acceptance_lengths) == 39
            accepted.update(res.acceptance_lengths)
            hits, fallbacks = hits + res.stats["packed_hits"], fallbacks + res.stats["fallbacks"]
            assert res.stats["packed_hits"] + res.stats["fallbacks"] == drafted_rounds(res, 40) - 1
            assert all(len(res.stats[k]) == res.rounds for k in ("verify_s", "draft_s", "candidates"))
    assert set(accepted) == {1, 2, 3, 4}                              # every acceptance depth occurs
    assert hits > 50 and fallbacks > 5


@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 17])
def test_greedy_max_new_tokens_is_exact(greedy_pair, max_new):
    target, d = greedy_pair
    tok = StubTokenizer(16, eos=-1)
    for ids in greedy_prompts(2):
        ar = generate(target, tok, ids, max_new_tokens=max_new)
        for overlap in (True, False):
            res = generate_async(target, tok, ids, max_new_tokens=max_new, drafter=d, overlap=overlap)
            assert res.token_ids == ar.token_ids and res.finish_reason == "length"


def test_greedy_eos_in_the_middle(greedy_pair):
    target, d = greedy_pair
    for ids in greedy_prompts():
        out = generate(target, StubTokenizer(16, eos=-1), ids, max_new_tokens=30).token_ids
        j = next(j for j in range(3, 30) if out[j] not in out[:j])      # a token first produced mid-output
        tok = StubTokenizer(16, eos=out[j])
        ar = generate(target, tok, ids, max_new_tokens=30)
        assert ar.finish_reason == "eos" and ar.token_ids == out[:j + 1]
        for overlap in (True, False):
            res = generate_async(target, tok, ids, max_new_tokens=30, drafter=d, overlap=overlap)
            assert res.token_ids == ar.token_ids and res.finish_reason == "eos" and res.text == ar.text


def test_greedy_stop_string(greedy_pair):
    target, d = greedy_pair
    tok = StubTokenizer(16, eos=-1)
    for ids in greedy_prompts(2):
        out = generate(target, tok, ids, max_new_tokens=30).token_ids
        stop = [tok.decode(out[6:8])]
        ar = generate(target, tok, ids, max_new_tokens=30, stop=stop)
        assert ar.finish_reason == "stop"
        res = generate_async(target, tok, ids, max_new_tokens=30, drafter=d, stop=stop)
        assert res.token_ids == ar.token_ids and res.finish_reason == "stop" and res.text == ar.text
    for engine in (generate, lambda *a, **k: generate_async(*a, drafter=d, **k)):
        with pytest.raises(D3DError, match="stop strings must be non-empty"):  # "" would end every answer at once
            engine(target, tok, ids, max_new_tokens=30, stop=["\n", ""])


def test_trace_has_verify_and_draft_spans(greedy_pair, tmp_path):
    target, d = greedy_pair
    trace: list[dict] = []
    res = generate_async(target, StubTokenizer(16, eos=-1), greedy_prompts(1)[0], max_new_tokens=20, drafter=d,
                         trace=trace)
    verify = [e for e in trace if e["name"] == "verify"]
    draft = [e for e in trace if e["name"] == "draft"]
    assert len(verify) == res.rounds and all(e["tid"] == 0 and e["ph"] == "X" and e["dur"] >= 0 for e in verify)
    assert len(draft) >= res.stats["packed_hits"] and all(e["tid"] == 1 for e in draft)
    write_chrome_trace(trace, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["name"] for e in events} >= {"verify", "draft", "prefill", "thread_name"}
    assert json.dumps(res.to_json())


# --------------------------------------------------------------------------------------------
# generate_async, sampling: the law of plain sampling

PROMPT = [1, 2, 3]
FIRST = 3           # compare the law of the first 3 generated tokens
MAX_NEW = 6         # long enough that blocks from the packed pass produce some of those tokens
N_SAMPLES = 2000
TEMP = SamplingParams(temperature=0.8)


@pytest.mark.slow
def test_sampling_has_the_law_of_plain_sampling():
    target, d = tiny_pair(V, 3)
    tok = StubTokenizer(V, EOS)
    samples, accepted, hits = [], Counter(), 0
    for i in range(N_SAMPLES):
        params = SamplingParams(TEMP.temperature, seed=i)
        res = generate_async(target, tok, PROMPT, params, MAX_NEW, drafter=d, overlap=False)
        if i < 20:  # the concurrent schedule computes exactly the same thing
            same = generate_async(target, tok, PROMPT, params, MAX_NEW, drafter=d, overlap=True)
            assert same.token_ids == res.token_ids
        samples.append(tuple(res.token_ids[:FIRST]))
        accepted.update(res.acceptance_lengths)
        hits += res.stats["packed_hits"]
    assert accepted[1] > 100 and accepted[3] > 100 and hits > 1000
    dist = exact_law(target, PROMPT, TEMP, FIRST, EOS)
    assert abs(sum(dist.values()) - 1) < 1e-6 and set(samples) <= set(dist)
    assert chi2_pvalue(samples, dist) > 1e-3
