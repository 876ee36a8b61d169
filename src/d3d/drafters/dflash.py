"""A DFlash-style drafter (baseline): block diffusion conditioned on the target's hidden states.

The target's hidden states after a few of its layers (spread over its depth) are concatenated, fused
by a linear layer and normalised into one context vector per verified position. Every drafter layer
reads that context through its own key/value projections: the block's queries attend to the context's
K/V (positions before the block) and to the block itself, bidirectionally. The context is not updated
across drafter layers, so its K/V can be cached per layer and appended as the target verifies.

The block is [last verified token, MASK x (B-1)] at the positions that token and its successors
occupy; slot k > 0 drafts token k of the block. Because the context must come from the target's
verification of the previous block, drafting and verifying alternate strictly (synchronous only).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .drafter import Drafter, DrafterConfig
from ..runtime.layers import Block, RMSNorm


def _layer(layer: Block, h: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos, sin,
           mask: torch.Tensor | None) -> torch.Tensor:
    """One drafter layer on the block states h, with the context's K/V prepended to the block's own."""
    att = layer.attention
    q, k, v = att.qkv(layer.attention_norm(h), cos, sin)
    k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=att.a.n_kv_heads != att.a.n_heads)
    h = h + att.wo(y.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
    return h + layer.feed_forward(layer.ffn_norm(h))


class DFlashDrafter(Drafter):
    extra_prefixes = ("fc.", "hidden_norm.")

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        a = cfg.model_args
        self.fc = nn.Linear(len(cfg.target_layers) * a.dim, a.dim, bias=False)
        self.hidden_norm = RMSNorm(a.dim, a.norm_eps)

    def context(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """Fused context vectors [N, T, dim] from the target's hidden states after target_layers."""
        return self.hidden_norm(self.fc(torch.cat(taps, dim=-1).to(self.fc.weight.dtype)))

    def blocks(self, ctx: torch.Tensor, ctx_pos: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states [N, S, dim] of block tokens [N, S] (positions [N|1, S]) that attend to the context
        vectors ctx [N, T, dim] (positions ctx_pos) and to each other as `mask` [N|1, 1, S, T + S] allows."""
        cc, cs = self.rope(ctx_pos)
        bc, bs = self.rope(pos)
        if cc.dim() == 3:
            cc, cs = cc[:, None], cs[:, None]
        if bc.dim() == 3:
            bc, bs = bc[:, None], bs[:, None]
        h = self.embed(tokens)
        for layer in self.layers:
            _, ck, cv = layer.attention.qkv(ctx, cc, cs)
            h = _layer(layer, h, ck, cv, bc, bs, mask)
        return h

    # ---- inference: per-layer K/V of the verified context in the layers' own caches

    @torch.no_grad()
    def observe(self, taps: list[torch.Tensor]) -> None:
        """Append the context of newly verified positions (taps: [1, n, dim] per target layer)."""
        ctx = self.context(taps)
        n, L = ctx.shape[1], self.cache_len
        cos, sin = self.rope(torch.arange(L, L + n, device=ctx.device))
        for layer in self.layers:
            _, k, v = layer.attention.qkv(ctx, cos, sin)
            layer.attention.k_cache[:1, :, L:L + n] = k
            layer.attention.v_cache[:1, :, L:L + n] = v
        self.cache_len = L + n

    @torch.no_grad()
    def draft(self, last_token: int) -> torch.Tensor:
        """Logits [B-1, V_draft] of the block after the cached context whose slot 0 is `last_token`."""
        B, L, device = self.block_size, self.cache_len, self.draft_ids.device
        tokens = torch.tensor([[last_token] + [self.mask_id] * (B - 1)], device=device)
        cos, sin = self.rope(torch.arange(L, L + B, device=device))
        h = self.embed(tokens)
        for layer in self.layers:
            att = layer.attention
            h = _layer(layer, h, att.k_cache[:1, :, :L], att.v_cache[:1, :, :L], cos, sin, None)
        return self.head(h[0, 1:])
