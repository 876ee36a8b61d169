"""Low-rank adapters (LoRA, Hu et al. 2021) for converting a whole pretrained model into a drafter on a CPU.

Training every weight of a 0.5B model costs an AdamW state of 6 GB and a checkpoint of 1 GB; training
rank-r factors A [r, in] and B [out, r] beside each frozen linear W (output W x + 2 B A x)
costs a few MB of state and leaves a delta that ships in a few files: the base model's weights install
from the package index and the factors are merged into them at load time (d3d.drafters.files).

B starts at zero, so an adapted model starts exactly as its base.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
SCALE = 2.0  # the factor on B A: alpha / r with alpha = 2 r, the same for every rank


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * SCALE

    def merged(self) -> nn.Linear:
        """The plain linear W + scale B A (same bias), for inference."""
        with torch.no_grad():
            self.base.weight += SCALE * (self.lora_b @ self.lora_a)
        return self.base


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    *outer, name = path.split(".")
    for part in outer:
        root = getattr(root, part)
    return root, name


def add_lora(model: nn.Module, layers: list[int], rank: int) -> None:
    """Wrap the four linears of each stack layer in `layers` with rank-`rank` adapters (in place)."""
    for i in layers:
        for path in LINEARS:
            parent, name = _parent(model.layers[i], path)
            setattr(parent, name, LoRALinear(getattr(parent, name), rank))


def is_factor(key: str) -> bool:
    """Whether a state-dict key or parameter name is an adapter factor, e.g. layers.20.attention.wqkv.lora_a:
    what a LoRA drafter trains and its checkpoint stores."""
    return key.endswith((".lora_a", ".lora_b"))


def merge_factors(state: dict[str, torch.Tensor], factors: dict[str, torch.Tensor]) -> None:
    """Add SCALE * B A to each `<linear>.weight` in `state` for the stored factors (keys as is_factor's)."""
    for key, a in factors.items():
        if key.endswith(".lora_a"):
            stem = key[: -len(".lora_a")]
            w = state[stem + ".weight"]
            state[stem + ".weight"] = w + SCALE * (factors[stem + ".lora_b"].float() @ a.float())
