"""Continuous batching (d3d.runtime.batch, d3d.scheduler): a sequence's rows in a batched forward are bitwise
its rows alone, so every concurrent answer is token for token its solo answer, and sampling keeps the target's
law while other generations share the forwards."""
from __future__ import annotations

import threading

import pytest
import torch

from d3d.decoding.engine import generate
from d3d.decoding.tokentree import tree_mask, tree_positions
from d3d.decoding.verify import SamplingParams
from d3d.errors import D3DError
from d3d.methods.catalog import make_runner
from d3d.runtime.batch import BatchedTarget, Segment
from d3d.runtime.quantize import apply_quantize
from d3d.scheduler import Scheduler
from d3d.runtime.target import Transformer
from helpers import EOS, StubTokenizer, on_cpu_layers, tiny_args, tiny_datastore, tiny_model
from sampling_law import FIRST, MAX_NEW_ALL, N_ALL, PROMPT_ALL, TRUNCATED, chi2_pvalue, draw, exact_law


def solo_logits(model, prefix: list[int], tokens: list[int], parents: list[int] | None = None) -> torch.Tensor:
    """Logits of `tokens` fed after `prefix` in a forward of their own (a token tree when `parents` is given)."""
    model.setup_cache(1, 64)
    if prefix:
        model(torch.tensor([prefix]))
    if parents is None:
        return model(torch.tensor([tokens]))[0]
    L = len(prefix)
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    return model(torch.tensor([tokens]), mask=tree_mask(parents, L), positions=tree_positions(depths, L))[0]


def packed_model():
    """A tiny target whose every product, the LM head's too, is on the C++ kernels (a vocabulary of 64, a
    whole output group: PyTorch's own fp32 product, which the law tests' 8-token head runs on, computes one
    row and several rows in different orders)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return on_cpu_layers(Transformer(tiny_args(64, 64, dim=64)).eval().requires_grad_(False))


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_batched_rows_are_bitwise_the_solo_rows(precision):
    model = packed_model()
    if precision != "fp32":
        model = apply_quantize(model, precision, StubTokenizer(64))
    batch = BatchedTarget(model, 3, max_len=64)
    assert batch.native, "the tiny target runs on the C++ layers"
    prompts = [[1, 2, 3, 4, 5], [6, 7], [0, 1, 2]]
    first = batch.forward([Segment(s, torch.tensor(p), 0, torch.arange(len(p))) for s, p in enumerate(prompts)])
    for p, lg in zip(prompts, first):
        assert torch.equal(lg, solo_logits(model, [], p))
    parents = [-1, 0, 0, 1]  # a token tree after prompt 0, a verification block after 1, one step after 2
    depths = [0, 1, 1, 2]
    tree, block, step = [6, 0, 1, 2], [3, 4, 5], [5]
    out = batch.forward([
        Segment(0, torch.tensor(tree), 5, tree_positions(depths, 5), tree_mask(parents, 5)[0, 0]),
        Segment(1, torch.tensor(block), 2, torch.arange(2, 5)),
        Segment(2, torch.tensor(step), 3, torch.arange(3, 4), keep=1)])
    assert torch.equal(out[0], solo_logits(model, prompts[0], tree, parents))
    assert torch.equal(out[1], solo_logits(model, prompts[1], block))
    assert torch.equal(out[2], solo_logits(model, prompts[2], step))


def test_bad_batches_are_refused():
    batch = BatchedTarget(tiny_model(), 2, max_len=8)
    with pytest.raises(D3DError, match="share a cache slot"):
        batch.forward([Segment(0, torch.tensor([1]), 0, torch.arange(1)), Segment(0, torch.tensor([2]), 0,
                                                                                  torch.arange(1))])
    with pytest.raises(D3DError, match="exceeds the KV cache"):
        batch.forward([Segment(1, torch.tensor([1] * 9), 0, torch.arange(9))])
    with pytest.raises(D3DError, match="outside the batch"):
        batch.forward([Segment(2, torch.tensor([1]), 0, torch.arange(1))])


def run_together(scheduler: Scheduler, jobs: list) -> list:
    """Each job(slot_model) in a thread of its own, all on one scheduler; their results in order."""
    slots = [scheduler.acquire() for _ in jobs]
    assert all(s is not None for s in slots)
    out, errors = [None] * len(jobs), []

    def run(i):
        try:
            out[i] = jobs[i](slots[i])
        except BaseException as e:
            errors.append(e)
        finally:
            scheduler.release(slots[i].slot)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


@pytest.mark.parametrize("method", ["ar", "ngram", "lookup-tree", "d3d", "d3d-tree"])
def test_concurrent_greedy_answers_are_the_solo_answers(smol, prompt_ids, ar_tokens, method):
    """Four generations at once, one of them with its prompt fed in chunks between the others' rounds."""
    model, tok, model_dir = smol
    scheduler = Scheduler(model, 4, max_len=512, prefill_chunk=16, short_prompt=0, idle_chunks=1)
    try:
        n = 32

        def job(ids):
            return lambda slot: make_runner(method, slot, tok, model_dir, learn=False)(
                ids, params=SamplingParams(), max_new_tokens=n)

        results = run_together(scheduler, [job(ids) for ids in prompt_ids[:4]])
        assert scheduler.last_batch >= 1 and scheduler.forwards < 4 * n  # rounds were shared
    finally:
        scheduler.stop()
    for ids, res in zip(prompt_ids, results):
        assert res.token_ids == ar_tokens(ids, n)
    if method != "ar":
        assert sum(a > 1 for res in results for a in res.acceptance_lengths) > 0  # drafts were accepted


