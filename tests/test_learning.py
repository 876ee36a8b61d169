"""Retrieval that learns (d3d.corpus.learned.LearnedStore, the tree methods' `learn` option) and the fair bench
(d3d.bench.harness): the learned store agrees with a datastore's lookups and stays bounded, learning keeps the
output the target's (greedy identity on SmolLM2, the exact law on the tiny target) and makes a second
similar generation accept more drafts, and the bench never lets a method learn from the warm-up, from
another method (`ar` included) or from an earlier benchmark."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from d3d.bench.harness import WARMUP_PROMPT, forget_history, run_bench
from d3d.corpus.datastore import MAX_MATCH_LEN, MAX_MATCHES, PROMPT_TAIL, Datastore
from d3d.corpus.learned import LearnedStore
from d3d.decoding.engine import GenerationResult
from d3d.errors import D3DError
from d3d.methods.catalog import make_runner
from d3d.corpus.prompts import CODE_EDITS, MultiTurn, benchmark_prompts, encode_prompt
from d3d.methods.registry import Runner
from d3d.decoding.tree import generate_tree
from d3d.methods.tree import TreeProposer
from d3d.decoding.verify import SamplingParams
from helpers import EOS, V, ChatTokenizer, StubTokenizer, needs_suffix, tiny_model
from sampling_law import chi2_pvalue, draw, exact_law

GREEDY = SamplingParams()
VOCAB = 49152


def learned(examples: list[list[int]], vocab: int = VOCAB, cap: int = 10**6) -> LearnedStore:
    s = LearnedStore(vocab, cap)
    for e in examples:
        s.add([], e)
    return s


# --------------------------------------------------------------------------------------------
# The learned store


@pytest.mark.parametrize("vocab", [VOCAB, 200_000, 12])  # keys of 4, 3 and 16 tokens
def test_learned_lookups_agree_with_a_datastore_of_the_same_text(vocab):
    rng = random.Random(vocab)
    alphabet = [rng.randrange(vocab - 1) for _ in range(5)]
    examples = [[rng.choice(alphabet) for _ in range(rng.randrange(2, 40))] for _ in range(30)]
    sep = (1 << vocab.bit_length()) - 1
    shipped, mine = Datastore(np.array([t for e in examples for t in e + [sep]]), vocab), learned(examples, vocab)
    assert mine.tokens[:len(mine)].tolist() == shipped.tokens[:len(shipped)].tolist()
    compared = 0
    for _ in range(200):
        text = [rng.choice(alphabet) for _ in range(rng.randrange(1, 24))]
        found = shipped._matches(text)
        if found is not None and len(shipped.order[slice(*shipped._range(text[-found[1]:]))]) > MAX_MATCHES:
            continue  # each looks at its own MAX_MATCHES of the matches (the datastore's by key, ours the latest)
        compared += 1
        firsts = [{c.tokens[0]: (c.match_len, c.shares[0], c.counts[0]) for c in store.lookup(text, 4, branches=6)}
                  for store in (mine, shipped)]  # later tokens may break ties in another order
        assert firsts[0] == firsts[1]
    assert compared > 100
    assert mine.lookup([alphabet[0]], k=0) == [] and mine.lookup([], k=3) == []
    assert mine.lookup([sep], k=3) == []  # not a token: nothing matches
    assert learned([]).lookup([1, 2], k=3) == []


def test_the_latest_matches_are_the_ones_examined():
    old, new = [[1, 2, 3, 10]] * MAX_MATCHES, [[1, 2, 3, 20]] * 2
    (c,) = learned(old + new).lookup([1, 2, 3], k=2, branches=2)[:1]
    assert c.tokens == [10] and c.shares == [pytest.approx((MAX_MATCHES - 2) / MAX_MATCHES)]
    assert c.counts == [MAX_MATCHES - 2]  # the two newest matches and the latest 62 of the old ones
    first, second = learned(old + new).lookup([1, 2, 3], k=2, branches=2)
    assert second.tokens == [20] and second.counts == [2]


def test_memory_stays_bounded_and_the_oldest_generations_leave_first():
    cap = 64
    s = LearnedStore(VOCAB, cap)
    for g in range(50):  # 50 generations of 4 prompt + 16 response tokens + SEP: 21 tokens each
        s.add([9000 + g] * 4, [100 * g + i for i in range(16)])
        assert len(s) <= cap and s.nbytes <= 12 * (cap + MAX_MATCH_LEN + 1)
    assert s.generations == 50 and len(s) == 63  # the last three generations, whole
    assert s.lookup([4700, 4701, 4702], k=3)[0].tokens == [4703, 4704, 4705]
    assert s.lookup([4600, 4601], k=2) == []  # evicted
    s.add([1] * 40, list(range(2000, 2200)))  # one generation longer than the cap keeps its last tokens
    assert len(s) == cap and s.tokens[:cap].tolist() == list(range(2137, 2200)) + [s.sep]
    assert s.lookup([2150, 2151], k=2)[0].tokens == [2152, 2153]
    s.forget()
    assert len(s) == 0 and s.lookup([2150, 2151], k=2) == [] and s.generations == 0
    s.add([5], [])  # an empty response teaches nothing
    assert len(s) == 0
    with pytest.raises(D3DError, match="outside the vocabulary"):
        s.add([1], [VOCAB])
    with pytest.raises(D3DError, match="at least 2 tokens"):
        LearnedStore(VOCAB, 1)


def test_what_a_generation_adds_is_its_prompt_tail_and_response():
    s = LearnedStore(VOCAB)
    s.add(list(range(100, 140)), [7, 8, 9])
    assert s.tokens[:len(s)].tolist() == list(range(140 - PROMPT_TAIL, 140)) + [7, 8, 9, s.sep]
    assert s.lookup([138, 139], k=5)[0].tokens == [7, 8, 9]  # stops at the generation's end


# --------------------------------------------------------------------------------------------
# Learning keeps the output the target's, and pays


@pytest.mark.slow
def test_learning_keeps_the_exact_law_on_the_tiny_target():
    """Every draw adds its own sample to the store that drafts the next ones; each output still has the
    target's law (the candidates are fixed before the round, from finished generations only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tiny = tiny_model()
        proposer = TreeProposer(None, budget=4, history=LearnedStore(V, 200))
        params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
        run = lambda p: generate_tree(tiny, StubTokenizer(), [1, 2, 3, 1, 2], p, 6, proposer=proposer, max_depth=3)
        samples, rounds = draw(run, params, 800, 4)
        assert proposer.history.generations == 800 and len(proposer.history) <= 200
        assert sum(n for length, n in rounds.items() if length > 1) > 100  # learned drafts were accepted
        assert chi2_pvalue(samples, exact_law(tiny, [1, 2, 3, 1, 2], params, 4, EOS)) > 1e-3
    finally:
        torch.set_num_threads(threads)


