"""External reference: SuffixDecoding (arXiv 2411.04975) as Snowflake's arctic-inference implements it.

Its suffix-decoding cache keeps suffix trees over token sequences: one per active request over its
prompt and the response so far, and one global tree over every earlier response (kept until evicted,
FIFO, beyond `max_cached_requests`). Each round it matches the longest suffixes of the text against
both trees and proposes a speculation tree (tokens and parents) from the better match, each node scored
by the frequency of its continuation (the share of the matched occurrences that continued with it, times
its parent's score), nodes below `min_token_prob` left out, and at most `max_spec_factor * match length
+ max_spec_offset` tokens, so the draft grows with the match. Its C++ tree is used as is (the optional
extra `pip install -e ".[suffix]"`, see SUFFIX_INSTALL); d3d verifies the proposed tree with its own
token-tree verifier (d3d.decoding.tokentree), so the method is lossless: greedy output is plain decoding's, and
sampling keeps the target's law, since the tree depends only on verified text and on earlier
generations' outputs, never on this round's draws.

Mapped onto arctic-inference's API as vLLM's `method: suffix` drives it (its model runner): the prompt
starts the request (`start_request`), every verified token is appended to the active response
(`add_active_response`, before each round's `speculate` on the last `max_tree_depth` tokens, the pending
token included, and once more at the end), and the request is stopped when the generation ends
(`stop_request`); its response stays in the global tree, so later generations of the same runner learn
from it (a bench's warm-up generation included). With learning off (option `learn` False: `--no-learn`,
`d3d.load(learn=False)`) the cache is built with `max_cached_requests=0`, arctic-inference's switch for
no global tree: each generation drafts from its own prompt and response only, as if it were the first.

The parameters are those vLLM's `method: suffix` runs with in arctic-inference 0.3.0 (SUFFIX_DEFAULTS)
except that speculation builds a tree (`use_tree_spec`, the paper's setting; vLLM's chain verifier asks
for a single path) of at most budget - 1 tokens, the budget being --tree-budget, else --block-size (16:
one pending token and 15 drafts, as vLLM's 16).
"""
from __future__ import annotations

import itertools
from functools import partial

from ..errors import D3DError
from .registry import Method, Runner, Setup, register
from ..decoding.proposer import Proposer
from ..decoding.tokentree import TokenTree, TreeDraft
from ..decoding.tree import TreeGenerationResult, generate_tree
from ..decoding.verify import SamplingParams

ARCTIC_VERSION = "0.3.0"  # the version the `suffix` extra pins (pyproject.toml)
SUFFIX_INSTALL = ('pip install nanobind==2.9.2 cmake && pip install --no-build-isolation -e ".[suffix]" '
                  "(builds arctic-inference's C++ suffix tree, about 30 s, no CUDA)")
# vLLM's `method: suffix` settings in arctic-inference 0.3.0 (arctic_inference/vllm/config.py)
SUFFIX_DEFAULTS = {"max_tree_depth": 64, "max_cached_requests": 100000, "max_spec_factor": 1.0,
                   "max_spec_offset": 0.0, "min_token_prob": 0.1}
_REQUEST_IDS = itertools.count()  # request ids, unique in the process (proposers may share a cache)


