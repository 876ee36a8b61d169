"""HFRuntime: transformers' model behind the native runtime's interface, the target runtime for
architectures without a native one (d3d.runtime.loading), and load_hf_model for the reference methods."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ..errors import D3DError
from .layers import ModelArgs


def load_hf_model(model_dir: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


class HFRuntime(nn.Module):
    """Fallback for architectures without a native runtime: transformers' model with a DynamicCache.

    Same interface as Transformer for causal feeding; custom attention masks are not supported.
    """

    def __init__(self, model_dir: Path, device: str = "cpu"):
        super().__init__()
        self.model = load_hf_model(model_dir, device)
        cfg = self.model.config
        self.args = ModelArgs(vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
                              n_heads=1, n_kv_heads=1, head_dim=1, intermediate_size=1, norm_eps=0.0,
                              rope_theta=0.0, max_seq_len=getattr(cfg, "max_position_embeddings", 4096))
        self.cache = None
        self.cache_len = 0
        self.cache_size = self.args.max_seq_len

    def setup_cache(self, max_batch: int = 1, max_len: int | None = None) -> None:
        from transformers import DynamicCache

        self.cache, self.cache_len = DynamicCache(), 0
        self.cache_size = max_len or self.args.max_seq_len

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.cache_len})")
        if length < self.cache_len:
            self.cache.crop(length - self.cache_len)  # a negative count: drop that many tokens
        self.cache_len = length

    @torch.no_grad()
    def forward(self, tokens, mask=None, positions=None, last_only=False, hidden_layers=None):
        if mask is not None or positions is not None:
            raise D3DError("this target runs on the transformers fallback, which supports causal feeding only")
        out = self.model(tokens, past_key_values=self.cache, use_cache=True,
                         output_hidden_states=hidden_layers is not None,
                         logits_to_keep=1 if last_only else 0)
        self.cache_len += tokens.shape[1]
        if hidden_layers is not None:
            return out.logits, [out.hidden_states[i + 1] for i in hidden_layers]
        return out.logits
