"""Target model: a compact Llama-family runtime (checkpoints are found and converted by d3d.runtime.checkpoints,
loaded by d3d.runtime.loading; d3d.runtime.fastpath makes the runtime fast on the CPU, d3d.runtime.quantize runs it in int8).

The runtime follows gpt-fast: plain modules, fused projections, and a preallocated KV cache whose
logical length is a single integer, so rolling back after a rejected draft is O(1).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..errors import D3DError
from .kernels import into_huge_pages, kernels_available, layer_params, pack_fp32
from .layers import Block, ModelArgs, RMSNorm, rope_frequencies

COMPILED_MIN_START = 2  # dynamo specialises the integers 0 and 1: a step at those positions runs eagerly


class Transformer(nn.Module):
    """A Llama-family decoder with a preallocated KV cache.

    `forward(tokens)` feeds k new tokens after the `cache_len` tokens already cached and returns their
    logits; `rollback(L)` forgets everything after the first L tokens.
    """

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        # built on the meta device (every loader does, then assigns the weights) the embedding skips its normal_
        # init: on meta tensors that runs a Python decomposition whose first call imports torch._dynamo (1.4 s)
        meta = torch.empty(0).is_meta
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim, _weight=torch.empty(a.vocab_size, a.dim) if meta else None)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(a), persistent=False)
        self.cache_len = 0
        self.max_batch = 0
        self.cache_size = 0
        self.kv_cache: torch.Tensor | None = None  # setup_cache: every layer's K/V in one tensor
        self.cache_views: list[torch.Tensor] = []  # its K views, as handed to the layers
        self.compiled_step = None  # set by compile_decode, with the KV cache they are bound to
        self.compiled_layers = None
        self.compiled_cache: torch.Tensor | None = None
        self.compiled_warm = False  # guards are checked until each graph has been compiled once
        self.cpu_layers: list[list[torch.Tensor]] | None = None  # torch.ops.d3d.layer's weights (pack_cpu_layers)
        self.cpu_params: list[torch.Tensor] | None = None  # the same, one layer after the other (torch.ops.d3d.layers)
        self.cpu_head: torch.Tensor | None = None  # the LM head packed for fp32_linear
        self.cpu_packed_from: list[tuple[nn.Module, torch.Tensor, int]] = []  # fp32 linears: (module, weight, version)
        # the layer list packed (d3d.drafters.drafter.bypassed swaps it); a weak reference, since a module held as an
        # attribute would join the state dict (and every saved checkpoint) a second time
        self.cpu_layers_of: weakref.ref | None = None

    def setup_cache(self, max_batch: int = 1, max_len: int | None = None) -> None:
        a = self.args
        max_len = max_len or a.max_seq_len
        p = self.norm.weight
        caches = [layer.attention.k_cache for layer in self.layers]
        # every layer is checked: a layer that was bypassed (d3d.training.prune) may hold an older, smaller cache
        if caches and all(c is not None and c.device == p.device and c.shape[0] >= max_batch
                          and c.shape[2] >= max_len for c in caches):
            self.cache_len = 0
            self.max_batch, self.cache_size = min(c.shape[0] for c in caches), min(c.shape[2] for c in caches)
            return
        # one tensor [K/V, layer, batch, heads, slot, head_dim]; each layer's caches are views of it
        self.kv_cache = torch.zeros((2, len(self.layers), max_batch, a.n_kv_heads, max_len, a.head_dim),
                                    dtype=p.dtype, device=p.device)
        self.cache_views = list(self.kv_cache[0])
        for layer, k, v in zip(self.layers, self.cache_views, self.kv_cache[1]):
            layer.attention.k_cache, layer.attention.v_cache = k, v
        self.max_batch, self.cache_size, self.cache_len = max_batch, max_len, 0

    def move_cache_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V in cache slots `src` to slots `dst` in every layer: one copy of the shared cache
        tensor when the layers' caches are still its views (60 small copies cost 0.2 ms a tree round)."""
        caches = [layer.attention for layer in self.layers]
        if len(caches) == len(self.cache_views) and all(
                att.k_cache is k for att, k in zip(caches, self.cache_views)):
            self.kv_cache[:, :, :, :, dst] = self.kv_cache[:, :, :, :, src]
            return
        for att in caches:
            att.k_cache[:, :, dst] = att.k_cache[:, :, src]
            att.v_cache[:, :, dst] = att.v_cache[:, :, src]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.cache_len})")
        self.cache_len = length

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        return angles.cos(), angles.sin()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_head is not None and self._cpu_ready(x.shape[0], None):
            return torch.ops.d3d.fp32_linear(self.norm(x), self.cpu_head, None)
        return self.output(self.norm(x))

    def pack_cpu_layers(self, copy_to_huge_pages: bool = True) -> None:
        """Run this model's forward passes over one sequence (batch 1, with a KV cache, no autograd) as one
        torch.ops.d3d.layers call (one torch.ops.d3d.layer per layer where hidden states are tapped), on
        weights packed for d3d's CPU kernels (d3d.runtime.kernels): every row is computed on its own, so
        verification rows and token trees are bitwise what one-token decoding steps compute, and the ~25
        small ops of a layer run in C++. fp32 weights are copied into the packed layout (and repacked if
        they change); int8 (d3d.runtime.quantize) are used as they are.
        Off the CPU, without the kernels (no compiler) or with weights they cannot take, the PyTorch layers stay.
        The packed weights go into 2 MB pages (d3d.runtime.kernels.into_huge_pages; with copy_to_huge_pages False only
        the spans of the tensors that hold whole ones, in place)."""
        usable = self.tok_embeddings.weight.device.type == "cpu" and kernels_available()
        params = [layer_params(layer) for layer in self.layers] if usable else None
        if params is None or any(p is None for p in params):
            self.drop_cpu_layers()
            return
        fp32 = isinstance(self.output, nn.Linear)
        self.cpu_head = pack_fp32(self.output.weight) if fp32 else None
        head = [self.cpu_head] if self.cpu_head is not None else list(self.output.buffers())
        into_huge_pages([t for layer in params for t in layer] + head, list(self.buffers()), copy_to_huge_pages)
        self.use_cpu_layers(params)
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)] if fp32 else []
        self.cpu_packed_from = [(m, m.weight, m.weight._version) for m in linears]

    def use_cpu_layers(self, params: list[list[torch.Tensor]]) -> None:
        """Run forwards on these packed layers (layer_params of each module of self.layers, in order): the list
        pack_cpu_layers made, or a pruning trial's subset of it (d3d.drafters.drafter.bypassed)."""
        self.cpu_layers, self.cpu_layers_of = params, weakref.ref(self.layers)
        self.cpu_params = [t for layer in params for t in layer]  # torch.ops.d3d.layers's flat list

    def drop_cpu_layers(self) -> None:
        """Run every forward on the PyTorch layers again (compiled graphs trace them; a reference run)."""
        self.cpu_layers, self.cpu_params, self.cpu_head, self.cpu_packed_from = None, None, None, []

    def _cpu_ready(self, batch: int, mask: torch.Tensor | None) -> bool:
        """Whether this forward may run on the CPU layers (pack_cpu_layers): one sequence, a bool mask, the
        packed layers are those of self.layers (use_cpu_layers), no gradient needed; fp32 weights changed
        since packing (an optimizer step) are repacked first."""
        if self.cpu_layers is None or batch != 1 or (mask is not None and mask.dtype != torch.bool) \
                or self.cpu_layers_of() is not self.layers:
            return False
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            return False
        # m._parameters, not m.weight: nn.Module's __getattr__ made this check 60 us a forward instead of 10
        if any(m._parameters["weight"] is not w or w._version != v for m, w, v in self.cpu_packed_from):
            self.pack_cpu_layers()
        return True

    def hidden(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               hidden_layers: list[int] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the layers over `tokens` [B, T] after the cached prefix; returns (last hidden, [taps]).

        mask: optional bool [B|1, 1, T, cache_len + T] over all keys (True = attend); default causal.
        positions: optional rotary positions [T] or [B, T]; default cache_len + arange(T).
        Without a cache (setup_cache never called) the tokens are a whole sequence, as in training.
        """
        T = tokens.shape[1]
        cached = self.layers[0].attention.k_cache is not None if len(self.layers) else False
        start = self.cache_len if cached else 0
        if cached and start + T > self.cache_size:
            raise D3DError(f"sequence of {start + T} tokens exceeds the KV cache ({self.cache_size})")
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        if cached and self._cpu_ready(tokens.shape[0], mask):
            return self._cpu_hidden(tokens, mask, positions, start, hidden_layers)
        cos, sin = self.rope(positions)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        if mask is None and T > 1:
            mask = torch.ones(T, start + T, dtype=torch.bool, device=tokens.device).tril(start)
        x = self.embed(tokens)
        taps = []
        if self._compiled_for(tokens) and T > 1 and hidden_layers is None and cos.dim() == 2 \
                and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # what the graph was traced with
            with torch.no_grad(), torch.compiler.set_stance(skip_guard_eval_unsafe=self.compiled_warm):
                x = self.compiled_layers(x, cos, sin, mask.reshape(1, 1, T, start + T), start)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, mask, start)
                if hidden_layers is not None and i in hidden_layers:
                    taps.append(x)
        if cached:
            self.cache_len = start + T
        return x, taps

    def _cpu_hidden(self, tokens: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, start: int,
                    hidden_layers: list[int] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """hidden() on the CPU layers (pack_cpu_layers): one torch.ops.d3d.layers call for all of them, or one
        torch.ops.d3d.layer call per layer where hidden states are tapped."""
        T, a = tokens.shape[1], self.args
        if mask is not None:
            mask = mask.reshape(T, start + T)
        x, taps = self.embed(tokens), []
        if hidden_layers is None:
            atts = [layer.attention for layer in self.layers]
            x = torch.ops.d3d.layers(x, self.cpu_params, [att.k_cache for att in atts], [att.v_cache for att in atts],
                                     self.inv_freq, positions.reshape(T), mask, start, a.n_heads, a.norm_eps)
            self.cache_len = start + T
            return x, taps
        for i, (layer, params) in enumerate(zip(self.layers, self.cpu_layers)):
            att = layer.attention
            x = torch.ops.d3d.layer(x, params, att.k_cache, att.v_cache, self.inv_freq, positions.reshape(T), mask,
                                    start, a.n_heads, a.norm_eps)
            if hidden_layers is not None and i in hidden_layers:
                taps.append(x)
        self.cache_len = start + T
        return x, taps

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                last_only: bool = False, hidden_layers: list[int] | None = None, logits_to_keep: int = 0):
        """tokens [B, T] -> logits [B, T, V] for the new tokens (only the last `logits_to_keep` if > 0, or
        the last one with last_only); with hidden_layers also the hidden states after those layers."""
        if self._compiled_for(tokens) and tokens.shape[1] == 1 and mask is None and positions is None \
                and hidden_layers is None and self.cache_len < self.cache_size:
            return self._compiled_decode(tokens)
        x, taps = self.hidden(tokens, mask, positions, hidden_layers)
        keep = 1 if last_only else logits_to_keep
        logits = self.head(x[:, -keep:] if keep else x)
        return (logits, taps) if hidden_layers is not None else logits

    def decode_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int) -> torch.Tensor:
        """One token's embedding x [1, 1, dim] at position `start` -> logits [1, 1, V] (compile_decode compiles it)."""
        return self.head(self.run_layers(x, cos, sin, None, start))

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                   start: int) -> torch.Tensor:
        """The layers over x [B, T, dim] after `start` cached tokens (compile_decode compiles it for T > 1)."""
        for layer in self.layers:
            x = layer(x, cos, sin, mask, start)
        return x

    def _compiled_for(self, tokens: torch.Tensor) -> bool:
        """Whether the compiled graphs may run this forward: one sequence, on the cache they are bound to,
        at a position dynamo did not specialise."""
        return self.compiled_step is not None and tokens.shape[0] == 1 and self.cache_len >= COMPILED_MIN_START \
            and self.layers[0].attention.k_cache is self.compiled_cache

    def _compiled_decode(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.cache_len
        cos, sin = self.rope(torch.arange(start, start + 1, device=tokens.device))
        with torch.no_grad(), torch.compiler.set_stance(skip_guard_eval_unsafe=self.compiled_warm):  # inference only
            logits = self.compiled_step(self.embed(tokens), cos, sin, start)
        self.cache_len = start + 1
        return logits
