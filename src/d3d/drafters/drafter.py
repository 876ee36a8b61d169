"""The D3D drafter: a standalone block-diffusion model that sees only token ids (its checkpoints:
d3d.drafters.files; its proposer and the `d3d` method: d3d.methods.d3d).

It is a small Llama-style stack (the target runtime's own layers) with the target's frozen embedding,
a learned mask embedding, and an LM head over an optional reduced draft vocabulary. It keeps a KV cache
of the verified text (causal) and drafts a block of B masked slots in one forward pass: slot k sits at
position c + 1 + k, where c is the last clean position, sees the whole clean context and the other
slots (bidirectionally). Slot 0 is the token right after the context. In synchronous D3D the context
ends with the target's bonus token and slots 0..B-2 are the draft; in asynchronous D3D the context
ends at the last accepted draft token, slot 0 lands on the bonus position and is replaced by the bonus.
Training (d3d.training.batches) uses exactly this layout.

Token shift (cfg.shift, for drafters converted from a whole pretrained causal LM, as in Fast-dLLM v2):
the hidden state at position p predicts token p + 1, so the pretrained LM head keeps its meaning. The
block after a context ending at c is [clean token c, MASK x (B-1)]: slot 0 is the clean, causal state
at c (exactly the pretrained model's next-token prediction) and the mask at c + k (k >= 1) predicts
token c + 1 + k. Slot k still predicts token c + 1 + k, so every caller indexes slots the same way.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import D3DError
from .kinds import D3D
from ..runtime.target import Transformer
from ..runtime.layers import ModelArgs


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps(vocab).encode()).hexdigest()[:16]


@dataclass
class DrafterConfig:
    args: dict                    # ModelArgs fields of the drafter stack (width = target width)
    block_size: int = 16
    init_layers: list[int] = field(default_factory=list)   # target layers the stack was initialised from
    draft_vocab_size: int = 0     # 0 = the full target vocabulary
    target: dict = field(default_factory=dict)             # name, vocab_size, tokenizer fingerprint
    training: dict = field(default_factory=dict)           # what produced the weights (data, steps, loss)
    kind: str = D3D.name          # its DrafterKind (d3d.drafters.kinds)
    target_layers: list[int] = field(default_factory=list)  # dflash: target layers whose states it reads
    shift: bool = False           # token shift: slot 0 is the clean last token's causal state (see module doc)
    from_target: list[int] = field(default_factory=list)    # stack layers equal to target layer init_layers[i]:
    #                               frozen in training, not stored, shared with the target at load time
    own_embeddings: bool = False  # embedding and LM head stored (initialised from another model than the target)
    lora_rank: int = 0            # > 0: trained as low-rank adapters (d3d.drafters.lora) over base_model's weights
    base_model: str = ""          # with lora_rank: "target" or the known name / path of the model whose stack
    #                               (init_layers), norm, embedding and head rows the checkpoint does not store

    @property
    def model_args(self) -> ModelArgs:
        return ModelArgs(**self.args)


class Drafter(Transformer):
    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg.model_args)
        self.cfg = cfg
        a = cfg.model_args
        self.mask_embedding = nn.Parameter(torch.zeros(a.dim))
        self.mask_id = a.vocab_size  # a token id outside the vocabulary marks a masked slot
        V = cfg.draft_vocab_size or a.vocab_size
        self.output = nn.Linear(a.dim, V, bias=False)
        self.register_buffer("draft_ids", torch.arange(V), persistent=True)
        self.cached_tokens: list[int] = []

    extra_prefixes: tuple[str, ...] = ()  # parameters a subclass adds (initialised fresh, not from the target)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        is_mask = tokens == self.mask_id
        x = self.tok_embeddings(tokens.masked_fill(is_mask, 0))
        return torch.where(is_mask[..., None], self.mask_embedding.to(x.dtype), x)

    def release_cache(self) -> None:
        """Drop the KV cache: whole sequences (training, evaluation) then run without one."""
        for layer in self.layers:
            layer.attention.k_cache = layer.attention.v_cache = None
        self.kv_cache, self.cache_views = None, []
        self.cache_len = self.max_batch = self.cache_size = 0
        self.cached_tokens = []

    # ---- inference with a KV cache of the verified text

    def sync_context(self, tokens: list[int]) -> list[int]:
        """Roll the cache back to the longest common prefix with `tokens`; return the tokens still to feed."""
        n = 0
        limit = min(len(self.cached_tokens), len(tokens))
        while n < limit and self.cached_tokens[n] == tokens[n]:
            n += 1
        self.rollback(n)
        del self.cached_tokens[n:]
        return tokens[n:]

    @torch.no_grad()
    def extend(self, tokens: list[int]) -> None:
        """Make the cache hold `tokens` (clean, causal, no LM head): the drafter's share of the prefill,
        so that the rounds after it feed only the newly verified tokens."""
        new = self.sync_context(tokens)
        if new:
            self.hidden(torch.tensor([new], device=self.draft_ids.device))
            self.cached_tokens += new

    def mask_slots(self, slots: int | None = None) -> int:
        """Mask tokens fed for a block of `slots` slots (None: the whole block): as many, or one fewer with
        token shift (slot 0 is then the last clean token's own state)."""
        slots = self.block_size if slots is None else slots
        return slots - 1 if self.cfg.shift else slots

    def draft_logits(self, tokens: list[int], k: int) -> torch.Tensor:
        """Draft-vocabulary logits [k, V_draft] of k drafts after `tokens`: the first k slots of a pass of k + 1
        (the whole block at k = B - 1). Fewer slots cost less and keep the first slots' acceptance, so a draft cut
        short (d3d.decoding.budget) is drafted short."""
        return self.draft_block(tokens, min(k + 1, self.block_size))[:k]

    @torch.no_grad()
    def draft_block(self, tokens: list[int], slots: int | None = None) -> torch.Tensor:
        """Make the cache hold `tokens` (the verified text) and draft the B slots after it in the same
        forward pass. Returns draft-vocabulary logits [B, V_draft] (slot k predicts the token k + 1 after
        the last of `tokens`); the cache keeps only `tokens`.

        slots: draft only the first `slots` slots (1..B) by feeding fewer masks. The pass costs about
        proportionally less, and since acceptance lives in the first few slots it loses little: the
        shipped drafters keep their tau with 6 slots of 16 (results/NOTEBOOK.md)."""
        slots = self.block_size if slots is None else slots
        if not 1 <= slots <= self.block_size:
            raise D3DError(f"slots must be in 1..{self.block_size} (got {slots})")
        new = self.sync_context(tokens)
        if self.cfg.shift and not new:  # slot 0 is the last token's state: feed it again
            new = self.sync_context(tokens[:-1]) + tokens[-1:]
        n, L, B = len(new), self.cache_len, self.mask_slots(slots)
        device = self.draft_ids.device
        feed = torch.tensor([new + [self.mask_id] * B], device=device)
        positions = torch.cat([torch.arange(L, L + n), torch.arange(L + n, L + n + B)]).to(device)
        mask = torch.ones(n + B, L + n + B, dtype=torch.bool, device=device)
        mask[:n, L:] = torch.ones(n, n + B, dtype=torch.bool, device=device).tril()
        logits = self(feed, mask=mask, positions=positions, logits_to_keep=slots)[0]
        self.cache_len = L + n
        self.cached_tokens += new
        return logits


@contextmanager
def bypassed(drafter: Drafter, drop: set[int] | list[int]):
    """Run `drafter` with the stack layers `drop` skipped (the residual stream passes through them).
    Used by pruning (trial removals) and by layer-drop training (d3d.training.train). Where the drafter runs on
    packed CPU layers (Transformer.pack_cpu_layers) the trial runs on the same packed layers less the dropped ones,
    as the pruned drafter will (on the PyTorch layers a trial of the pair's 24-layer drafter took several times as
    long, and its sums differed from the starting tau's)."""
    drop = set(drop)
    layers, packed = drafter.layers, (drafter.cpu_layers, drafter.cpu_params, drafter.cpu_layers_of)
    drafter.layers = nn.ModuleList(layer for i, layer in enumerate(layers) if i not in drop)
    if packed[0] is not None and packed[2]() is layers:
        drafter.use_cpu_layers([p for i, p in enumerate(packed[0]) if i not in drop])
    try:
        yield drafter
    finally:
        drafter.layers = layers
        drafter.cpu_layers, drafter.cpu_params, drafter.cpu_layers_of = packed
