"""The token tree of d3d-tree: the trie its proposers fill, the target forward over the kept nodes,
verification, and cache compaction.

A round's trie is rooted at the pending token (the last verified token, not yet in the target's
cache). Every proposer adds paths to it; shared prefixes merge. Each node gets a score, an estimate of
the probability that verification reaches it, and the best nodes (root included; at most `budget`, and
with a cost model only as many as pay for the wider forward, see d3d.decoding.treecost.WidthCost) are fed to the
target in one forward: node i sits at position cache_len + depth(i) and attends to the cached prefix
and to its own ancestors only, so its logits equal those of its branch run alone. Verification walks
down from the root, and the KV rows of the accepted path are then copied into consecutive cache slots
(O(accepted) copies, nothing recomputed).

Losslessness. Greedy: at each node the target's argmax is taken and the walk descends into the child
holding it, if any, so the output is plain decoding's. Sampling: recursive rejection sampling over the
node's candidates, all deterministic (SpecInfer's rule with one-hot proposals): candidate y_i is
accepted with probability r(y_i), where r starts as the target's law p and becomes r with y_i removed,
renormalised, after each rejection; when all are rejected the token is drawn from r. The emitted token
has law p exactly for every candidate set, so the set may depend on anything but the target's own draws
of this round: scores, budget cuts, even tokens some proposer sampled. Candidates sampled from a law q
and accepted with min(1, r(y) / q(y)) would be exact only if whether they are in the tree did not depend
on which token was sampled, and a budget cut over merged nodes does depend on it (a sampled token that
coincides with an n-gram copy shares its node and its score): with the tiny target of the tests and a
budget of 2 nodes, such a tree's output failed the exact-law test at p = 1e-18 (tests/test_tree.py keeps the case), so
the trees take no sampled candidates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .verify import SamplingParams, greedy_tokens, probs_from_logits, sample

if TYPE_CHECKING:
    from .treecost import WidthCost


# --------------------------------------------------------------------------------------------
# The tree


@dataclass
class Candidate:
    """A proposed token after a node, and the child node it leads to."""

    token: int
    child: int


@dataclass
class TokenTree:
    """A flattened token tree, parents before children; node 0 is the root (the pending token)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[set[str]]
    cands: list[list[Candidate]]
    keys: list[set] = field(default_factory=list)  # per node: the proposers' own labels (see TreeDraft.add)

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
    keys: set = field(default_factory=set)
    children: dict[int, int] = field(default_factory=dict)  # token -> node, in the order verification tries them


class TreeDraft:
    """The trie the proposers fill; `select` keeps the best nodes under a budget."""

    def __init__(self, root: int):
        self.nodes = [_Node(root, -1, 0, 1.0, {"root"})]

    def add(self, path: list[int], factors: list[float], source: str, start: int = 0,
            keys: list | None = None) -> list[int]:
        """Add `path` below node `start`; factors[i] estimates the chance that token i is accepted once
        its parent is reached; keys[i], a label the proposer learns that chance under (kept in
        TokenTree.keys). Returns the nodes of the path."""
        node, out, reach = start, [], self.nodes[start].score
        for i, tok in enumerate(path):
            parent = self.nodes[node]
            reach *= factors[i]
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
            if keys is not None:
                self.nodes[child].keys.add(keys[i])
            node = child
            reach = self.nodes[node].score
            out.append(node)
        return out

    def ranked(self, budget: int, max_depth: int) -> list[int]:
        """The nodes `select` may keep, best first: each score capped at its parent's, at most max_depth deep, the
        `budget` - 1 best (ties to the shallower node)."""
        for n in self.nodes[1:]:
            n.score = min(n.score, self.nodes[n.parent].score)
        order = sorted(range(1, len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
        return [i for i in order if self.nodes[i].depth <= max_depth][:max(0, budget - 1)]

    def select(self, budget: int, max_depth: int, cost: "WidthCost | None" = None) -> TokenTree:
        """The best nodes (root included, none deeper than max_depth) as a flat tree: the `budget` best, or,
        given the cost of a target forward by width, the best prefix of those by expected tokens per second
        (see WidthCost.best_width). A child never scores above its parent and ties go to the shallower node,
        so the kept set is ancestor-closed."""
        fits = self.ranked(budget, max_depth)
        if cost is not None:
            fits = fits[:cost.best_width([self.nodes[i].score for i in fits]) - 1]
        kept = [0] + fits
        flat = {old: new for new, old in enumerate(kept)}
        cands = []
        for old in kept:
            node = self.nodes[old]
            cands.append([Candidate(t, flat[c]) for t, c in node.children.items() if c in flat])
        return TokenTree(tokens=[self.nodes[i].token for i in kept],
                         parents=[flat[self.nodes[i].parent] if i else -1 for i in kept],
                         depths=[self.nodes[i].depth for i in kept],
                         sources=[self.nodes[i].sources for i in kept], cands=cands,
                         keys=[self.nodes[i].keys for i in kept])


# --------------------------------------------------------------------------------------------
# Target forward over a tree, verification, cache compaction


def tree_mask(parents: list[int], cache_len: int, device=None) -> torch.Tensor:
    """Bool attention mask [1, 1, T, cache_len + T]: every node sees the cached prefix, itself and its
    ancestors (parents must come before children). Built in NumPy: a row copy there costs a tenth of
    torch's, and a round builds one mask."""
    T = len(parents)
    mask = np.ones((T, cache_len + T), dtype=bool)
    anc = mask[:, cache_len:]
    anc[:] = False
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return torch.from_numpy(mask)[None, None].to(device)


def tree_positions(depths: list[int], cache_len: int, device=None) -> torch.Tensor:
    return (cache_len + torch.tensor(depths, dtype=torch.long)).to(device)


def tree_logits(model, tree: TokenTree) -> torch.Tensor:
    """Feed the tree after the target's cache; returns its logits [T, V]. The cache then holds the
    tree's K/V in slots cache_len .. cache_len + T - 1, in tree order (see compact_cache)."""
    device = model.norm.weight.device
    L = model.cache_len
    feed = torch.tensor([tree.tokens], device=device)
    if len(tree) == 1:  # the root alone (no candidate this round): a plain step, the same row as under its mask
        return model(feed)[0]
    return model(feed, mask=tree_mask(tree.parents, L, device), positions=tree_positions(tree.depths, L, device))[0]


def compact_cache(model, base: int, path: list[int]) -> None:
    """Keep the root (slot `base`) and the accepted path's K/V rows, moved into consecutive slots
    base + 1 .. base + len(path), then set the cache length. `path` holds increasing tree indices, so no
    row is overwritten before it is read."""
    if path:
        device = model.norm.weight.device
        src = torch.tensor(path, device=device) + base
        dst = torch.arange(base + 1, base + 1 + len(path), device=device)
        if not torch.equal(src, dst):
            model.move_cache_rows(src, dst)
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
        token = greedy_tokens(row)
        return next((c.child for c in cands if c.token == token), None), token
    r = probs_from_logits(row, params)
    for c in cands:
        if float(torch.rand(1, generator=generator, device=r.device)) < float(r[c.token]):
            return c.child, c.token
        r = _without(r, c.token)
    return None, sample(r, generator)


def _without(r: torch.Tensor, token: int) -> torch.Tensor:
    """r with `token` removed, renormalised, after that candidate was rejected; r itself if rounding left
    nothing (then it could not have been rejected in exact arithmetic)."""
    rest = r.clone()
    rest[token] = 0.0
    total = float(rest.sum())
    return rest / total if total > 0 else r
