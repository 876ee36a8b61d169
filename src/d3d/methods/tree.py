"""The tree methods, d3d-tree and lookup-tree: several candidates (the D3D drafter's block, its alternatives, n-gram matches, continuations
retrieved from the target's own outputs) verified as one token tree per target forward (the tree itself:
d3d.decoding.tokentree; its width: d3d.decoding.treecost; the retrieval: d3d.corpus.datastore). lookup-tree is the same tree without
the drafter.

Each round the proposers add paths to a trie rooted at the pending token; the best nodes are fed to the
target at once and verification walks the accepted path, losslessly (d3d.decoding.tokentree states the rule).
With a cost model the drafter is also skipped in rounds where it has recently not been worth its own
cost (TreeProposer.drafting_pays), and drafts only its first slots where more would cost more than they
win (treecost.choose_slots: 4 or 8 of 16 on a 2-core CPU, with the same tau). An n-gram node (from the
earlier occurrence that agrees furthest back with the text, ngram.longest_continuations) has its chance of
acceptance learned per (match length, match rank, position in the copy) from the nodes whose parent
verification reached: the fixed guesses it starts from were 2-3x too high for short matches. A retrieved node's chance
is learned the same way per (length of the context match, share of the matches that continued with it).

Retrieval that learns (option `learn`, on unless false; `learn_tokens` caps it, default LEARN_TOKENS):
every generation a runner finishes joins its own LearnedStore (d3d.corpus.datastore: the prompt's last tokens
and the response, oldest generations evicted first), and later rounds retrieve from it beside the
shipped datastore, as nodes of source "learned" with their own learned acceptance rates. So a runner
learns only from its own earlier, finished generations (in a bench each method from its own outputs, in
a server from the earlier requests' answers, in a d3d.load Generator from its earlier calls): the drafts
change, the output does not, since the candidates are still deterministic and fixed before the round.

Why sampling stays exact: every candidate is deterministic (the drafter gives each slot's most likely
token and its alternatives, not tokens sampled from its laws), and the recursive rule over deterministic
candidates emits the target's law whatever the candidate set, so the tree may be cut to any budget by
any score (d3d.decoding.tokentree).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import torch

from ..corpus.datastore import Continuation, Datastore, load_datastore, shipped_datastore
from ..corpus.learned import LEARN_TOKENS, LearnedStore
from ..decoding.budget import probe_interval
from ..decoding.proposer import Proposer
from ..decoding.tokentree import TokenTree, TreeDraft
from ..decoding.tree import generate_tree
from ..decoding.treecost import WidthCost, choose_budget, choose_slots, measured_curve, width_cost_curve
from ..decoding.verify import SamplingParams
from ..drafters.kinds import D3D
from ..errors import D3DError
from .d3d import D3DProposer
from .ngram import longest_continuations
from .registry import Method, Runner, Setup, register

NGRAM_CONFIDENCE = {1: 0.35, 2: 0.55, 3: 0.7, 6: 0.8, 12: 0.85, 24: 0.9}  # prior per-token acceptance by match length
RETRIEVAL_CONFIDENCE = {1: 0.3, 2: 0.5, 3: 0.6, 4: 0.7, 6: 0.8, 12: 0.85}  # prior x the share, by match length
RETRIEVAL_SOURCES = ("datastore", "learned")  # the shipped datastore; the runner's own earlier generations
PRIOR_WEIGHT = 2.0      # the prior counts as this many observed nodes
RATE_DECAY = 0.95       # weight of the past in the learned acceptance rates, per observed node
ALT_TAIL_DISCOUNT = 0.5  # drafter tokens after an alternative were drafted for the other branch
GAIN_SMOOTHING = 0.2     # weight of the latest round in the drafter's moving-average gain
DRAFTER_SOURCES = {"d3d", "alt"}  # a path node with no other source is a token only the drafter proposed



@dataclass
class SlotBlock:
    """The drafter's block: per slot its best tokens, most likely first, with their drafter probabilities
    (the first is the block's token; the others are alternatives)."""

    top_tokens: list[list[int]]
    top_probs: list[list[float]]


def d3d_block(proposer: D3DProposer, tokens: list[int], k: int, params: SamplingParams, top: int,
              slots: int | None = None) -> SlotBlock:
    """One synchronous D3D draft of `slots` slots (None: the whole block) after `tokens`, with the `top`
    best tokens of each slot (probabilities at the sampling temperature). The tree takes each slot's
    most likely token at every temperature: its candidates are all deterministic (see the module doc)."""
    d = proposer.drafter
    logits = d.draft_block(tokens, slots)[:k]
    probs = torch.softmax(logits.float() / (params.temperature if not params.greedy else 1.0), -1)
    values, index = probs.topk(min(top, probs.shape[-1]), -1)
    return SlotBlock(d.draft_ids[index].tolist(), values.tolist())


class TreeProposer(Proposer):
    """Builds each round's token tree from the D3D drafter (its block and, at every slot, its next best
    tokens followed by a few of the block's later tokens), n-gram matches and, given a datastore, the
    continuations retrieved from it, under a token budget. Without a drafter: lookup-tree."""

    name = "d3d-tree"

    def __init__(self, drafter: D3DProposer | None, budget: int = 32, alternatives: int = 2, alt_tail: int = 3,
                 ngram_matches: int = 4, cost: WidthCost | None = None,
                 draft_slots: int | None = None, datastore: Datastore | None = None, retrieved: int = 2,
                 history: LearnedStore | None = None, catch_up_s: float = 0.0):
        if budget < 1:
            raise D3DError(f"tree budget must be >= 1 (got {budget})")
        if drafter is not None and draft_slots is not None and not 1 <= draft_slots <= drafter.drafter.block_size:
            raise D3DError(f"draft slots must be in 1..{drafter.drafter.block_size} (got {draft_slots})")
        self.d3d, self.budget, self.alternatives, self.alt_tail = drafter, budget, alternatives, alt_tail
        self.draft_slots, self.catch_up_s = draft_slots, catch_up_s  # catch_up_s: a drafter pass's seconds per
        # verified token its cache lacks beyond the pending one (treecost.choose_slots)
        self.ngram_matches, self.cost = ngram_matches, cost
        self.datastore, self.retrieved, self.history = datastore, retrieved, history
        self.params, self.drafted = SamplingParams(), False

    def learn(self, prompt_ids: list[int], token_ids: list[int]) -> None:
        """A finished generation joins the learned store (if this proposer has one); generate_tree calls it."""
        if self.history is not None:
            self.history.add(prompt_ids, token_ids)

    def forget(self) -> None:
        """Drop what was learned from earlier generations."""
        if self.history is not None:
            self.history.forget()

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter_gain, self.idle_rounds, self.drafted = 1.0, 0, False
        self.spec_tokens = self.spec_width = None  # moving averages over the rounds that built a tree
        self.propose_s, self.plain_rounds, self.speculated = 0.0, 0, True
        # modelled seconds per emitted token, from a plain step's (in a batch, beside the others)
        self.token_time = None if self.cost is None else self.cost.step_token_s(self.cost.others())
        self.rates: dict[tuple, list[float]] = {}  # n-gram / retrieved node label -> [accepted, tried], decayed
        if self.d3d is not None:  # in a batch the drafter reads the prompt when it first drafts (draft_block
            # catches its cache up): beside generations that decode it may never draft, and its prompt pass took
            # the cores their forwards need (on the fp32 pair at 8 clients, 3 s a request for no accepted token)
            self.d3d.params = self.params
            self.d3d.reset([] if self.cost is not None and self.cost.load is not None else prompt_ids)

    def drafting_pays(self, behind: int = 0) -> bool:
        """Whether to run the drafter this round. Without a cost model, always. Else when the tokens that
        only it proposed on recent accepted paths (a moving average per round) are worth its cost, a token
        being worth what one costs now (a moving average of the modelled round cost per emitted token: the
        better the other proposers do, the less a token the drafter adds is worth; in a batch, the shared
        forward's cost over all of its tokens, so a drafter pass that delays every generation's forward must
        win more than alone); and every probe_interval-th round anyway (d3d.decoding.budget: PROBE_ROUNDS
        alone, rarer in a batch), to see whether it pays again. In a batch a token is worth at most what a plain
        step costs the batch now (a moving average lags when the others start decoding: 8 requests arriving
        together all drafted in their first rounds). The choice depends on verified text, tree sizes and the
        other generations' last forwards only, so sampling stays exact.

        behind: verified tokens the drafter's cache lacks beyond the pending one (it has not drafted for a
        while, or, in a batch, not yet). A pass that pays is worth catching up for: after it the drafter feeds
        only each round's new tokens. A probe, which may find that it does not pay, counts its catch-up in its
        cost, so in a batch a drafter far behind probes rarely (64 tokens behind on the fp32 pair, a pass costs
        6x a caught-up one)."""
        if self.cost is None:
            return True
        others = self.cost.others()
        worth = min(self.token_time, self.cost.step_token_s(others)) if others[0] else self.token_time
        if self.drafter_gain * worth >= self.cost.overhead:
            return True
        return self.idle_rounds >= probe_interval(self.cost, self.cost.overhead + behind * self.catch_up_s)

    def speculation_pays(self) -> bool:
        """In a batch (the cost model's `load`, d3d.scheduler) with other generations in it: whether building
        and verifying a tree this round gives the batch more tokens per second than feeding the pending token
        alone, from this generation's recent trees (tokens committed, width, seconds spent proposing: in a
        batch the generations' Python work runs one after the other, so it delays every forward) and the
        others' last forward; and every probe_interval-th round anyway. Alone it always builds its tree, as
        a single stream does. The choice is made before the round from earlier rounds only, so sampling
        stays exact (the tree rule is exact for any candidate set fixed before the round)."""
        if self.cost is None or self.cost.load is None or self.spec_tokens is None:
            return True
        others = self.cost.others()
        if others[0] == 0 or self.plain_rounds >= probe_interval(self.cost, self.propose_s):
            return True
        # the tree's round pays its proposing seconds (the drafter's pass included), the plain step none:
        # the cost model's `overhead` (the drafter's pass) would charge the plain step too
        spec = (self.spec_tokens + others[1]) / (self.cost(others[0] + round(self.spec_width)) + self.propose_s)
        return spec >= (1.0 + others[1]) / self.cost(others[0] + 1)

    def _counts(self, key: tuple) -> list[float]:
        if key[0] == "ngram":
            prior = NGRAM_CONFIDENCE[key[1]]
        else:  # ("datastore" or "learned", match length bucket, fifth of the share)
            prior = RETRIEVAL_CONFIDENCE[key[1]] * (key[2] + 0.5) / 5
        return self.rates.get(key) or [PRIOR_WEIGHT * prior, PRIOR_WEIGHT]

    def rate(self, key: tuple) -> float:
        """The learned chance that a node labelled `key` = ("ngram", match length bucket, rank, position) or
        ("datastore", match length bucket, share fifth) is accepted once its parent is reached (the NGRAM_CONFIDENCE or
        RETRIEVAL_CONFIDENCE prior until outcomes come in)."""
        right, tried = self._counts(key)
        return right / tried

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Feedback after verification: every labelled node whose parent was reached counts as tried,
        and as accepted if it is on the path (so the rates depend on verified text only); and, if the
        drafter ran this round (`drafted`, whether or not any of its nodes made the cut: its pass was paid
        for either way), how many accepted tokens only it had proposed; and what the round cost per
        emitted token."""
        drafted = self.drafted
        reached = {0, *path}
        for i in range(1, len(tree)):
            if tree.parents[i] in reached:
                for key in tree.keys[i] if tree.keys else ():
                    right, tried = self._counts(key)
                    self.rates[key] = [RATE_DECAY * right + (i in reached), RATE_DECAY * tried + 1]
        if self.cost is not None:  # in a batch a token costs the shared forward over all of its tokens
            others = self.cost.others()
            spent = (self.cost(others[0] + len(tree)) + (self.cost.overhead if drafted else 0.0)) / \
                (len(path) + 1 + others[1])
            self.token_time += GAIN_SMOOTHING * (spent - self.token_time)
        if self.speculated:
            tokens, width = len(path) + 1, len(tree)
            self.spec_tokens = tokens if self.spec_tokens is None else \
                self.spec_tokens + GAIN_SMOOTHING * (tokens - self.spec_tokens)
            self.spec_width = width if self.spec_width is None else \
                self.spec_width + GAIN_SMOOTHING * (width - self.spec_width)
            self.plain_rounds = 0
        else:
            self.plain_rounds += 1
        if drafted:
            gain = sum(1 for i in path if tree.sources[i] <= DRAFTER_SOURCES)
            self.drafter_gain += GAIN_SMOOTHING * (gain - self.drafter_gain)
            self.idle_rounds = 0
        else:
            self.idle_rounds += 1

    def propose(self, tokens: list[int], k: int) -> TokenTree:
        """The tree for the round after `tokens` (ending with the pending token), at most k deep."""
        t0 = time.perf_counter()
        draft = TreeDraft(tokens[-1])
        self.speculated = k > 0 and self.speculation_pays()
        if not self.speculated:
            self.drafted = False
            return draft.select(self.budget, 0, self.cost)
        tree = self._tree(draft, tokens, k)
        self.propose_s += GAIN_SMOOTHING * (time.perf_counter() - t0 - self.propose_s)
        return tree

    def _tree(self, draft: TreeDraft, tokens: list[int], k: int) -> TokenTree:
        self.drafted = k > 0 and self.d3d is not None and \
            self.drafting_pays(max(0, len(tokens) - 1 - len(self.d3d.drafter.cached_tokens)))
        matches = longest_continuations(tokens, k, self.ngram_matches) if k > 0 else []
        if self.drafted:
            self._add_drafter(draft, d3d_block(self.d3d, tokens, k, self.params, self.alternatives + 1,
                                                 self.draft_slots))
        for rank, (n, follow) in enumerate(matches):
            bucket = max(b for b in NGRAM_CONFIDENCE if b <= n)
            keys = [("ngram", bucket, min(rank, 1), min(pos, 2)) for pos in range(len(follow))]
            draft.add(follow, [self.rate(key) for key in keys], "ngram", keys=keys)
        for source, store in zip(RETRIEVAL_SOURCES, (self.datastore, self.history)):
            if k > 0 and store is not None and len(store):
                for c in store.lookup(tokens, k, self.retrieved):
                    keys = retrieval_keys(source, c)
                    draft.add(c.tokens, [self.rate(key) for key in keys], source, keys=keys)
        return draft.select(self.budget, k, self.cost)

    def _add_drafter(self, draft: TreeDraft, block: SlotBlock) -> None:
        tokens = [t[0] for t in block.top_tokens]  # each slot's most likely token
        conf = [p[0] for p in block.top_probs]
        chain = draft.add(tokens, conf, "d3d")
        for j in range(len(tokens)):
            parent = chain[j - 1] if j else 0
            tail = slice(j + 1, j + 1 + self.alt_tail)
            for t, p in list(zip(block.top_tokens[j], block.top_probs[j]))[1:1 + self.alternatives]:
                factors = [p] + [c * ALT_TAIL_DISCOUNT for c in conf[tail]]
                draft.add([t] + tokens[tail], factors, "alt", start=parent)


def retrieval_keys(source: str, c: Continuation) -> list[tuple]:
    """Per token of a retrieved continuation, the label its acceptance rate is learned under: (source,
    match length bucket, fifth of the share of the matches that continued with it)."""
    bucket = min(b for b in RETRIEVAL_CONFIDENCE if b >= min(c.match_len, max(RETRIEVAL_CONFIDENCE)))
    return [(source, bucket, min(int(share * 5), 4)) for share in c.shares]



def auto_tree(model, proposer: D3DProposer | None, datastore: Datastore | None = None,
              block_size: int = 16, history: LearnedStore | None = None) -> TreeProposer:
    """A TreeProposer fitted to this device: its budget from choose_budget on the cost curve, the slots the
    drafter drafts from choose_slots, and each round's width chosen by WidthCost.best_width with the
    drafter's own cost as overhead. Both costs are measured when the method is built (a few seconds on a CPU;
    the curve is shared with `ngram` on the same model), not stored on disk: they move with the runtime,
    the threads and the load. Without a drafter (lookup-tree) only the curve is measured."""
    curve = measured_curve(model) or width_cost_curve(model)
    load = getattr(model, "batch_load", None)  # a generation in a batch (d3d.scheduler): width for the batch
    if proposer is None:
        return TreeProposer(None, choose_budget(curve, block_size), cost=WidthCost(curve, load=load),
                            datastore=datastore, history=history)
    slots, overhead, token_s = choose_slots(proposer)
    return TreeProposer(proposer, choose_budget(curve, proposer.drafter.block_size), cost=WidthCost(curve, overhead, load),
                        draft_slots=slots, datastore=datastore, history=history, catch_up_s=token_s)


@lru_cache(maxsize=2)
def _load_datastore(path: Path, vocab_size: int) -> Datastore:
    return load_datastore(path, vocab_size)


def setup_datastore(s: Setup) -> Datastore | None:
    """The datastore the tree methods retrieve from: --datastore PATH, none with --datastore none, else
    the one shipped for the target (assets/datastores/<target name>.npz) if there is one."""
    option = s.options.get("datastore")
    if option == "none":
        return None
    path = Path(option).expanduser() if option else shipped_datastore(s.model_dir)
    return None if path is None else _load_datastore(path.resolve(), s.model.args.vocab_size)


def setup_history(s: Setup) -> LearnedStore | None:
    """The store the tree methods learn in (option `learn`, on unless False; `learn_tokens` caps its tokens,
    default LEARN_TOKENS), new for every runner: each runner learns only from its own generations."""
    if s.options.get("learn") is False:
        return None
    cap = s.options.get("learn_tokens") or LEARN_TOKENS
    if cap < 2:
        raise D3DError(f"learn_tokens must be >= 2 (got {cap})")
    return LearnedStore(s.model.args.vocab_size, cap)


def _tree_settings(tree: TreeProposer) -> dict:
    return {"tree_budget": tree.budget, "draft_slots": tree.draft_slots,
            "tree_width_cost_s": None if tree.cost is None else tree.cost.curve,
            "datastore": None if tree.datastore is None else tree.datastore.meta.get("file"),
            "learn": tree.history is not None,
            "learn_tokens": None if tree.history is None else tree.history.max_tokens}


def _learning_runner(fn, tree: TreeProposer, **settings) -> Runner:
    """A Runner with `history`, the tree's LearnedStore (None with learning off), and, when it learns,
    `learn(prompt_ids, token_ids)` (what a replayed generation adds, e.g. in a resumed bench) and `forget()`."""
    runner = Runner(fn, **settings)
    runner.history = tree.history
    if tree.history is not None:
        runner.learn, runner.forget = tree.learn, tree.forget
    return runner


def _tree_runner(s: Setup):
    d = s.drafter(D3D, "d3d-tree")
    proposer = D3DProposer(d, s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    budget, store, history = s.options.get("tree_budget"), setup_datastore(s), setup_history(s)
    tree = TreeProposer(proposer, budget, datastore=store, history=history) if budget else \
        auto_tree(s.model, proposer, store, history=history)
    return _learning_runner(partial(generate_tree, s.model, s.tokenizer, proposer=tree, max_depth=d.block_size - 1),
                            tree, block_size=d.block_size, **_tree_settings(tree))


def _lookup_tree_runner(s: Setup):
    budget, store, history = s.options.get("tree_budget"), setup_datastore(s), setup_history(s)
    tree = TreeProposer(None, budget, datastore=store, history=history) if budget else \
        auto_tree(s.model, None, store, s.block_size, history=history)
    return _learning_runner(partial(generate_tree, s.model, s.tokenizer, proposer=tree, max_depth=s.block_size - 1),
                            tree, block_size=s.block_size, **_tree_settings(tree))


D3D_TREE = register(Method("d3d-tree", _tree_runner, drafter_kind=D3D.name, retrieves=True, branches=True, batches=True,
                           help="the drafter's block, its alternatives, n-gram matches and continuations "
                                "retrieved from the target's own outputs (the shipped datastore and, unless "
                                "learning is off, the runner's earlier generations) verified as one token tree"))
LOOKUP_TREE = register(Method("lookup-tree", _lookup_tree_runner, retrieves=True, branches=True, batches=True,
                              help="n-gram matches and retrieved continuations (the shipped datastore and the "
                                   "runner's earlier generations) as one token tree (no drafter)"))