@pytest.mark.parametrize("method", ["ar", "lookup-tree", "d3d"])
def test_a_slot_feeds_only_what_follows_the_prefix_its_cache_holds(smol, prompt_ids, ar_tokens, method):
    """A prompt on a slot starts after its common prefix with the tokens the slot's KV cache holds from the
    last generation there (the chat template's system turn; the same prompt again, all but its last token; an
    earlier turn and the start of its answer, which plain and chain decoding feed in order; a tree's rows are
    not held), and answers as alone."""
    model, tok, model_dir = smol
    scheduler = Scheduler(model, 1, max_len=512, prefill_chunk=16, short_prompt=0, idle_chunks=1)
    n = 24

    def run(ids):
        slot = scheduler.acquire()
        try:
            before = scheduler.reused
            res = make_runner(method, slot, tok, model_dir, learn=False)(ids, params=SamplingParams(), max_new_tokens=n)
            return res, scheduler.reused - before
        finally:
            scheduler.release(slot.slot)

    a, b = prompt_ids[0], prompt_ids[1]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 8  # the chat template's system turn
    try:
        first, reused = run(a)
        assert reused == 0
        second, reused = run(b)
        assert reused == common
        third, reused = run(a)
        assert reused == common
        fourth, reused = run(a)
        assert reused == len(a) - 1
        turn = a + first.token_ids[:6]
        fifth, reused = run(turn)
        assert reused == (len(a) if method == "lookup-tree" else len(turn) - 1)  # a tree's rows are not held
    finally:
        scheduler.stop()
    for ids, res in [(a, first), (b, second), (a, third), (a, fourth), (turn, fifth)]:
        assert res.token_ids == ar_tokens(ids, n)
    if method != "ar":
        assert sum(a > 1 for res in (first, second, third, fourth, fifth) for a in res.acceptance_lengths) > 0


def test_a_prompt_is_fed_in_chunks_and_can_be_stopped(smol, prompt_ids):
    model, tok, _ = smol
    scheduler = Scheduler(model, 2, max_len=512, prefill_chunk=8, short_prompt=0, idle_chunks=1)
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("client left")

    try:
        slot = scheduler.acquire()
        slot.check = check
        with pytest.raises(RuntimeError, match="client left"):
            generate(slot, tok, prompt_ids[0], max_new_tokens=4)
        assert scheduler.forwards == 2  # two chunks of 8 tokens, stopped before the third
        scheduler.release(slot.slot)
    finally:
        scheduler.stop()


@pytest.mark.parametrize("method", ["lookup-tree", "d3d"])
def test_sampling_in_a_batch_keeps_the_law(method):
    """Sampling (top-k + top-p) while another generation shares every forward, so that the load-aware choices
    are made (lookup-tree's tree width, d3d's draft length: d3d.decoding.budget): the output law is the target's
    exact law, and drafts were accepted."""
    from d3d.decoding.tree import generate_tree
    from d3d.decoding.treecost import WidthCost
    from d3d.methods.d3d import D3DProposer
    from d3d.methods.tree import TreeProposer
    from helpers import tiny_drafter
    from sampling_law import BLOCK_TINY, NOISE

    model = tiny_model()
    scheduler = Scheduler(model, 2, max_len=64, prefill_chunk=64)
    slot, companion = scheduler.acquire(), scheduler.acquire()
    done = threading.Event()

    def keep_busy():
        while not done.is_set():
            generate(companion, StubTokenizer(), [4, 5, 6], max_new_tokens=8)
        scheduler.leave(companion.slot)

    busy = threading.Thread(target=keep_busy)
    busy.start()
    try:
        if method == "lookup-tree":
            cost = WidthCost({1: 1.0, 2: 1.2, 8: 1.6}, load=slot.batch_load)
            tree = TreeProposer(None, budget=8, cost=cost, datastore=tiny_datastore(model, PROMPT_ALL))
            run = lambda p: generate_tree(slot, StubTokenizer(), PROMPT_ALL, p, MAX_NEW_ALL, proposer=tree,
                                          max_depth=3)
        else:
            model._d3d_width_curve = (torch.get_num_threads(), {1: 1.0, 2: 1.05, 8: 1.3})  # drafts pay, cut short
            proposer = D3DProposer(tiny_drafter(tiny_model(NOISE), BLOCK_TINY), 8, max_len=64)
            run = lambda p: generate(slot, StubTokenizer(), PROMPT_ALL, p, MAX_NEW_ALL, proposer=proposer,
                                     block_size=BLOCK_TINY)
        samples, rounds = draw(run, TRUNCATED, N_ALL, FIRST)
    finally:
        done.set()
        busy.join()
        scheduler.stop()
    dist = exact_law(model, PROMPT_ALL, TRUNCATED, FIRST, EOS)
    assert set(samples) <= set(dist)
    assert sum(n for length, n in rounds.items() if length > 1) > 100
    assert chi2_pvalue(samples, dist) > 1e-3