def accepted(res: GenerationResult) -> int:
    return sum(res.acceptance_lengths) - len(res.acceptance_lengths)


def test_lookup_tree_learns_from_its_own_generations_and_stays_greedy_identical(smol, prompt_ids, ar_tokens):
    model, tok, model_dir = smol
    runner = make_runner("lookup-tree", model, tok, model_dir, tree_budget=12, learn_tokens=4096)
    off = make_runner("lookup-tree", model, tok, model_dir, tree_budget=12, learn=False)
    assert runner.settings["learn"] is True and runner.settings["learn_tokens"] == 4096
    assert off.settings["learn"] is False and off.history is None and not hasattr(off, "forget")
    assert runner.history is not make_runner("lookup-tree", model, tok, model_dir, tree_budget=12).history
    code = encode_prompt(tok, benchmark_prompts("humaneval", 1)[0])
    ar = ar_tokens(code, 48)
    first = runner(code, params=GREEDY, max_new_tokens=48)
    for ids in prompt_ids[:2]:  # other generations in between
        assert runner(ids, params=GREEDY, max_new_tokens=24).token_ids == ar_tokens(ids, 24)
    second = runner(code, params=GREEDY, max_new_tokens=48)
    assert first.token_ids == second.token_ids == ar
    assert runner.history.generations == 4 and len(runner.history) <= 4096
    assert accepted(second) > accepted(first) + 10  # the first answer was learned
    assert any("learned" in b for b in second.branches) and not any("learned" in b for b in first.branches)
    base = [off(code, params=GREEDY, max_new_tokens=48) for _ in range(2)]  # without learning: the same twice
    assert base[0].token_ids == ar and accepted(base[0]) == accepted(base[1])
    assert forget_history(runner) and len(runner.history) == 0
    assert accepted(runner(code, params=GREEDY, max_new_tokens=48)) == accepted(first)  # forgotten


