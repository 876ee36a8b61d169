"""Token-tree verification (d3d.decoding.tree, d3d.decoding.tokentree, d3d.decoding.treecost): the tree forward equals each branch run alone, cache compaction
keeps exactly the accepted path, greedy output is plain decoding's on real prompts, and the
multi-candidate sampling rule keeps the target's law (a broken rule is caught)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import d3d.decoding.tokentree
import d3d.methods.tree
import d3d.decoding.treecost
from d3d.decoding.engine import LogprobRecorder, generate
from d3d.methods.catalog import make_runner
from d3d.methods.d3d import D3DProposer
from d3d.decoding.tokentree import Candidate, TokenTree, TreeDraft, compact_cache, tree_logits, tree_mask, tree_positions
from d3d.methods.ngram import longest_continuations, ngram_continuations
from d3d.corpus.datastore import shipped_datastore
from d3d.decoding.tree import generate_tree
from d3d.methods.tree import TreeProposer
from d3d.decoding.treecost import WidthCost, choose_budget, choose_slots
from d3d.decoding.verify import SamplingParams, probs_from_logits
from helpers import EOS, V, StubTokenizer, tiny_datastore, tiny_drafter, tiny_model
from sampling_law import chi2_pvalue, draw, exact_law, no_residual_update

GREEDY = SamplingParams()
CONTEXT = [1, 2, 3, 4, 5, 1, 2]
BRANCHES = [[3, 4, 5], [3, 6], [6, 0, 1, 2], [5]]  # shared prefixes merge: 3 -> {4, 6}


def branch_tree(root: int) -> TokenTree:
    draft = TreeDraft(root)
    for i, b in enumerate(BRANCHES):
        draft.add(b, [0.9 - 0.1 * i] * len(b), "test")
    return draft.select(budget=100, max_depth=10)


def alone(model, tokens: list[int]) -> torch.Tensor:
    """Logits of the last token of `tokens`, run causally from scratch."""
    model.setup_cache(1, 64)
    return model(torch.tensor([tokens]))[0, -1]


def test_tree_layout():
    tree = branch_tree(root=2)
    assert len(tree) == 1 + 9  # 12 branch tokens, 3 of them in the shared prefix [3]
    assert all(p < i for i, p in enumerate(tree.parents) if i)  # parents before children
    leaves = [i for i in range(len(tree)) if i not in tree.parents]
    assert sorted([tree.tokens[j] for j in tree.path_to(i)] for i in leaves) == sorted(BRANCHES)
    assert [c.token for c in tree.cands[0]] == [3, 6, 5]
    three = tree.cands[0][0].child
    assert [c.token for c in tree.cands[three]] == [4, 6]
    mask = tree_mask(tree.parents, 3)[0, 0]
    assert mask.shape == (10, 13) and mask[:, :3].all()
    for i in range(len(tree)):
        assert torch.nonzero(mask[i, 3:]).flatten().tolist() == sorted([0] + tree.path_to(i))
    assert tree_positions(tree.depths, 3).tolist() == [3 + d for d in tree.depths]
    assert tree.depths == [len(tree.path_to(i)) for i in range(len(tree))]


def test_budget_keeps_the_best_ancestor_closed_nodes():
    draft = TreeDraft(0)
    for i, b in enumerate(BRANCHES):
        draft.add(b, [0.9 - 0.1 * i] * len(b), "test")
    small = draft.select(budget=5, max_depth=2)
    assert len(small) == 5 and max(small.depths) <= 2
    assert [small.tokens[j] for j in small.path_to(2)] == [3, 4]  # 0.9, 0.81, then 0.72 and 0.7
    assert sorted(c.token for c in small.cands[0]) == [3, 6]  # the root's 5 (score 0.6) was cut


def test_tree_forward_equals_each_branch_alone(tiny):
    tiny.setup_cache(1, 64)
    tiny(torch.tensor([CONTEXT[:-1]]))
    tree = branch_tree(CONTEXT[-1])
    logits = tree_logits(tiny, tree)
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        torch.testing.assert_close(logits[node], alone(tiny, CONTEXT + path), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared", [True, False], ids=["one-cache-tensor", "own-cache-per-layer"])
@pytest.mark.parametrize("leaf", [0, 3, 5, 9])
def test_compaction_keeps_exactly_the_accepted_path(tiny, leaf, shared):
    base = len(CONTEXT) - 1
    for layer in tiny.layers:
        layer.attention.k_cache = layer.attention.v_cache = None
    tiny.setup_cache(1, 64)
    if not shared:  # caches replaced after setup (as d3d.corpus.data does): each layer's rows are moved on their own
        for att in (layer.attention for layer in tiny.layers):
            att.k_cache, att.v_cache = att.k_cache.clone(), att.v_cache.clone()
    assert (tiny.layers[0].attention.k_cache is tiny.cache_views[0]) == shared
    tiny(torch.tensor([CONTEXT[:-1]]))
    tree = branch_tree(CONTEXT[-1])
    tree_logits(tiny, tree)
    path = tree.path_to(leaf)
    compact_cache(tiny, base, path)
    assert tiny.cache_len == base + 1 + len(path)
    text = CONTEXT + [tree.tokens[i] for i in path]
    kept = [(layer.attention.k_cache[0, :, :len(text)].clone(), layer.attention.v_cache[0, :, :len(text)].clone())
            for layer in tiny.layers]
    after = tiny(torch.tensor([[7, 1]]))[0, -1]  # two more tokens on the compacted cache
    torch.testing.assert_close(after, alone(tiny, text + [7, 1]), atol=1e-5, rtol=1e-5)
    alone(tiny, text)
    for layer, (k, v) in zip(tiny.layers, kept):  # the same K/V rows as a fresh prefill of the same text
        torch.testing.assert_close(k, layer.attention.k_cache[0, :, :len(text)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, layer.attention.v_cache[0, :, :len(text)], atol=1e-5, rtol=1e-5)


def test_ngram_continuations_longest_first():
    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3, 6, 3]
    assert ngram_continuations(tokens, 2, max_matches=3) == [(1, [6, 3]), (1, [8, 7]), (1, [9, 1])]
    tokens = [1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3]
    assert ngram_continuations(tokens, 2, max_matches=3) == [(3, [4, 0]), (2, [5, 1])]  # no duplicate


def test_longest_continuations_rank_by_the_whole_match():
    """The occurrence that agrees furthest back comes first, not the latest one (the tree methods' n-gram
    nodes): here the text ends with 4 2 3, which earlier occurred once (followed by 7 8), while 2 3 alone
    occurred later (followed by 5 6)."""
    tokens = [4, 2, 3, 7, 8, 1, 2, 3, 5, 6, 9, 4, 2, 3]
    assert ngram_continuations(tokens, 2, max_matches=2) == [(3, [7, 8]), (2, [5, 6])]
    assert longest_continuations(tokens, 2, max_matches=2) == [(3, [7, 8]), (2, [5, 6])]
    tokens = [0, 1, 2, 3, 4, 5, 6, 9, 9, 5, 6, 1, 2, 3, 4, 5, 6]  # a 6-token match beats a latest 2-token one
    assert ngram_continuations(tokens, 2, max_matches=1) == [(3, [9, 9])]
    assert longest_continuations(tokens, 2) == [(6, [9, 9]), (2, [1, 2])]
    assert longest_continuations(tokens, 2, max_match=4) == [(4, [9, 9]), (2, [1, 2])]  # capped at 4
    assert longest_continuations([1, 2, 5, 1, 2, 6, 1, 2], 2) == [(2, [6, 1]), (2, [5, 1])]  # equal: latest first
    assert longest_continuations([3], 2) == [] and longest_continuations([3, 3], 2) == [(1, [3])]


def test_choose_budget_from_the_cost_curve():
    curve = {1: 0.05, 2: 0.05, 4: 0.06, 8: 0.07, 16: 0.09, 32: 0.105, 64: 0.2}
    assert choose_budget(curve) == 32
    assert choose_budget(curve, max_ratio=1.1) == 16
    assert choose_budget({w: float(w) for w in curve}) == 16  # compute-bound: no wider than a block
    assert choose_budget(curve | {16: 0.2, 32: 0.105}) == 64  # 32 "faster" than 16 is noise: it costs 0.2 too


def test_width_cost_picks_the_best_expected_throughput():
    cost = WidthCost({1: 1.0, 2: 2.0, 4: 2.2, 8: 2.4})
    assert cost(3) == pytest.approx(2.1) and cost(16) == pytest.approx(2.8)
    assert cost.best_width([0.9, 0.8, 0.7, 0.01]) == 4  # 3.4 / 2.2 beats 1 / 1, 2.7 / 2.1 and 3.41 / 2.25
    assert cost.best_width([0.3, 0.2]) == 1             # a wider forward would not pay for itself
    assert WidthCost(cost.curve, overhead=3.0).best_width([0.3, 0.2]) == 3  # unless drafting dominates
    flat = WidthCost({1: 1.0, 64: 1.0})
    assert flat.best_width([0.01] * 20) == 21


def test_the_drafter_runs_while_it_pays_and_is_probed_when_it_does_not():
    tree = TreeProposer(None, cost=WidthCost({1: 1.0, 16: 1.0}, overhead=0.5))
    tree.reset([1])
    assert tree.drafting_pays()  # optimistic start
    drafted = TokenTree([0, 5], [-1, 0], [0, 1], [{"root"}, {"d3d"}], [[], []])
    for _ in range(5):
        tree.drafted = True
        tree.accept(drafted, [])  # it proposed nothing that was accepted
    assert not tree.drafting_pays()
    for _ in range(d3d.decoding.budget.PROBE_ROUNDS):
        tree.drafted = False
        tree.accept(drafted, [])
    assert tree.drafting_pays()  # probed again
    for _ in range(10):
        tree.drafted = True
        tree.accept(drafted, [1])  # now its token is accepted every round
    assert tree.drafting_pays()
    copied = TokenTree([0, 5, 6, 7, 8], [-1, 0, 1, 2, 3], [0, 1, 2, 3, 4], [{"root"}] + [{"ngram"}] * 4, [[]] * 5)
    for _ in range(d3d.decoding.budget.PROBE_ROUNDS - 1):
        tree.drafted = False
        tree.accept(copied, [1, 2, 3, 4])  # n-gram copies make tokens 5x cheaper ...
    assert not tree.drafting_pays()  # ... so the drafter's one token a round is no longer worth its cost


def test_ngram_rates_are_learned_from_the_nodes_whose_parent_was_reached():
    tree = TreeProposer(None)
    tree.reset([1])
    key, deeper = ("ngram", 1, 0, 0), ("ngram", 1, 0, 1)
    prior = tree.rate(key)
    assert prior == d3d.methods.tree.NGRAM_CONFIDENCE[1]
    draft = TreeDraft(7)
    draft.add([3, 4], [prior, prior], "ngram", keys=[key, deeper])
    t = draft.select(budget=10, max_depth=5)
    assert t.keys == [set(), {key}, {deeper}]
    for _ in range(20):
        tree.drafted = False
        tree.accept(t, [])  # its first token was tried and rejected; the second never reached
    assert tree.rate(key) < 0.05 and tree.rate(deeper) == prior
    for _ in range(20):
        tree.drafted = False
        tree.accept(t, [1, 2])  # both accepted
    assert tree.rate(key) > 0.5 and tree.rate(deeper) > prior


def test_choose_slots_keeps_the_slots_that_cost_little(monkeypatch):
    drafter = type("D", (), {"block_size": 16})()
    proposer = type("P", (), {"drafter": drafter})()
    costs = {2: 1.0, 4: 1.2, 8: 1.3, 16: 2.0}  # compute-bound beyond 4 slots, as on a CPU
    monkeypatch.setattr(d3d.decoding.treecost, "drafter_costs", lambda p, slots: {s: costs[s] for s in slots})
    assert choose_slots(proposer) == (4, 1.2, 1.0 / 14)
    monkeypatch.setattr(d3d.decoding.treecost, "drafter_costs", lambda p, slots: {s: 1.0 for s in slots})
    assert choose_slots(proposer) == (16, 1.0, 0.0)  # bound by reading the weights, as on a GPU


# --------------------------------------------------------------------------------------------
# Greedy identity on the real target with the shipped drafter


def test_greedy_equals_plain_decoding_on_real_prompts(smol, prompt_ids, short_answer_ids):
    model, tok, model_dir = smol
    tree = make_runner("d3d-tree", model, tok, model_dir, tree_budget=24)
    assert tree.settings == {"block_size": 16, "tree_budget": 24, "draft_slots": None, "tree_width_cost_s": None,
                             "datastore": str(shipped_datastore(model_dir).resolve()), "learn": True,
                             "learn_tokens": 65536}
    branches = Counter()
    for ids in prompt_ids[:1] + prompt_ids[-1:]:
        ar = generate(model, tok, ids, GREEDY, 32)
        res = tree(ids, params=GREEDY, max_new_tokens=32)
        assert res.token_ids == ar.token_ids and res.text == ar.text
        assert sum(res.acceptance_lengths) == 31 and max(res.tree_sizes) <= 24
        branches.update(res.branches)
    assert max(branches.values()) < sum(branches.values())  # accepted paths from several sources
    ar = generate(model, tok, short_answer_ids, GREEDY, 32)
    res = tree(short_answer_ids, params=GREEDY, max_new_tokens=32, stop=None)
    assert res.token_ids == ar.token_ids and res.finish_reason == ar.finish_reason == "eos"
    seen, rounds = [], []  # on_branch gets each round's accepted branch, before that round's on_round
    res = tree(prompt_ids[0], params=GREEDY, max_new_tokens=16, on_branch=seen.append,
               on_round=lambda chunk, accepted: rounds.append(len(seen)))
    assert seen == res.branches and rounds == list(range(len(seen) + 1))
    res = tree(prompt_ids[0], params=GREEDY, max_new_tokens=5, logprobs=LogprobRecorder())
    ar = generate(model, tok, prompt_ids[0], GREEDY, 5, logprobs=LogprobRecorder())
    assert res.token_ids == ar.token_ids
    assert [e.logprob for e in res.logprobs] == pytest.approx([e.logprob for e in ar.logprobs], abs=1e-3)


def test_lookup_tree_greedy_equals_plain_decoding(smol, prompt_ids):
    model, tok, model_dir = smol
    lookup = make_runner("lookup-tree", model, tok, model_dir, tree_budget=12)
    bare = make_runner("lookup-tree", model, tok, model_dir, tree_budget=12, datastore="none")
    assert lookup.settings["datastore"] and bare.settings["datastore"] is None
    branches = Counter()
    for ids in prompt_ids[:2]:
        ar = generate(model, tok, ids, GREEDY, 32)
        res = lookup(ids, params=GREEDY, max_new_tokens=32)
        assert res.token_ids == ar.token_ids and max(res.tree_sizes) <= 12
        assert bare(ids, params=GREEDY, max_new_tokens=32).token_ids == ar.token_ids
        branches.update(res.branches)
    assert sum(n for b, n in branches.items() if "datastore" in b) > 0  # retrieval was accepted


# --------------------------------------------------------------------------------------------
# The multi-candidate rule keeps the target's law


ROW = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
LAW = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 1.5, 0.0, 0.0, 0.0, 0.0]), -1)  # how the first candidate is drawn


def node_outcomes(choose, params: SamplingParams, n: int) -> list[tuple[int]]:
    """n draws of one node whose candidates are a token drawn from LAW, then tokens 1 and 2 unless one of
    them was drawn: a random candidate set that depends on the drawn token, as a budget cut can make."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = int(torch.multinomial(LAW, 1, generator=g))
        cands = [Candidate(x, 1)] + [Candidate(t, 2 + i) for i, t in enumerate((1, 2)) if t != x]
        out.append((choose(cands, ROW, params, g)[1],))
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4,
                                                                                       top_p=0.8)])