def test_a_forward_takes_short_prompts_first_and_one_chunk_of_prompt_tokens():
    from d3d.scheduler import Work

    scheduler = Scheduler(tiny_model(), 4, max_len=64, prefill_chunk=16, idle_chunks=1)
    try:
        def work(slot, width, keep, rest=0):
            return Work(Segment(slot, torch.zeros(width, dtype=torch.long), 0, torch.arange(width), keep=keep), rest)

        step, long_chunk, short, tree = work(0, 1, 0), work(1, 16, 1, 4000), work(2, 5, 1, 5), work(3, 6, 0)
        assert scheduler._fit([step, long_chunk, short, tree]) == [step, tree, short]  # the chunk waits
        assert scheduler._fit([long_chunk, step]) == [step, long_chunk]  # alone, a prompt chunk always goes
        last_of_long, short_first = work(1, 8, 1, 8), work(2, 16, 1, 20)
        assert scheduler._fit([short_first, last_of_long]) == [last_of_long]  # the fewest tokens left go first
        assert scheduler._fit([long_chunk, work(2, 16, 1, 20)])[0].rest == 20  # equal widths: the shorter prompt
    finally:
        scheduler.stop()


def test_a_prompt_is_cut_in_chunks_whose_last_takes_the_remainder():
    from d3d.scheduler import piece_end

    def pieces(T, chunk, whole=0):
        out, a = [], 0
        while a < T:
            out.append((a, piece_end(a, T, chunk, whole)))
            a = out[-1][1]
        return out

    assert pieces(35, 32) == [(0, 35)]
    assert pieces(64, 32) == [(0, 32), (32, 64)]
    assert pieces(40, 16) == [(0, 16), (16, 40)]
    assert pieces(10, 16) == [(0, 10)]
    assert pieces(40, 16, whole=64) == [(0, 40)] and len(pieces(65, 16, whole=64)) == 4


def test_prompts_take_wider_forwards_while_nothing_decodes():
    """While no generation decodes (a prompt read alone, prompts arriving together) a forward takes idle_chunks
    chunks of prompt: no stream waits on it, and each forward's fixed cost is paid fewer times."""
    from d3d.scheduler import Work

    scheduler = Scheduler(tiny_model(), 3, max_len=64, prefill_chunk=8, idle_chunks=4)
    try:
        a, b = scheduler.acquire(), scheduler.acquire()
        assert scheduler.prompt_budget(a.slot) == 32
        b.setup_cache()
        b(torch.tensor([[1, 2, 3]]), last_only=True)  # a prompt: b is not decoding yet
        assert scheduler.prompt_budget(a.slot) == 32
        b(torch.tensor([[3]]), last_only=True)  # a decoding step
        assert scheduler.prompt_budget(a.slot) == 8 and scheduler.prompt_budget(b.slot) == 32

        def chunk(slot, rest):
            return Work(Segment(slot, torch.zeros(8, dtype=torch.long), 0, torch.arange(8), keep=1), rest)

        prompts = [chunk(0, 40), chunk(1, 30), chunk(2, 20)]
        assert len(scheduler._fit(prompts)) == 3  # prompts only: up to 32 prompt tokens
        step = Work(Segment(2, torch.zeros(1, dtype=torch.long), 0, torch.arange(1), keep=1))
        assert scheduler._fit(prompts[:2] + [step]) == [step, prompts[1]]  # beside a round: one chunk
    finally:
        scheduler.stop()


