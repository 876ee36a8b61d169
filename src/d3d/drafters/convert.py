"""Making a drafter from a model's layers: the target's own (drafter_from_target) or another causal LM's
with the target's tokenizer (drafter_from_model, the conversion of a whole pretrained model)."""
from __future__ import annotations

from dataclasses import asdict

import torch

from ..runtime.target import Transformer
from ..runtime.layers import ModelArgs
from .drafter import Drafter, DrafterConfig, tokenizer_fingerprint
from .kinds import D3D, get_kind


def target_info(target_name: str, tokenizer, target_args: ModelArgs) -> dict:
    return {"name": target_name, "vocab_size": target_args.vocab_size, "dim": target_args.dim,
            "tokenizer": tokenizer_fingerprint(tokenizer)}


def drafter_from_target(target: Transformer, tokenizer, target_name: str, layers: list[int], block_size: int = 16,
                        draft_ids: torch.Tensor | None = None, kind: str = D3D.name,
                        target_layers: list[int] | None = None, shift: bool = False) -> Drafter:
    """A drafter whose stack copies the given target layers, with the target's embedding (and head rows).
    A kind that reads the target (d3d.drafters.kinds) also reads the target's hidden states after `target_layers` (fused by a fresh linear layer).
    shift=True makes it a token-shift drafter (see the module doc): with every target layer and the full
    vocabulary, its slot 0 is the target's own next-token prediction."""
    return drafter_from_model(target, tokenizer, target_name, target.args, layers, block_size, draft_ids, kind,
                              target_layers, shift)


def drafter_from_model(model: Transformer, tokenizer, target_name: str, target_args: ModelArgs, layers: list[int],
                       block_size: int = 16, draft_ids: torch.Tensor | None = None, kind: str = D3D.name,
                       target_layers: list[int] | None = None, shift: bool = False,
                       own_embeddings: bool = False) -> Drafter:
    """A drafter initialised from `model`'s layers, final norm, embedding and head (rows `draft_ids`).
    `model` is the target itself, or (own_embeddings=True) another causal LM with the target's tokenizer,
    whose embedding and head the checkpoint then stores."""
    a = model.args
    args = asdict(a) | {"n_layers": len(layers)}
    cfg = DrafterConfig(args=args, block_size=block_size, init_layers=list(layers),
                        draft_vocab_size=0 if draft_ids is None else len(draft_ids),
                        target=target_info(target_name, tokenizer, target_args), kind=kind,
                        target_layers=list(target_layers or []), shift=shift, own_embeddings=own_embeddings)
    d = get_kind(kind).model_class()(cfg)
    sd = model_state(model, layers, torch.arange(a.vocab_size) if draft_ids is None else draft_ids.long())
    sd["mask_embedding"] = model.tok_embeddings.weight.mean(0)
    sd |= {k: v for k, v in d.state_dict().items() if k.startswith(d.extra_prefixes)}
    d.load_state_dict({k: v.detach().clone().float() for k, v in sd.items()}, strict=True)
    return d


def model_state(model: Transformer, layers: list[int], draft_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A drafter's state entries taken from `model`: embedding, final norm, the stack from `layers`, the
    head rows `draft_ids` and the draft ids themselves."""
    sd = {"tok_embeddings.weight": model.tok_embeddings.weight, "norm.weight": model.norm.weight}
    for i, src in enumerate(layers):
        for k, v in model.layers[src].state_dict().items():
            if "cache" not in k:
                sd[f"layers.{i}.{k}"] = v
    sd["output.weight"] = model.output.weight[draft_ids]
    sd["draft_ids"] = draft_ids
    return sd