def test_one_node_emits_the_target_law(params):
    law = probs_from_logits(ROW, params).double().tolist()
    dist = {(t,): p for t, p in enumerate(law) if p > 0}
    assert chi2_pvalue(node_outcomes(d3d.decoding.tokentree._choose, params, 12000), dist) > 1e-3
    assert chi2_pvalue(node_outcomes(no_residual_update, params, 12000), dist) < 1e-6


def tree_run(target, proposer):
    return lambda p: generate_tree(target, StubTokenizer(), [1, 2, 3, 1, 2], p, 6, proposer=proposer, max_depth=3)


@pytest.fixture(scope="module")
def tree_proposer(tiny):
    return TreeProposer(D3DProposer(tiny_drafter(tiny_model(noise=0.08)), V, max_len=64), budget=8, draft_slots=2,
                        datastore=tiny_datastore(tiny, [1, 2, 3, 1, 2]))


@pytest.mark.slow
def test_generation_keeps_the_law_and_a_broken_rule_is_caught(tiny, tree_proposer, monkeypatch):
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    dist = exact_law(tiny, [1, 2, 3, 1, 2], params, 4, EOS)
    branches = Counter()

    def run(p):
        res = generate_tree(tiny, StubTokenizer(), [1, 2, 3, 1, 2], p, 6, proposer=tree_proposer, max_depth=3)
        branches.update(res.branches)
        return res

    samples, _ = draw(run, params, 1200, 4)
    assert chi2_pvalue(samples, dist) > 1e-3
    assert branches["alt"] > 50 and branches["ngram"] > 50 and branches["d3d"] > 50  # every kind of sibling
    assert sum(n for b, n in branches.items() if "datastore" in b) > 50
    monkeypatch.setattr(d3d.decoding.tokentree, "_choose", no_residual_update)
    samples, _ = draw(tree_run(tiny, tree_proposer), params, 1200, 4)
    assert chi2_pvalue(samples, dist) < 1e-6