def test_d3d_tree_learns_too(smol, short_answer_ids, ar_tokens):
    model, tok, model_dir = smol
    runner = make_runner("d3d-tree", model, tok, model_dir, tree_budget=16)
    runs = [runner(short_answer_ids, params=GREEDY, max_new_tokens=16) for _ in range(2)]
    assert all(r.token_ids == ar_tokens(short_answer_ids, 16) for r in runs) and runner.history.generations == 2
    assert any("learned" in b for b in runs[1].branches)


def test_the_api_learns_by_default_and_can_forget(smol):
    from d3d import load

    gen = load(method="lookup-tree", threads=1, tree_budget=6, learn_tokens=300)
    gen.generate("What is 2 + 2?", max_new_tokens=8)
    assert gen.runner.settings["learn"] and gen.runner.history.generations == 1 and len(gen.runner.history) <= 300
    assert gen.forget() and len(gen.runner.history) == 0
    off = load(method="lookup-tree", threads=1, tree_budget=6, learn=False)
    assert off.runner.settings["learn"] is False and off.forget() is False
    with pytest.raises(D3DError, match="learn_tokens must be >= 2"):
        load(method="lookup-tree", learn_tokens=1)


# --------------------------------------------------------------------------------------------
# The fair bench


def answer(name: str, prompt: str) -> int:
    """The first token a fake method answers a prompt pN with: distinct per method and prompt."""
    return (100 if name == "ar" else 200) + (int(prompt[1:]) if prompt[1:].isdigit() else 0)


def fake_runner(name: str, tok: ChatTokenizer, log: list) -> Runner:
    """A runner that answers a distinct token per (method, prompt), learns its own answers as the tree
    methods do, and logs every call of it, its learn and its forget."""
    seen: list[list[int]] = []

    def run(ids, params, max_new_tokens):
        prompt = tok.chats[ids[0]][-1]["content"]
        log.append((name, "run", prompt))
        res = GenerationResult(list(ids), [answer(name, prompt), 1, 2], [1, 1, 1], decode_s=0.1)
        res.text = f"{name} says {prompt}"
        seen.append(res.token_ids)
        return res

    runner = Runner(run, block_size=16)
    runner.seen = seen
    runner.learn = lambda ids, token_ids: (log.append((name, "learn", tok.chats[ids[0]][-1]["content"])),
                                           seen.append(token_ids))
    runner.forget = lambda: (log.append((name, "forget", None)), seen.clear())
    return runner


def test_the_bench_warms_up_on_an_unmeasured_prompt_and_forgets_it_and_earlier_benchmarks(tmp_path):
    tok, log = ChatTokenizer(), []
    model = SimpleNamespace(args=SimpleNamespace(max_seq_len=4096))
    runners = {m: fake_runner(m, tok, log) for m in ("ar", "lookup-tree")}
    prompts = {"a": ["p1", MultiTurn(("p2", "p3"))], "b": ["p4"]}
    run_bench(model, tok, runners, prompts, GREEDY, 4, progress=False)
    assert log[:2] == [("ar", "run", WARMUP_PROMPT), ("lookup-tree", "run", WARMUP_PROMPT)]
    assert WARMUP_PROMPT not in [t for items in prompts.values() for i in items for t in getattr(i, "turns", [i])]
    forgets = [i for i, e in enumerate(log) if e[1] == "forget"]
    first_b = log.index(("ar", "run", "p4"))
    assert forgets == [2, 3, first_b - 2, first_b - 1]  # after the warm-up, and before benchmark b
    assert not any(e[1] == "learn" for e in log)  # a run learns inside its own call only
    # what each method has learned at the end: its own answer to benchmark b's prompt, nothing else
    assert runners["lookup-tree"].seen == [[answer("lookup-tree", "p4"), 1, 2]]


