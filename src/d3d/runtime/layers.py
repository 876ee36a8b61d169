"""The layers of the Llama-family runtime (d3d.runtime.target): its shape (ModelArgs, read from an HF
config), rotary embeddings, RMSNorm, attention over a preallocated KV cache, the SiLU feed-forward and
the decoder block."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import D3DError


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 4096

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = rope if rope.get("rope_type", "default") not in ("default", None) else None
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=scaling,
            qkv_bias=cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias")),
            qk_norm=cfg["model_type"] == "qwen3", tie_embeddings=bool(cfg.get("tie_word_embeddings")),
            max_seq_len=min(int(cfg.get("max_position_embeddings", 4096)), 8192, _sliding_window(cfg)),
        )


def _sliding_window(cfg: dict) -> int:
    """Full attention is exact only within a sliding window (Mistral): cap the context there."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return int(window) if window else 1 << 30


def rope_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """The rotary inverse frequencies, computed on the CPU (under a meta default device the arithmetic would run
    PyTorch's Python decompositions, whose first call imports torch._dynamo), then on `device` (None: the
    default device)."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32, device="cpu") / args.head_dim))
    s = args.rope_scaling
    if s and s.get("rope_type") == "llama3":
        lo = s["original_max_position_embeddings"] / s["low_freq_factor"]
        hi = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        scaled = torch.where(wavelen > lo, inv / s["factor"], inv)
        mid = (wavelen <= lo) & (wavelen >= hi)
        inv = torch.where(mid, (1 - smooth) * inv / s["factor"] + smooth * inv, scaled)
    elif s:
        raise D3DError(f"unsupported rope scaling {s.get('rope_type')}")
    return inv.float().to(torch.get_default_device() if device is None else device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [T, D/2] (or [B, 1, T, D/2]). HF's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotary queries, keys and values [B, heads, T, head_dim] of input x [B, T, dim] (already normed)."""
        a, (B, T, _) = self.a, x.shape
        qk, v = self.wqkv(x).split([(a.n_heads + a.n_kv_heads) * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1)
        v = v.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        qk = qk.view(B, T, a.n_heads + a.n_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([a.n_heads, a.n_kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        # queries and keys rotated in one go (the same elementwise math as one by one, half the ops)
        q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([a.n_heads, a.n_kv_heads], dim=1)
        return q, k, v

    def forward(self, x, cos, sin, mask, start: int) -> torch.Tensor:
        a, (B, T, _) = self.a, x.shape
        q, k, v = self.qkv(x, cos, sin)
        if self.k_cache is not None:
            self.k_cache[:B, :, start:start + T] = k
            self.v_cache[:B, :, start:start + T] = v
            k, v = self.k_cache[:B, :, :start + T], self.v_cache[:B, :, :start + T]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.n_kv_heads != a.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(a.dim, 2 * a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, cos, sin, mask, start: int) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, start)
        return x + self.feed_forward(self.ffn_norm(x))