def suffix_cache(max_tree_depth: int = SUFFIX_DEFAULTS["max_tree_depth"],
                 max_cached_requests: int = SUFFIX_DEFAULTS["max_cached_requests"]):
    """A new arctic_inference SuffixDecodingCache, or a one-line error saying how to install it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise D3DError(f"the suffix method needs arctic-inference=={ARCTIC_VERSION}: {SUFFIX_INSTALL}") from None
    return SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)


def arctic_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("arctic-inference")
    except PackageNotFoundError:
        return None


class SuffixProposer(Proposer):
    """The tree proposer of d3d.decoding.tree.generate_tree (reset / propose / accept) over a SuffixDecodingCache.

    One generation is one request of the cache; `finish()` closes it (SuffixRunner calls it after every
    generation). The cache lives as long as the proposer, so its global tree holds the responses of
    every earlier generation (none with a cache of max_cached_requests=0)."""

    name = "suffix"

    def __init__(self, cache, budget: int = 16, max_spec_factor: float = SUFFIX_DEFAULTS["max_spec_factor"],
                 max_spec_offset: float = SUFFIX_DEFAULTS["max_spec_offset"],
                 min_token_prob: float = SUFFIX_DEFAULTS["min_token_prob"], use_tree_spec: bool = True):
        if budget < 1:
            raise D3DError(f"tree budget must be >= 1 (got {budget})")
        self.cache, self.budget = cache, budget
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.min_token_prob, self.use_tree_spec = min_token_prob, use_tree_spec
        self.params = SamplingParams()  # set by generate_tree; the proposals do not depend on it
        self.request: int | None = None
        self._prompt_len = self._added = 0  # the prompt's tokens; those of the working text in the cache
        self.match_lens: list[int] = []  # per round: the context match the draft came from (0: no draft)

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a request with this prompt (closing any request an interrupted generation left open)."""
        self.finish()
        self.request = next(_REQUEST_IDS)
        self.cache.start_request(self.request, list(prompt_ids))
        self._prompt_len = self._added = len(prompt_ids)
        self.match_lens = []

    def _extend(self, tokens: list[int]) -> None:
        if self.request is not None and len(tokens) > self._added:
            self.cache.add_active_response(self.request, list(tokens[self._added:]))
            self._added = len(tokens)

    def propose(self, tokens: list[int], k: int) -> TokenTree:
        """The tree for the round after `tokens` (the prompt and the verified output, ending with the pending
        token), at most k deep and `budget` nodes with the root: the cache's speculation tree, its nodes
        scored by the cache's probability estimates (candidates tried most likely first)."""
        self._extend(tokens)
        draft = TreeDraft(tokens[-1])
        width = self.budget - 1 if k > 0 else 0  # deeper nodes than k are cut by select
        if width <= 0:
            self.match_lens.append(0)
            return draft.select(self.budget, k)
        spec = self.cache.speculate(self.request, list(tokens[-self.cache.max_tree_depth:]),
                                    max_spec_tokens=width, max_spec_factor=self.max_spec_factor,
                                    max_spec_offset=self.max_spec_offset, min_token_prob=self.min_token_prob,
                                    use_tree_spec=self.use_tree_spec)
        nodes: list[int] = []
        for token, parent, prob in zip(spec.token_ids, spec.parents, spec.probs):
            # the cache gives each node's probability along its path; TreeDraft takes it per step
            above = spec.probs[parent] if parent >= 0 else 1.0
            start = nodes[parent] if parent >= 0 else 0
            nodes.append(draft.add([int(token)], [prob / above if above > 0 else 0.0], "suffix", start=start)[0])
        self.match_lens.append(spec.match_len if nodes else 0)
        return draft.select(self.budget, k)

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Nothing to learn here: the cache learns from the verified tokens, added at the next propose."""

    def finish(self, token_ids: list[int] | None = None) -> None:
        """Close the open request, first appending the output's tokens not yet added (`token_ids`: the
        generation's whole output, prompt excluded). Its response stays in the global tree, if the cache
        keeps one."""
        if self.request is None:
            return
        try:
            if token_ids is not None:
                start = self._added - self._prompt_len
                if 0 <= start < len(token_ids):
                    self.cache.add_active_response(self.request, list(token_ids[start:]))
        finally:
            self.cache.stop_request(self.request)
            self.request = None


class SuffixRunner:
    """runner(prompt_ids, params=..., max_new_tokens=..., stop=..., on_round=..., on_branch=..., logprobs=...) ->
    TreeGenerationResult: d3d.decoding.tree.generate_tree with a SuffixProposer, closing the cache's request after
    every generation (also one that raised, e.g. a cancelled one)."""

    def __init__(self, model, tokenizer, proposer: SuffixProposer):
        self.proposer = proposer
        self._generate = partial(generate_tree, model, tokenizer, proposer=proposer, max_depth=proposer.budget - 1)

    def __call__(self, prompt_ids: list[int], params: SamplingParams | None = None, max_new_tokens: int = 128,
                 stop: list[str] | None = None, on_round=None, on_branch=None, logprobs=None) -> TreeGenerationResult:
        res = None
        try:
            res = self._generate(prompt_ids, params=params, max_new_tokens=max_new_tokens, stop=stop,
                                 on_round=on_round, on_branch=on_branch, logprobs=logprobs)
        finally:
            self.proposer.finish(None if res is None else res.token_ids)
        return res

    def learn(self, prompt_ids: list[int], token_ids: list[int]) -> None:
        """Put a finished generation's response in the cache's global tree, as if it had been generated here
        (a resumed bench replays its journal's generations through it)."""
        self.proposer.reset(prompt_ids)
        self.proposer.finish(token_ids)

    def forget(self) -> None:
        """Evict every earlier response from the cache's global tree."""
        cache = self.proposer.cache
        for request in list(cache.cached_requests):
            cache.evict_cached_response(request)


def _suffix_runner(s: Setup) -> Runner:
    """The suffix Runner; with learning on (option `learn`, on unless False) it has `forget()`, as the
    tree methods' runners have, and with it off its cache keeps no global tree."""
    budget = s.options.get("tree_budget") or s.block_size
    learn = s.options.get("learn") is not False
    settings = SUFFIX_DEFAULTS | ({} if learn else {"max_cached_requests": 0})
    proposer = SuffixProposer(suffix_cache(settings["max_tree_depth"], settings["max_cached_requests"]), budget)
    run = SuffixRunner(s.model, s.tokenizer, proposer)
    runner = Runner(run.__call__, block_size=budget, tree_budget=budget, use_tree_spec=proposer.use_tree_spec,
                    arctic_inference=arctic_version(), learn=learn, **settings)
    if learn:
        runner.forget, runner.learn = run.forget, run.learn
    return runner


SUFFIX = register(Method("suffix", _suffix_runner, branches=True,
                         help="reference: SuffixDecoding (arctic-inference's suffix trees over the prompt and, unless "
                              "learning is off, earlier responses) verified as one token tree; "
                              "pip install -e \".[suffix]\""))
