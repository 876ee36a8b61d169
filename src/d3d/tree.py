"""Token-tree verification: several candidates (the D3D drafter's block, its alternatives, n-gram matches)
checked by one target forward.

A round builds a trie rooted at the pending token (the last verified token, not yet in the target's
cache). Every proposer adds paths to it; shared prefixes merge. Each node gets a score, an estimate of
the probability that verification reaches it, and the best nodes (root included; at most `budget`, and
with a cost model only as many as pay for the wider forward, see WidthCost) are fed to the target in one
forward: node i sits at position cache_len + depth(i) and attends to the cached prefix and to its own
ancestors only, so its logits equal those of its branch run alone. With a cost model the drafter is
also skipped in rounds where it has recently not been worth its own cost (TreeProposer.drafting_pays). Verification walks down
from the root, and the KV rows of the accepted path are then copied into consecutive cache slots
(O(accepted) copies, nothing recomputed).

Losslessness. Greedy: at each node the target's argmax is taken and the walk descends into the child
holding it, if any, so the output is plain decoding's. Sampling: multi-candidate recursive rejection
sampling over the node's candidates (SpecInfer; multi-draft speculative sampling): candidate x_i with
proposal law q_i (one-hot for deterministic candidates) is accepted with probability
min(1, r(x_i) / q_i(x_i)), where r starts as the target's law p and becomes norm(max(0, r - q_i)) after
each rejection; when all are rejected the token is drawn from r. The emitted token then has law p
exactly, provided each sampled candidate is drawn from its q independently of the target's draws and
of everything that decided whether and where it is placed. That holds here: the drafter's slot-j token is
sampled once from q_j (which depends on the verified text only), sits only at depth j, comes first among
its node's candidates, and node scores use the slot's largest probability, never the sampled token's;
whether the drafter runs depends on verified text only.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from .drafter import D3DProposer, sample_draft
from .engine import (GenerationResult, LogprobRecorder, StopChecker, commit_round, finish, prefill, sync_device,
                     validate_request)
from .errors import D3DError
from .registry import Method, Runner, Setup, register
from .verify import SamplingParams, make_generator, probs_from_logits, sample

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
NGRAM_CONFIDENCE = {1: 0.35, 2: 0.55, 3: 0.7}  # guessed per-token acceptance of an n-gram match of length n
ALT_TAIL_DISCOUNT = 0.5  # drafter tokens after an alternative were drafted for the other branch
GAIN_SMOOTHING = 0.2     # weight of the latest round in the drafter's moving-average gain
PROBE_ROUNDS = 8         # a drafter that does not pay still runs once every this many rounds


# --------------------------------------------------------------------------------------------
# The tree


@dataclass
class Candidate:
    """A proposal for the token after a node: `law` is the distribution it was sampled from (None =
    deterministic, i.e. one-hot); `child` is the node it leads to."""

    token: int
    law: torch.Tensor | None
    child: int


@dataclass
class TokenTree:
    """A flattened token tree, parents before children; node 0 is the root (the pending token)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[set[str]]
    cands: list[list[Candidate]]

    def __len__(self) -> int:
        return len(self.tokens)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    score: float
    sources: set[str]
    children: dict[int, int] = field(default_factory=dict)
    cands: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class TreeDraft:
    """The trie the proposers fill; `select` keeps the best nodes under a budget."""

    def __init__(self, root: int):
        self.nodes = [_Node(root, -1, 0, 1.0, {"root"})]

    def add(self, path: list[int], factors: list[float], source: str, start: int = 0,
            laws: list[torch.Tensor | None] | None = None) -> list[int]:
        """Add `path` below node `start`; factors[i] estimates the chance that token i is accepted once
        its parent is reached; laws[i] is the law token i was sampled from (None = deterministic).
        A sampled candidate goes first among its node's candidates. Returns the nodes of the path."""
        node, out, reach = start, [], self.nodes[start].score
        for i, tok in enumerate(path):
            law = laws[i] if laws is not None else None
            parent = self.nodes[node]
            reach *= factors[i]
            entry = (tok, law)
            if law is not None:
                if not any(c[1] is law for c in parent.cands):
                    parent.cands.insert(0, entry)
            elif entry not in [(t, q) for t, q in parent.cands if q is None]:
                parent.cands.append(entry)
            child = parent.children.get(tok)
            if child is None:
                child = len(self.nodes)
                parent.children[tok] = child
                self.nodes.append(_Node(tok, node, parent.depth + 1, reach, {source}))
            elif source not in self.nodes[child].sources:  # independent evidence for the same token
                self.nodes[child].score = 1 - (1 - self.nodes[child].score) * (1 - reach)
                self.nodes[child].sources.add(source)
            else:
                self.nodes[child].score = max(self.nodes[child].score, reach)
            node = child
            reach = self.nodes[node].score
            out.append(node)
        return out

    def select(self, budget: int, max_depth: int, cost: "WidthCost | None" = None) -> TokenTree:
        """The best nodes (root included, none deeper than max_depth) as a flat tree: the `budget` best, or,
        given the cost of a target forward by width, the best prefix of those by expected tokens per second
        (see WidthCost.best_width). A child never scores above its parent and ties go to the shallower node,
        so the kept set is ancestor-closed."""
        for n in self.nodes[1:]:
            n.score = min(n.score, self.nodes[n.parent].score)
        order = sorted(range(1, len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
        fits = [i for i in order if self.nodes[i].depth <= max_depth][:max(0, budget - 1)]
        if cost is not None:
            fits = fits[:cost.best_width([self.nodes[i].score for i in fits]) - 1]
        kept = [0] + fits
        flat = {old: new for new, old in enumerate(kept)}
        cands = []
        for old in kept:
            node = self.nodes[old]
            cands.append([Candidate(t, q, flat[node.children[t]]) for t, q in node.cands
                          if node.children[t] in flat])
        return TokenTree(tokens=[self.nodes[i].token for i in kept],
                         parents=[flat[self.nodes[i].parent] if i else -1 for i in kept],
                         depths=[self.nodes[i].depth for i in kept],
                         sources=[self.nodes[i].sources for i in kept], cands=cands)


# --------------------------------------------------------------------------------------------
# Target forward over a tree, verification, cache compaction


def tree_mask(parents: list[int], cache_len: int, device=None) -> torch.Tensor:
    """Bool attention mask [1, 1, T, cache_len + T]: every node sees the cached prefix, itself and its
    ancestors (parents must come before children)."""
    T = len(parents)
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    mask = torch.cat([torch.ones(T, cache_len, dtype=torch.bool), anc], dim=1)
    return mask[None, None].to(device)


def tree_positions(depths: list[int], cache_len: int, device=None) -> torch.Tensor:
    return (cache_len + torch.tensor(depths, dtype=torch.long)).to(device)


def tree_logits(model, tree: TokenTree) -> torch.Tensor:
    """Feed the tree after the target's cache; returns its logits [T, V]. The cache then holds the
    tree's K/V in slots cache_len .. cache_len + T - 1, in tree order (see compact_cache)."""
    device = model.output.weight.device
    L = model.cache_len
    feed = torch.tensor([tree.tokens], device=device)
    return model(feed, mask=tree_mask(tree.parents, L, device), positions=tree_positions(tree.depths, L, device))[0]


def compact_cache(model, base: int, path: list[int]) -> None:
    """Keep the root (slot `base`) and the accepted path's K/V rows, moved into consecutive slots
    base + 1 .. base + len(path), then set the cache length. `path` holds increasing tree indices, so no
    row is overwritten before it is read."""
    if path:
        device = model.output.weight.device
        src = torch.tensor(path, device=device) + base
        dst = torch.arange(base + 1, base + 1 + len(path), device=device)
        if not torch.equal(src, dst):
            for layer in model.layers:
                att = layer.attention
                att.k_cache[:, :, dst] = att.k_cache[:, :, src]
                att.v_cache[:, :, dst] = att.v_cache[:, :, src]
    model.rollback(base + 1 + len(path))


def verify_tree(tree: TokenTree, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[list[int], int]:
    """Walk the tree from the root: (accepted nodes, next token). logits: [len(tree), V], row i scores
    the token after node i."""
    path, node = [], 0
    while True:
        child, token = _choose(tree.cands[node], logits[node], params, generator)
        if child is None:
            return path, token
        path.append(child)
        node = child


def _choose(cands: list[Candidate], row: torch.Tensor, params: SamplingParams,
            generator: torch.Generator) -> tuple[int | None, int]:
    """One step of the walk: (child to descend into or None, the token emitted at this step)."""
    if params.greedy:
        token = int(row.argmax())
        return next((c.child for c in cands if c.token == token), None), token
    r = probs_from_logits(row, params)
    for c in cands:
        qx = 1.0 if c.law is None else float(c.law[c.token])
        if qx > 0 and float(torch.rand(1, generator=generator, device=r.device)) * qx < float(r[c.token]):
            return c.child, c.token
        r = _residual(r, c)
    return None, sample(r, generator)


def _residual(r: torch.Tensor, c: Candidate) -> torch.Tensor:
    """norm(max(0, r - q)) after candidate c is rejected (q one-hot on c.token when deterministic); r
    itself if rounding left nothing (then c could not have been rejected in exact arithmetic)."""
    if c.law is None:
        rest = r.clone()
        rest[c.token] = 0.0
    else:
        rest = (r - c.law.to(r.dtype)).clamp(min=0)
    total = float(rest.sum())
    return rest / total if total > 0 else r


# --------------------------------------------------------------------------------------------
# Proposers


def ngram_continuations(tokens: list[int], k: int, max_matches: int = 4, max_ngram: int = 3,
                        min_ngram: int = 1) -> list[tuple[int, list[int]]]:
    """Up to `max_matches` distinct continuations (n, next <= k tokens) of earlier occurrences of the
    text's last n tokens: longest n first, latest occurrence first."""
    L, out, seen = len(tokens), [], set()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tuple(tokens[start + n:start + n + k])
                if follow and follow not in seen:
                    seen.add(follow)
                    out.append((n, list(follow)))
                    if len(out) >= max_matches:
                        return out
    return out


@dataclass
class SlotBlock:
    """The drafter's block: its tokens, their laws (None when greedy), and per slot the best tokens
    with their drafter probabilities (for alternatives and scores)."""

    tokens: list[int]
    laws: list[torch.Tensor | None]
    top_tokens: list[list[int]]
    top_probs: list[list[float]]


def d3d_block(proposer: D3DProposer, tokens: list[int], k: int, params: SamplingParams, top: int) -> SlotBlock:
    """One synchronous D3D draft after `tokens`, with the `top` best tokens of each slot."""
    d = proposer.drafter
    logits = d.draft_block(tokens)[:k]
    drafts, q = sample_draft(d, logits, params, proposer.vocab_size, proposer.generator)
    probs = torch.softmax(logits.float() / (params.temperature if not params.greedy else 1.0), -1)
    values, index = probs.topk(min(top, probs.shape[-1]), -1)
    laws = [None] * len(drafts) if q is None else list(q)
    return SlotBlock(drafts, laws, d.draft_ids[index].tolist(), values.tolist())


class TreeProposer:
    """Builds each round's token tree from the D3D drafter (its block and, at every slot, its next best
    tokens followed by a few of the block's later tokens) and n-gram matches, under a token budget."""

    name = "d3d-tree"

    def __init__(self, drafter: D3DProposer | None, budget: int = 32, alternatives: int = 2, alt_tail: int = 3,
                 ngram_matches: int = 4, max_ngram: int = 3, cost: "WidthCost | None" = None):
        if budget < 1:
            raise D3DError(f"tree budget must be >= 1 (got {budget})")
        self.d3d, self.budget, self.alternatives, self.alt_tail = drafter, budget, alternatives, alt_tail
        self.ngram_matches, self.max_ngram, self.cost = ngram_matches, max_ngram, cost
        self.params = SamplingParams()

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter_gain, self.idle_rounds = 1.0, 0
        if self.d3d is not None:
            self.d3d.params = self.params
            self.d3d.reset(prompt_ids)

    def drafting_pays(self) -> bool:
        """Whether to run the drafter this round. Without a cost model, always. Else when the tokens that
        only it proposed on recent accepted paths (a moving average per round) are worth its cost, counting
        a token as one forward of width 1; and every PROBE_ROUNDS-th round anyway, to see whether it pays
        again. The choice depends on verified text only, so sampling stays exact."""
        if self.cost is None or self.drafter_gain * self.cost(1) >= self.cost.overhead:
            return True
        return self.idle_rounds >= PROBE_ROUNDS

    def accepted(self, tree: TokenTree, path: list[int], drafted: bool) -> None:
        """Feedback after verification: how many accepted tokens only the drafter had proposed."""
        if drafted:
            gain = sum(1 for i in path if "ngram" not in tree.sources[i])
            self.drafter_gain += GAIN_SMOOTHING * (gain - self.drafter_gain)
            self.idle_rounds = 0
        else:
            self.idle_rounds += 1

    def build(self, tokens: list[int], k: int) -> TokenTree:
        """The tree for the round after `tokens` (ending with the pending token), at most k deep."""
        draft = TreeDraft(tokens[-1])
        matches = ngram_continuations(tokens, k, self.ngram_matches, self.max_ngram) if k > 0 else []
        if k > 0 and self.d3d is not None and self.drafting_pays():
            self._add_drafter(draft, d3d_block(self.d3d, tokens, k, self.params, self.alternatives + 1))
        for n, follow in matches:
            conf = NGRAM_CONFIDENCE[min(n, max(NGRAM_CONFIDENCE))]
            draft.add(follow, [conf] * len(follow), "ngram")
        return draft.select(self.budget, k, self.cost)

    def _add_drafter(self, draft: TreeDraft, block: SlotBlock) -> None:
        conf = [p[0] for p in block.top_probs]  # the slot's largest probability, never the sampled token's
        chain = draft.add(block.tokens, conf, "d3d", laws=block.laws)
        for j in range(len(block.tokens)):
            parent = chain[j - 1] if j else 0
            alts = [(t, p) for t, p in zip(block.top_tokens[j], block.top_probs[j]) if t != block.tokens[j]]
            tail = slice(j + 1, j + 1 + self.alt_tail)
            for t, p in alts[:self.alternatives]:
                factors = [p] + [c * ALT_TAIL_DISCOUNT for c in conf[tail]]
                draft.add([t] + block.tokens[tail], factors, "alt", start=parent, laws=[None] + block.laws[tail])


# --------------------------------------------------------------------------------------------
# The decoding loop


@dataclass
class TreeGenerationResult(GenerationResult):
    """GenerationResult plus, per round, the tree's size and which proposers the accepted path came from
    (`branches`: "d3d", "alt", "ngram", joined with "+" when merged; "" when no draft was accepted)."""

    tree_sizes: list[int] = field(default_factory=list)
    branches: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for b in self.branches:
            counts[b or "none"] = counts.get(b or "none", 0) + 1
        mean = sum(self.tree_sizes) / max(1, len(self.tree_sizes))
        return super().to_json() | {"mean_tree_tokens": round(mean, 2), "accepted_branches": counts}


def _reporting_branch(on_round, res: TreeGenerationResult):
    """on_round as the engine calls it, (chunk, accepted); a callback that takes a `branch` keyword (the
    server's) also gets the proposer(s) of the round's accepted path (None for the prefill's token)."""
    if on_round is None or "branch" not in inspect.signature(on_round).parameters:
        return on_round
    return lambda chunk, accepted: on_round(chunk, accepted, branch=res.branches[-1] if res.branches else None)


def _branch(tree: TokenTree, path: list[int]) -> str:
    return "+".join(sorted(tree.sources[path[-1]])) if path else ""


@torch.no_grad()
def generate_tree(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
                  max_new_tokens: int = 128, proposer: TreeProposer | None = None, max_depth: int = 15,
                  stop: list[str] | None = None, on_round=None,
                  logprobs: LogprobRecorder | None = None) -> TreeGenerationResult:
    """Speculative decoding with one token tree verified per target forward (at most `max_depth` drafts
    deep). on_round, logprobs: as in d3d.engine.generate."""
    if proposer is None:
        raise D3DError("generate_tree needs a TreeProposer")
    params = params or SamplingParams()
    validate_request(model, prompt_ids, max_new_tokens, max(max_depth + 1, proposer.budget))
    device = model.output.weight.device
    gen = make_generator(params, device)
    stopper = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_new_tokens, stop)
    res = TreeGenerationResult(prompt_ids=list(prompt_ids))
    model.setup_cache(1, len(prompt_ids) + max_new_tokens + max(max_depth + 1, proposer.budget) + 1)
    proposer.params = params
    proposer.reset(list(prompt_ids))

    on_round = _reporting_branch(on_round, res)
    tokens, reason, t1, _ = prefill(model, res, stopper, prompt_ids, params, gen, device, on_round, logprobs)
    while reason is None:
        k = min(max_depth, max_new_tokens - len(res.token_ids) - 1)
        tree = proposer.build(tokens, k)
        base = len(tokens) - 1
        logits = tree_logits(model, tree)
        path, nxt = verify_tree(tree, logits, params, gen)
        compact_cache(model, base, path)
        proposer.accepted(tree, path, drafted=any("d3d" in s for s in tree.sources))
        chunk = [tree.tokens[i] for i in path] + [nxt]
        res.acceptance_lengths.append(len(path) + 1)
        res.tree_sizes.append(len(tree))
        res.branches.append(_branch(tree, path))
        reason = commit_round(res, stopper, tokens, chunk, on_round, logprobs, logits[[0] + path])
    return finish(res, stopper, reason, t1, device, logprobs)


# --------------------------------------------------------------------------------------------
# The tree budget: from the measured cost of a target forward versus its width


@torch.no_grad()
def width_cost_curve(model, widths: tuple[int, ...] = WIDTHS, context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward feeding `width` tokens after a cache of `context` tokens, for each
    width: the fastest of `repeats` runs (interference from other work only ever adds time), the widths
    taking turns so that a busy spell slows them all alike. Every forward is rolled back, so the cache
    only ever holds the context."""
    device = model.output.weight.device
    model.setup_cache(1, context + max(widths) + 1)
    model(torch.zeros(1, context, dtype=torch.long, device=device))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for r in range(repeats + 1):  # the first pass warms up
        for w in widths:
            feed = torch.zeros(1, w, dtype=torch.long, device=device)
            t0 = time.perf_counter()
            model(feed)
            sync_device(device)
            if r:
                times[w].append(time.perf_counter() - t0)
            model.rollback(context)
    return {w: min(t) for w, t in times.items()}


class WidthCost:
    """Seconds of a target forward by width (linear between measured widths), and the width that
    maximises expected tokens per second of a round."""

    def __init__(self, curve: dict[int, float], overhead: float = 0.0):
        self.widths = sorted(curve)
        self.curve, self.overhead = monotone(curve), overhead

    def __call__(self, width: int) -> float:
        ws = self.widths
        lo = max([w for w in ws if w <= width], default=ws[0])
        hi = min([w for w in ws if w >= width], default=ws[-1])
        if lo == hi:
            lo, hi = (ws[-2], ws[-1]) if width > ws[-1] else (lo, hi)
        if lo == hi:
            return self.curve[lo]
        return self.curve[lo] + (width - lo) * (self.curve[hi] - self.curve[lo]) / (hi - lo)

    def best_width(self, scores: list[float]) -> int:
        """Nodes sorted by score (the chance that verification reaches them): the tree width T (root
        included) maximising (1 + sum of the first T - 1 scores) / (cost(T) + overhead), i.e. expected
        tokens of the round per second. overhead: the round's other costs (drafting)."""
        best, best_rate, gain = 1, 0.0, 1.0
        for t in range(1, len(scores) + 2):
            if t > 1:
                gain += scores[t - 2]
            rate = gain / (self(t) + self.overhead)
            if rate > best_rate:
                best, best_rate = t, rate
        return best


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in width (a running maximum): a wider forward that measured faster
    than a narrower one did so by noise."""
    out, top = {}, 0.0
    for w in sorted(curve):
        top = max(top, curve[w])
        out[w] = top
    return out


def choose_budget(curve: dict[int, float], base: int = 16, max_ratio: float = 1.25) -> int:
    """The widest measured forward that costs at most `max_ratio` times a plain block of `base` tokens:
    beyond it, extra candidates would have to raise tau by more than the forward's extra cost."""
    if base not in curve:
        raise D3DError(f"the cost curve has no width {base}")
    curve = monotone(curve)
    limit = max_ratio * curve[base]
    return max(w for w, s in curve.items() if w <= base or s <= limit)


@torch.no_grad()
def drafter_cost(proposer: D3DProposer, context: int = 256, repeats: int = 3) -> float:
    """Seconds of one synchronous D3D draft after `context` tokens (one new token per draft): the fastest
    of `repeats`."""
    d = proposer.drafter
    d.setup_cache(1, context + d.block_size + 2)
    d.cached_tokens = []
    text = [0] * context
    d.draft_block(text)
    times = []
    for i in range(repeats):
        text[-1] = 1 + i % 2  # the last token changes: each draft feeds it again, as a round does
        t0 = time.perf_counter()
        d.draft_block(text)
        sync_device(d.draft_ids.device)
        times.append(time.perf_counter() - t0)
    return min(times)


def auto_tree(model, proposer: D3DProposer) -> TreeProposer:
    """A TreeProposer fitted to this device: its budget from choose_budget on the cost curve, and each
    round's width chosen by WidthCost.best_width with the drafter's own cost as overhead. Measured afresh
    (about 2 s on a CPU) rather than cached: the curve moves with the runtime, the threads and the load."""
    curve = width_cost_curve(model)
    base = proposer.drafter.block_size
    return TreeProposer(proposer, choose_budget(curve, base), cost=WidthCost(curve, drafter_cost(proposer)))


def _tree_runner(s: Setup):
    d = s.drafter("d3d", "d3d-tree")
    proposer = D3DProposer(d, s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    budget = s.options.get("tree_budget")
    tree = TreeProposer(proposer, budget) if budget else auto_tree(s.model, proposer)
    return Runner(partial(generate_tree, s.model, s.tokenizer, proposer=tree, max_depth=d.block_size - 1),
                  block_size=d.block_size, tree_budget=tree.budget,
                  tree_width_cost_s=None if tree.cost is None else tree.cost.curve)


D3D_TREE = register(Method("d3d-tree", _tree_runner, drafter_kind="d3d",
                           help="the drafter's block, its alternatives and n-gram matches verified as one token tree"))
