"""Training batches of the D3D objective: packed sequences of clean text and masked blocks.

Each training sequence is [prompt tail + response] (clean, causal) followed by J blocks of B masked
slots. Block j is anchored at a context end c_j inside the response: its slot k sits at position
c_j + 1 + k, predicts token c_j + 1 + k, sees clean tokens 0..c_j and its own block (bidirectional),
never other blocks. The AR loss is next-token cross-entropy on the clean response stream. The LM head
is applied only at positions where a loss is taken.

Token-shift drafters (cfg.shift, d3d.drafters.drafter) feed B - 1 masks per block, at c_j + 1 .. c_j + B - 1:
slot 0 is the clean state at c_j itself (it predicts token c_j + 1, as the AR stream does), the mask at
c_j + k predicts token c_j + 1 + k. Slot k predicts token c_j + 1 + k in both layouts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, fields

import torch
from tqdm import tqdm

from ..corpus.data import Example
from ..drafters.drafter import Drafter


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.01
    ar_weight: float = 0.5          # lambda
    gamma: float = 7.0              # slot k weight exp(-k / gamma)
    blocks_per_seq: int = 12
    max_prompt_tokens: int = 64
    checkpoint_every: int = 25
    seed: int = 0
    layer_drop: float = 0.0         # LayerDrop: skip each stack layer with this probability per step
    freeze_below: int = 0           # stack layers 0..freeze_below-1 stay frozen
    distill: float = 0.0            # weight of the target's soft labels against its greedy tokens (0..1)
    bf16: bool = False              # matrix products in bfloat16 (torch.autocast); weights, AdamW and losses fp32


@dataclass
class Batch:
    tokens: torch.Tensor       # [N, T]
    positions: torch.Tensor    # [N, T]
    mask: torch.Tensor         # [N, 1, T, T]
    ar_index: torch.Tensor     # flat indices into N*T of clean positions with an AR target
    ar_target: torch.Tensor    # draft-vocab ids (-100 = outside the draft vocabulary)
    slot_index: torch.Tensor   # flat indices of mask slots with a target
    slot_target: torch.Tensor
    slot_k: torch.Tensor       # slot number within its block
    slot_block: torch.Tensor   # global block id (for acceptance statistics)
    ctx_len: torch.Tensor      # 0-d: T minus the block slots (the padded clean length)
    ar_source: torch.Tensor    # flat index into N*ctx_len of the clean position whose next token is the AR
    slot_source: torch.Tensor  # (slot) target: where the target's next-token law is read for distillation
    feats: torch.Tensor | None = None  # DFlash: target hidden states [N, ctx_len, taps x dim], if precomputed


def block_layout(lengths: list[int], anchors: list[list[int]], B: int, pad_len: int | None = None):
    """Positions and the attention mask of a packed batch (see module docstring).

    lengths[n]: clean length of row n; anchors[n]: its context ends c_j. Returns (positions [N, T],
    mask [N, T, T] bool, block_of [N, T] with -1 for clean positions, ctx_end [N, T]).
    """
    N = len(lengths)
    Lmax = pad_len or max(lengths)
    J = max(len(a) for a in anchors)
    T = Lmax + J * B
    idx = torch.arange(T)
    block_of = torch.full((N, T), -1, dtype=torch.long)
    ctx_end = idx.repeat(N, 1)
    positions = idx.repeat(N, 1).clone()
    valid = torch.zeros(N, T, dtype=torch.bool)
    for n, (L, cs) in enumerate(zip(lengths, anchors)):
        valid[n, :L] = True
        for j, c in enumerate(cs):
            s = Lmax + j * B
            block_of[n, s:s + B] = j
            ctx_end[n, s:s + B] = c
            positions[n, s:s + B] = torch.arange(c + 1, c + 1 + B)
    is_clean = block_of < 0
    key_clean = (is_clean & valid)[:, None, :] & (idx[None, None, :] <= ctx_end[:, :, None])
    same_block = (block_of[:, :, None] == block_of[:, None, :]) & (block_of[:, :, None] >= 0)
    mask = key_clean | same_block | torch.eye(T, dtype=torch.bool)[None]
    return positions, mask, block_of, ctx_end


def training_sequence(ex: Example, cfg: TrainConfig) -> tuple[list[int], int]:
    """(prompt tail + response, index where the response starts)."""
    prompt = ex.prompt_ids[-cfg.max_prompt_tokens:]
    return prompt + ex.response_ids, len(prompt)


def make_batch(examples: list[Example], cfg: TrainConfig, B: int, vocab_map: torch.Tensor, mask_id: int,
               rng: random.Random, clean_first_slot: bool = False,
               feats: list[torch.Tensor] | None = None, shift: bool = False) -> Batch:
    """A packed batch. With clean_first_slot (DFlash), slot 0 of each block holds the real token at its
    position (the last verified token) and only slots 1..B-1 carry a loss. feats: per-example target
    hidden states of its training sequence (DFlash), padded into the batch. shift: token-shift layout
    (module doc): slot 0 of block j is the clean position c_j, slots 1..B-1 its B - 1 masks."""
    seqs, starts, anchors = [], [], []
    for ex in examples:
        seq, P = training_sequence(ex, cfg)
        L = len(seq)
        choices = list(range(P - 1, L - 1))
        anchors.append(sorted(rng.sample(choices, min(cfg.blocks_per_seq, len(choices)))))
        seqs.append(seq)
        starts.append(P)
    lengths = [len(s) for s in seqs]
    S = B - 1 if shift else B  # masks per block
    positions, mask, block_of, ctx_end = block_layout(lengths, anchors, S)
    N, T = positions.shape
    Lmax = max(lengths)
    tokens = torch.full((N, T), mask_id, dtype=torch.long)
    ar_index, ar_target, slot_index, slot_target, slot_k, slot_block = [], [], [], [], [], []
    ar_source, slot_source = [], []
    for n, seq in enumerate(seqs):
        tokens[n, :len(seq)] = torch.tensor(seq)
        tokens[n, len(seq):Lmax] = 0
        for i in range(starts[n] - 1, len(seq) - 1):
            ar_index.append(n * T + i)
            ar_target.append(seq[i + 1])
            ar_source.append(n * Lmax + i)
        for j, c in enumerate(anchors[n]):
            if clean_first_slot:
                tokens[n, Lmax + j * S] = seq[c + 1]
            for k in range(1 if clean_first_slot else 0, B):
                if c + 1 + k < len(seq):
                    slot_index.append(n * T + (c if shift and k == 0 else Lmax + j * S + k - (1 if shift else 0)))
                    slot_target.append(seq[c + 1 + k])
                    slot_k.append(k)
                    slot_block.append(n * 1000 + j)
                    slot_source.append(n * Lmax + c + k)
    def t(x):
        return torch.tensor(x, dtype=torch.long)

    padded = None
    if feats is not None:
        padded = torch.zeros(N, Lmax, feats[0].shape[-1])
        for n, f in enumerate(feats):
            padded[n, :len(f)] = f.float()
    return Batch(tokens, positions, mask[:, None], t(ar_index), vocab_map[t(ar_target)], t(slot_index),
                 vocab_map[t(slot_target)], t(slot_k), t(slot_block), torch.tensor(Lmax), t(ar_source),
                 t(slot_source), padded)


def batch_to(batch: Batch, device) -> Batch:
    """The batch with every tensor on `device`."""
    return Batch(*[None if getattr(batch, f.name) is None else getattr(batch, f.name).to(device)
                   for f in fields(Batch)])


def draft_vocabulary(examples: list[Example], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), sorted by id. Equal counts
    (tokens the data never shows, when `size` exceeds what it has) go to the lower id: BPE vocabularies
    number their merges from the most frequent in the tokenizer's own corpus."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(torch.tensor(ex.response_ids), minlength=vocab_size)
    counts[torch.tensor(always)] = counts.max() + 1
    ranked = counts * vocab_size + torch.arange(vocab_size - 1, -1, -1)
    return ranked.topk(size).indices.sort().values


def vocab_map_for(model: Drafter) -> torch.Tensor:
    """Full-vocabulary id -> draft-vocabulary index (-100 where the draft head has no row)."""
    m = torch.full((model.args.vocab_size,), -100, dtype=torch.long)
    m[model.draft_ids] = torch.arange(len(model.draft_ids))
    return m


@torch.no_grad()
def target_features(target, examples: list[Example], cfg: TrainConfig, layers: list[int]) -> list[torch.Tensor]:
    """Per example, the target's hidden states after `layers` over its training sequence, concatenated
    [len, layers x dim] in fp16: one target forward per example instead of one per batch it lands in."""
    out = []
    for ex in tqdm(examples, desc="target features", mininterval=2):
        seq, _ = training_sequence(ex, cfg)
        _, taps = target.hidden(torch.tensor([seq], device=target.output.weight.device), hidden_layers=layers)
        out.append(torch.cat(taps, dim=-1)[0].half().cpu())
    return out