def test_a_resumed_bench_replays_each_method_its_own_outputs(tmp_path):
    tok, log = ChatTokenizer(), []
    model = SimpleNamespace(args=SimpleNamespace(max_seq_len=4096))
    runners = {m: fake_runner(m, tok, log) for m in ("ar", "lookup-tree")}
    prompts = {"a": ["p1", "p2", "p3"]}
    journal = tmp_path / "out.json.journal"
    real = runners["lookup-tree"].fn
    calls = []

    def dies_on_p3(ids, params, max_new_tokens):
        calls.append(1)
        if tok.chats[ids[0]][-1]["content"] == "p3":
            raise KeyboardInterrupt
        return real(ids, params, max_new_tokens)

    runners["lookup-tree"].fn = dies_on_p3
    with pytest.raises(KeyboardInterrupt):
        run_bench(model, tok, runners, prompts, GREEDY, 4, progress=False, journal=journal, header={})
    runners["lookup-tree"].fn = real
    fresh = {m: fake_runner(m, tok, log) for m in ("ar", "lookup-tree")}
    log.clear()
    run_bench(model, tok, fresh, prompts, GREEDY, 4, progress=False, journal=journal, header={})
    learns = [(n, p) for n, what, p in log if what == "learn"]
    assert learns == [("ar", "p1"), ("lookup-tree", "p1"), ("ar", "p2"), ("lookup-tree", "p2"), ("ar", "p3")]
    own = [answer("lookup-tree", p) for p in ("p1", "p2", "p3")]
    assert [ids[0] for ids in fresh["lookup-tree"].seen] == own  # its own outputs, replayed then generated


def test_a_real_bench_leaves_each_learning_method_only_its_measured_outputs(smol):
    model, tok, model_dir = smol
    runners = {"ar": make_runner("ar", model, tok, model_dir),
               "lookup-tree": make_runner("lookup-tree", model, tok, model_dir, tree_budget=8)}
    texts = ["Name three colors.", "Name three animals."]
    out = run_bench(model, tok, runners, {"x": texts}, GREEDY, 8, progress=False, save_outputs=True)
    history = runners["lookup-tree"].history
    rows = [r for r in out["per_prompt"] if r["method"] == "lookup-tree"]
    expected = [t for text, r in zip(texts, rows)
                for t in encode_prompt(tok, text)[-PROMPT_TAIL:] + r["token_ids"] + [history.sep]]
    assert history.generations == 2 and history.tokens[:len(history)].tolist() == expected  # no warm-up in it
    assert all(r["lossless"] for r in out["results"])


def test_the_bench_empties_the_suffix_cache_after_the_warm_up(smol):
    needs_suffix()
    model, tok, model_dir = smol
    runners = {"ar": make_runner("ar", model, tok, model_dir), "suffix": make_runner("suffix", model, tok, model_dir)}
    cache = runners["suffix"].fn.__self__.proposer.cache
    run_bench(model, tok, runners, {"x": ["Name three colors."]}, GREEDY, 8, progress=False)
    assert len(cache.cached_requests) == 1  # the measured generation's response; the warm-up's was evicted
    assert forget_history(runners["suffix"]) and len(cache.cached_requests) == 0
    assert forget_history(runners["ar"]) is False


# --------------------------------------------------------------------------------------------
# The history workload


def test_the_history_workload_is_chats_and_code_edits_in_one_stream():
    items = benchmark_prompts("history")
    chats, code = benchmark_prompts("mt-bench"), benchmark_prompts("humaneval")
    assert len(items) == len(chats) + len(code) and all(isinstance(i, MultiTurn) for i in items)
    assert items[0] == chats[0] and items[2] == chats[1]
    assert items[1].turns == (code[0], CODE_EDITS[0], CODE_EDITS[1]) and items[3].turns[0] == code[1]
    assert [i.turns[0] for i in items[2 * len(chats):]] == code[len(chats):]
    assert benchmark_prompts("history", 3) == items[:3]
