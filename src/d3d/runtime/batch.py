"""One target forward over the new tokens of several sequences (continuous batching; the scheduler that decides
what goes into each forward is d3d.scheduler).

Each sequence owns a slot of one preallocated KV cache [K/V, layer, slot, kv_heads, position, head_dim] and
brings its own cache length, positions and mask (a token tree), as a `Segment`. On the CPU layers
(torch.ops.d3d.layers_batch) the matrix products take every row of the batch at once, which is what makes a
batch cheap (a forward is bound by reading the weights up to several rows), and everything else is computed
row by row: a row's logits are bitwise what the same sequence computes alone, so greedy output does not depend
on what a request is batched with. Elsewhere (no C++ kernels, a GPU) the segments run one after the other on
the PyTorch layers, each on its own slot of the cache: the same results, without the batching's speed.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import D3DError


@dataclass
class Segment:
    """The next `tokens` [T] of the sequence in cache `slot`, fed after its first `start` cached tokens at
    rotary `positions` [T] with `mask` (bool [T, start + T]; None: causal); `keep`: the logits wanted, of the
    last `keep` rows (0: all)."""

    slot: int
    tokens: torch.Tensor
    start: int
    positions: torch.Tensor
    mask: torch.Tensor | None = None
    keep: int = 0

    @property
    def width(self) -> int:
        return self.tokens.shape[0]


def runs_natively(model) -> bool:
    """Whether a BatchedTarget of `model` runs its forwards on the C++ layers, all segments in one call."""
    return getattr(model, "cpu_params", None) is not None and model._cpu_ready(1, None)  # HFRuntime has neither


class BatchedTarget:
    """A target model (d3d.runtime.target.Transformer) with a KV cache of `slots` sequences of up to `max_len`
    tokens each, run over several sequences per forward (`forward`)."""

    def __init__(self, model, slots: int, max_len: int | None = None):
        if slots < 1:
            raise D3DError(f"a batch needs at least one slot (got {slots})")
        a, p = model.args, model.norm.weight
        self.model, self.slots, self.max_len = model, slots, max_len or a.max_seq_len
        self.kv = torch.zeros((2, len(model.layers), slots, a.n_kv_heads, self.max_len, a.head_dim),
                              dtype=p.dtype, device=p.device)
        self.k_caches, self.v_caches = list(self.kv[0]), list(self.kv[1])

    def release(self) -> None:
        """Free the KV cache (a batch of 8 slots of 8,192 tokens holds 3 GB on SmolLM2): a scheduler that
        stops is often left to the cycle collector (its slots point back at it), which runs on object counts,
        not bytes, so a bench building one scheduler per level and method held every earlier cache at once."""
        self.kv, self.k_caches, self.v_caches = None, [], []

    def _check_cache(self) -> None:
        if self.kv is None:
            raise D3DError("the batch's KV cache was released (its scheduler has stopped)")

    @property
    def native(self) -> bool:
        """Whether forwards run on the C++ layers, all segments in one call (else one PyTorch pass each)."""
        return runs_natively(self.model)

    def move_rows(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at positions `src` of one slot to positions `dst` (a token tree's accepted path)."""
        self._check_cache()
        self.kv[:, :, slot, :, dst] = self.kv[:, :, slot, :, src]

    @torch.no_grad()
    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Logits [keep or T, V] of each segment, its K/V written into its slot."""
        self._check_cache()
        for s in segments:
            if not 0 <= s.slot < self.slots:
                raise D3DError(f"cache slot {s.slot} outside the batch's {self.slots}")
            if s.start + s.width > self.max_len:
                raise D3DError(f"sequence of {s.start + s.width} tokens exceeds the KV cache ({self.max_len})")
        if len({s.slot for s in segments}) != len(segments):
            raise D3DError("two segments of one forward share a cache slot")
        if not self.native:
            return [self._alone(s) for s in segments]
        m, a = self.model, self.model.args
        x = m.embed(torch.cat([s.tokens for s in segments]))[None]
        masks = [s.mask.reshape(s.width, s.start + s.width) if s.mask is not None else torch.empty(0, dtype=torch.bool)
                 for s in segments]
        h = torch.ops.d3d.layers_batch(x, m.cpu_params, self.k_caches, self.v_caches, m.inv_freq,
                                       torch.cat([s.positions for s in segments]), masks, [s.slot for s in segments],
                                       [s.start for s in segments], [s.width for s in segments], a.n_heads, a.norm_eps)
        rows, ends, end = [], [], 0
        for s in segments:
            end += s.width
            keep = s.keep or s.width
            rows += range(end - keep, end)
            ends.append(len(rows))
        logits = m.head(h[:, rows])[0]
        return list(torch.tensor_split(logits, ends[:-1]))

    def _alone(self, s: Segment) -> torch.Tensor:
        """One segment on the PyTorch layers: the model's caches point at the slot's while it runs."""
        m = self.model
        atts = [layer.attention for layer in m.layers]
        saved = [(att.k_cache, att.v_cache) for att in atts], m.cache_len, m.cache_size
        try:
            for att, k, v in zip(atts, self.k_caches, self.v_caches):
                att.k_cache, att.v_cache = k[s.slot:s.slot + 1], v[s.slot:s.slot + 1]
            m.cache_len, m.cache_size = s.start, self.max_len
            mask = None if s.mask is None else s.mask.reshape(1, 1, s.width, s.start + s.width)
            x, _ = m.hidden(s.tokens[None], mask, s.positions)
            return m.head(x[:, -s.keep:] if s.keep else x)[0]
        finally:
            for att, (k, v) in zip(atts, saved[0]):
                att.k_cache, att.v_cache = k, v
            m.cache_len, m.cache_size = saved[1], saved[2]


def with_own_cache(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (a runtime Transformer, or a drafter built on one) that shares every tensor it holds,
    weights, buffers and packed C++ weights alike, but has module objects, and so a KV cache, of its own: what
    each generation of a batch drafts with (a drafter's cache follows its own text). Costs no weight memory."""
    memo: dict[int, object] = {}

    def share(value) -> None:
        if isinstance(value, torch.Tensor):
            memo[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for v in value:
                share(v)
        elif isinstance(value, dict):
            for v in value.values():
                share(v)

    for m in model.modules():
        share(vars(m))
    twin = copy.deepcopy(model, memo)
    if hasattr(twin, "release_cache"):
        twin.release_cache()
    else:
        for layer in twin.layers:
            layer.attention.k_cache = layer.attention.v_cache = None
        twin.kv_cache, twin.cache_views, twin.cache_len = None, [], 0
    if getattr(model, "cpu_layers_of", None) is not None and model.cpu_layers_of() is model.layers:
        twin.use_cpu_layers(twin.cpu_layers)  # the packed layers are the twin's own (shared weights)
    return twin