def test_a_drafter_whose_nodes_never_make_the_cut_stops_running(tiny, monkeypatch):
    """Its pass costs the same whether or not the selection keeps any of its nodes (copying long
    n-gram matches fills the budget): such rounds count as drafted with nothing gained, so it is then run
    only on probe rounds."""
    calls = []
    block = d3d.methods.tree.SlotBlock([[1]] * 2, [[0.9]] * 2)
    monkeypatch.setattr(d3d.methods.tree, "d3d_block", lambda *a, **k: calls.append(1) or block)
    proposer = TreeProposer(D3DProposer(tiny_drafter(tiny), V, max_len=64), budget=1, draft_slots=2,
                            cost=WidthCost({1: 1.0, 16: 1.0}, overhead=0.5))  # room for the root only
    res = generate_tree(tiny, StubTokenizer(), [1, 2, 3, 1, 2], GREEDY, 40, proposer=proposer, max_depth=3)
    rounds = len(res.acceptance_lengths)
    assert res.tree_sizes == [1] * rounds and rounds >= 30
    assert len(calls) <= rounds // 3  # a few rounds while its optimistic start decays, then probes only


@pytest.mark.slow
def test_a_tree_cut_to_two_nodes_keeps_the_law(tiny):
    """One node below the root: which candidate keeps it depends on the drafter's and the n-gram's tokens
    (a tree that held a token sampled from the drafter's law here failed this test at p = 1e-18)."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    proposer = TreeProposer(D3DProposer(tiny_drafter(tiny_model(noise=0.08)), V, max_len=64), budget=2,
                            draft_slots=2, datastore=tiny_datastore(tiny, [1, 2, 3, 1, 2]))
    samples, rounds = draw(tree_run(tiny, proposer), params, 1200, 4)
    assert sum(n for length, n in rounds.items() if length > 1) > 100  # its one node really was accepted
    assert chi2_pvalue(samples, exact_law(tiny, [1, 2, 3, 1, 2], params, 4, EOS)) > 1e-3


def test_in_a_batch_the_drafter_must_win_what_the_shared_forward_costs_a_token():
    """Alone a token costs its round's forward over the round's tokens; in a batch the shared forward over all of
    the batch's tokens, so a drafter pass (which delays every generation's forward) that pays alone stops."""
    def proposer(load):
        tree = TreeProposer(None, cost=WidthCost({1: 1.0, 2: 1.1, 16: 1.6}, overhead=0.4, load=load))
        tree.reset([1])
        drafted = TokenTree([0, 5, 6], [-1, 0, 1], [0, 1, 2], [{"root"}, {"d3d"}, {"d3d"}], [[], [], []])
        for _ in range(20):
            tree.drafted = True
            tree.accept(drafted, [1])  # one token only the drafter proposed, every round
        return tree

    assert proposer(None).drafting_pays()  # its token is worth (cost(3) + 0.4) / 2 = 0.77 >= 0.4
    assert not proposer(lambda: (7, 7.0)).drafting_pays()  # worth (cost(10) + 0.4) / 9 = 0.2 < 0.4


def test_a_generation_that_joins_a_batch_starts_from_the_batch_cost_of_a_token():
    """A drafter pass before any round of a request that joins a busy batch would delay every generation's
    forward: the cost of a token it starts from is the batch's (a one-token step beside the others' forward,
    over all of its tokens), so the drafter waits for its probe there, and runs at once alone."""
    def first_round_drafts(load):
        tree = TreeProposer(None, cost=WidthCost({1: 1.0, 2: 1.1, 16: 1.6}, overhead=0.4, load=load))
        tree.reset([1])
        return tree.drafting_pays()

    assert first_round_drafts(None)
    assert not first_round_drafts(lambda: (7, 7.0))  # cost(8) / 8 = 0.17 < 0.4


def test_the_drafter_stops_as_soon_as_the_others_decode():
    """Its worth follows the batch at once: a drafter that paid while the others were reading their prompts
    (no load) stops in the first round in which they decode."""
    load = [(0, 0.0)]
    tree = TreeProposer(None, cost=WidthCost({1: 1.0, 2: 1.1, 16: 1.6}, overhead=0.4, load=lambda: load[0]))
    tree.reset([1])
    assert tree.drafting_pays()
    load[0] = (7, 7.0)
    assert not tree.drafting_pays()  # cost(8) / 8 = 0.17 < 0.4


def test_in_a_batch_the_drafter_reads_the_prompt_only_when_it_first_drafts(tiny):
    """Beside generations that decode the drafter may never draft, and its prompt pass would take the cores their
    forwards need: in a batch reset leaves its cache empty and the first draft catches it up; alone it reads the
    prompt at once, as a single stream always did."""
    def reset(load):
        drafter = tiny_drafter(tiny)
        tree = TreeProposer(D3DProposer(drafter, V, max_len=64), draft_slots=2,
                            cost=WidthCost({1: 1.0, 16: 1.0}, overhead=0.5, load=load))
        tree.reset([1, 2, 3, 1, 2])
        return tree, drafter

    assert reset(None)[1].cached_tokens == [1, 2, 3, 1, 2]
    tree, drafter = reset(lambda: (0, 0.0))
    assert drafter.cached_tokens == []
    tree.propose([1, 2, 3, 1, 2, 3], 3)
    assert tree.drafted and drafter.cached_tokens == [1, 2, 3, 1, 2, 3]


def test_a_drafter_far_behind_probes_rarely_in_a_batch():
    """A probe pays the drafter's catch-up on the verified text it lacks: in a batch its interval grows with
    what it would feed; alone it probes every PROBE_ROUNDS rounds whatever it lacks."""
    def probes_after(load, behind, rounds):
        tree = TreeProposer(None, cost=WidthCost({1: 1.0, 2: 1.1, 16: 1.6}, overhead=0.4, load=load),
                            catch_up_s=0.05)
        tree.reset([1])
        tree.drafter_gain, tree.idle_rounds = 0.0, rounds  # it has not paid lately
        return tree.drafting_pays(behind)

    rounds = d3d.decoding.budget.PROBE_ROUNDS
    assert probes_after(None, 100, rounds)
    busy = lambda: (7, 7.0)  # noqa: E731
    near = d3d.decoding.budget.probe_interval(WidthCost({1: 1.0, 2: 1.1, 16: 1.6}, load=busy), 0.4)
    assert probes_after(busy, 0, near) and not probes_after(busy, 100, near)
    assert not probes_after(busy, 100, near * 13) and probes_after(busy, 100, near * 14)  # 0.4 + 100 x 0.05 s: 13.5x