def test_a_fitted_prompt_chunk_shrinks_as_the_cached_prompt_grows():
    """Each row of a chunk attends to every cached position: deep in a long prompt the chunk is cut (by 16s, to
    16 at least) so that its forward costs no more than the whole budget at the prompt's start."""
    from d3d.decoding.treecost import WidthCost

    scheduler = Scheduler(tiny_model(), 2, max_len=64, prefill_chunk=64, idle_chunks=1)
    try:
        assert scheduler.attention_s == 0.0  # a chunk given, not fitted: it is what it was asked to be
        assert scheduler.prompt_budget(None, context=1000) == 64
        scheduler.curve = {1: 0.01, 16: 0.02, 64: 0.05}
        scheduler.cost, scheduler.attention_s = WidthCost(scheduler.curve), 1e-5
        assert [scheduler.prompt_budget(None, c) for c in (0, 10, 100, 10_000)] == [64, 48, 16, 16]
    finally:
        scheduler.stop()


def test_the_attention_cost_is_measured_once_per_model(monkeypatch):
    """A scheduler measures what a row pays per cached position with forwards of its own; a second one on the same
    model and threads (`d3d bench --clients` starts one per level) reuses the value without a forward."""
    model = tiny_model()
    first = Scheduler(model, 1, max_len=400)
    first.stop()
    forwards = []
    real = BatchedTarget.forward
    monkeypatch.setattr(BatchedTarget, "forward", lambda self, segments: forwards.append(segments) or real(self, segments))
    second = Scheduler(model, 1, max_len=400)
    try:
        assert second.attention_s == first.attention_s and not forwards
    finally:
        second.stop()


def test_the_load_counts_a_prompt_chunk_as_a_one_token_step():
    """A prompt chunk's rows are work the batch does whatever the others draft: in the load the other generations
    weigh their drafts against it counts as a one-token step (it decodes soon), not as its width; a decoding
    round counts as itself."""
    scheduler = Scheduler(tiny_model(), 2, max_len=64, prefill_chunk=16)
    try:
        a, b = scheduler.acquire(), scheduler.acquire()
        a.setup_cache()
        a(torch.tensor([[1, 2, 3, 1, 2]]), last_only=True)
        assert scheduler.load(b.slot) == (1, 1.0)
        assert not scheduler.decoding(b.slot)  # for the prompt budget it still reads its prompt
        a(torch.tensor([[3, 1, 2]]), positions=torch.arange(5, 8))  # a round verifying three tokens
        assert scheduler.load(b.slot) == (3, 3.0)
        assert scheduler.load(a.slot) == (0, 0.0)  # b has not joined
    finally:
        scheduler.stop()


def test_a_stopped_scheduler_frees_its_kv_cache_at_once():
    """A bench builds a scheduler per level and method: each one's cache is freed when it stops, not whenever the
    cycle collector comes (SmolLM2 in-process, 4 levels of 8 slots: 13.4 GB held before, 1.8 GB after), and a
    generation still holding a slot then gets a one-line error, not a failure inside torch."""
    scheduler = Scheduler(tiny_model(), 2, max_len=64, prefill_chunk=16)
    a = scheduler.acquire()
    a.setup_cache()
    a(torch.tensor([[1, 2, 3]]), last_only=True)
    scheduler.stop()
    assert scheduler.batch.kv is None and scheduler.batch.k_caches == []
    with pytest.raises(D3DError, match="scheduler has stopped"):
        a.move_cache_rows(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(D3DError, match="scheduler has stopped"):
        a(torch.tensor([[4]]), positions=torch.arange(3, 4))


def test_probes_in_a_batch_take_a_bounded_share_of_its_time():
    """Alone a generation probes every PROBE_ROUNDS rounds; in a batch, where its proposing delays everyone's
    forward, a probe that costs much (a drafter's pass) comes rarely enough to cost at most PROBE_SHARE."""
    from d3d.decoding.budget import PROBE_ROUNDS, PROBE_SHARE, probe_interval
    from d3d.decoding.treecost import WidthCost

    curve = {1: 0.020, 8: 0.034, 64: 0.150}
    assert probe_interval(WidthCost(curve, load=lambda: (0, 0.0)), 0.140) == PROBE_ROUNDS
    loaded = WidthCost(curve, load=lambda: (7, 7.0))  # seven others, one token each: a forward of 8 costs 0.034 s
    assert probe_interval(loaded, 0.001) == PROBE_ROUNDS  # a cheap probe: as often as alone
    every = probe_interval(loaded, 0.140)  # a drafter pass dearer than the forward
    assert 8 * 0.140 / every <= PROBE_SHARE * 0.034 < 8 * 0.140 / (every - 1)
