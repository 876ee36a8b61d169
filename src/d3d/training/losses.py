"""The D3D training loss on a packed batch (d3d.training.batches): weighted denoising cross-entropy on the block
slots plus the auxiliary next-token loss, with the teacher-forced acceptance length it implies, and the
held-out evaluation that reports them."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from .batches import Batch, TrainConfig, batch_to, make_batch, vocab_map_for
from ..drafters.kinds import get_kind
from ..corpus.data import Example
from ..drafters.drafter import Drafter
from ..decoding.verify import leading_matches


def acceptance_from_slots(correct: torch.Tensor, slot_k: torch.Tensor, slot_block: torch.Tensor,
                          B: int) -> float:
    """Mean teacher-forced acceptance length (leading correct slots among the first B-1, + 1) over blocks:
    what synchronous decoding would get at these anchors if the target produced exactly this text."""
    taus = []
    for b in slot_block.unique():
        sel = slot_block == b
        ok = correct[sel][slot_k[sel].argsort()][:B - 1].tolist()
        taus.append(leading_matches(ok) + 1)
    return sum(taus) / max(1, len(taus))


def _dflash_hidden(model, batch: Batch, target) -> torch.Tensor:
    """[N, T, dim]: the fused target context on clean positions, the drafter's block states after them."""
    L = int(batch.ctx_len)
    if batch.feats is not None:
        taps = [batch.feats]
    else:
        with torch.no_grad():
            _, taps = target.hidden(batch.tokens[:, :L], hidden_layers=model.cfg.target_layers)
    ctx = model.context(taps)
    h = model.blocks(ctx, batch.positions[:, :L], batch.tokens[:, L:], batch.positions[:, L:], batch.mask[:, :, L:])
    return torch.cat([ctx, h], dim=1)


@torch.no_grad()
def teacher_log_probs(teacher, model: Drafter, batch: Batch) -> torch.Tensor:
    """[N * ctx_len, draft vocab]: the teacher's (the target's) next-token log-probabilities at every clean
    position, over the drafter's draft vocabulary (renormalised there), read by batch.ar_source/slot_source."""
    L = int(batch.ctx_len)
    x, _ = teacher.hidden(batch.tokens[:, :L])
    logits = teacher.norm(x.reshape(-1, x.shape[-1])) @ teacher.output.weight[model.draft_ids].T
    return torch.log_softmax(logits.float(), -1)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, soft: torch.Tensor | None, alpha: float):
    """Per-row CE on the greedy tokens (-100: none), mixed with weight alpha with CE on the soft labels
    `soft` (teacher log-probabilities) where given. In fp32 whatever the logits' precision (bf16 training)."""
    logits = logits.float()
    hard = F.cross_entropy(logits, target.clamp(min=0), reduction="none")
    if soft is None:
        return hard
    kd = -(soft.exp() * torch.log_softmax(logits, -1)).sum(-1)
    return (1 - alpha) * hard + alpha * kd


def losses(model: Drafter, batch: Batch, cfg: TrainConfig, target=None, teacher=None) -> dict[str, torch.Tensor]:
    """Weighted denoising CE on block slots + ar_weight x next-token CE on the clean stream (one forward).
    DFlash drafters (`target` gives their context) weight slot k by exp(-(k-1)/gamma), slot 0 being given.
    With a `teacher` (the target) and cfg.distill > 0, each CE is mixed with the CE on the teacher's own
    next-token law at that position (soft labels carry what the greedy token does not: which other tokens
    the target nearly chose)."""
    reads_target = get_kind(model.cfg.kind).reads_target
    if reads_target:
        h = _dflash_hidden(model, batch, target)
    else:
        h, _ = model.hidden(batch.tokens, mask=batch.mask, positions=batch.positions)
    h = h.reshape(-1, h.shape[-1])
    soft = teacher_log_probs(teacher, model, batch) if teacher is not None and cfg.distill > 0 else None
    out = {}
    if len(batch.slot_index):
        slot_logits = model.head(h[batch.slot_index])
        first = 1 if reads_target else 0
        w = torch.exp(-(batch.slot_k - first).float() / cfg.gamma) * (batch.slot_target >= 0)
        ce = _cross_entropy(slot_logits, batch.slot_target, None if soft is None else soft[batch.slot_source],
                            cfg.distill)
        out["denoise"] = (ce * w).sum() / w.sum().clamp(min=1e-6)
    loss = out.get("denoise", 0.0)
    if cfg.ar_weight > 0:
        keep = (batch.ar_target >= 0).float()
        ce = _cross_entropy(model.head(h[batch.ar_index]), batch.ar_target,
                            None if soft is None else soft[batch.ar_source], cfg.distill)
        out["ar"] = (ce * keep).sum() / keep.sum().clamp(min=1)
        loss = loss + cfg.ar_weight * out["ar"]
    out["loss"] = loss
    if not len(batch.slot_index):
        return out
    with torch.no_grad():
        correct = (slot_logits.argmax(-1) == batch.slot_target)
        out["tau"] = torch.tensor(acceptance_from_slots(correct, batch.slot_k, batch.slot_block,
                                                        model.block_size))
    return out


@torch.no_grad()
def evaluate(model: Drafter, examples: list[Example], cfg: TrainConfig, batches: int = 4,
             target=None) -> dict[str, float]:
    """Held-out losses and teacher-forced acceptance length (fixed anchors, so comparable across runs)."""
    was_training = model.training
    model.eval()
    model.release_cache()
    vmap, tot = vocab_map_for(model), {}
    n = min(batches, max(1, len(examples) // cfg.batch_size))
    for b in range(n):
        batch = make_batch(examples[b * cfg.batch_size:(b + 1) * cfg.batch_size], cfg, model.block_size, vmap,
                           model.mask_id, random.Random(1234 + b), clean_first_slot=get_kind(model.cfg.kind).reads_target,
                           shift=model.cfg.shift)
        for k, v in losses(model, batch_to(batch, model.draft_ids.device), cfg, target).items():
            tot[k] = tot.get(k, 0.0) + float(v) / n
    model.train(was_training)
    return {k: round(v, 4) for k, v in tot.items()}
