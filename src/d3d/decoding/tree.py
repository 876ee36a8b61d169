"""The token-tree loop: each round one tree of candidates (from a tree proposer: d3d.methods.tree's
TreeProposer, or d3d.methods.suffix's) is fed to the target in one forward and verified, losslessly
(d3d.decoding.tokentree states the rule; its width: d3d.decoding.treecost).

A tree proposer speaks the proposer protocol (d3d.decoding.proposer): reset(prompt_ids), propose(tokens,
k) -> TokenTree, accept(tree, path), with `params` and a token `budget`, and optionally learn(prompt_ids,
token_ids), called with every finished generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import D3DError
from .engine import GenerationResult, LogprobRecorder, StopChecker, commit_round, finish, prefill, validate_request
from .tokentree import TokenTree, compact_cache, tree_logits, verify_tree
from .verify import SamplingParams, make_generator


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


def _branch(tree: TokenTree, path: list[int]) -> str:
    return "+".join(sorted(tree.sources[path[-1]])) if path else ""


@torch.no_grad()
def generate_tree(model, tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
                  max_new_tokens: int = 128, proposer=None, max_depth: int = 15,
                  stop: list[str] | None = None, on_round=None, on_branch=None,
                  logprobs: LogprobRecorder | None = None) -> TreeGenerationResult:
    """Speculative decoding with one token tree verified per target forward (at most `max_depth` drafts
    deep). on_round, logprobs: as in d3d.decoding.engine.generate. on_branch(branch), if given, is called
    before on_round with the proposer(s) of the round's accepted path (res.branches)."""
    if proposer is None:
        raise D3DError("generate_tree needs a tree proposer")
    params = params or SamplingParams()
    validate_request(model, prompt_ids, max_new_tokens, max(max_depth + 1, proposer.budget))
    device = model.norm.weight.device
    gen = make_generator(params, device)
    stopper = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_new_tokens, stop)
    res = TreeGenerationResult(prompt_ids=list(prompt_ids))
    model.setup_cache(1, len(prompt_ids) + max_new_tokens + max(max_depth + 1, proposer.budget) + 1)
    tokens, reason, t1 = prefill(model, res, stopper, prompt_ids, params, gen, device, on_round, logprobs, proposer)
    while reason is None:
        k = min(max_depth, max_new_tokens - len(res.token_ids) - 1)
        tree = proposer.propose(tokens, k)
        base = len(tokens) - 1
        logits = tree_logits(model, tree)
        path, nxt = verify_tree(tree, logits, params, gen)
        compact_cache(model, base, path)
        proposer.accept(tree, path)
        chunk = [tree.tokens[i] for i in path] + [nxt]
        res.acceptance_lengths.append(len(path) + 1)
        res.tree_sizes.append(len(tree))
        res.branches.append(_branch(tree, path))
        if on_branch is not None:
            on_branch(res.branches[-1])
        rows = logits[[0] + path] if logprobs is not None else None  # a copy of the path's rows: only if asked
        reason = commit_round(res, stopper, tokens, chunk, on_round, logprobs, rows)
    res = finish(res, stopper, reason, t1, device, logprobs)
    learn = getattr(proposer, "learn", None)  # after the generation and its timing: later ones retrieve it
    if learn is not None:
        learn(list(prompt_ids), res.token_ids)
    return res

