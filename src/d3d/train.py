"""Training the D3D drafter: blockwise denoising + auxiliary autoregressive loss, one forward per batch.

Each training sequence is [prompt tail + response] (clean, causal) followed by J blocks of B masked
slots. Block j is anchored at a context end c_j inside the response: its slot k sits at position
c_j + 1 + k, predicts token c_j + 1 + k, sees clean tokens 0..c_j and its own block (bidirectional),
never other blocks. The AR loss is next-token cross-entropy on the clean response stream. The LM head
is applied only at positions where a loss is taken.

Token-shift drafters (cfg.shift, d3d.drafter) feed B - 1 masks per block, at c_j + 1 .. c_j + B - 1:
slot 0 is the clean state at c_j itself (it predicts token c_j + 1, as the AR stream does), the mask at
c_j + k predicts token c_j + 1 + k. Slot k predicts token c_j + 1 + k in both layouts.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .data import Example, atomic_write_json
from .drafter import Drafter, bypassed
from .errors import D3DError


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
    for n, seq in enumerate(seqs):
        tokens[n, :len(seq)] = torch.tensor(seq)
        tokens[n, len(seq):Lmax] = 0
        for i in range(starts[n] - 1, len(seq) - 1):
            ar_index.append(n * T + i)
            ar_target.append(seq[i + 1])
        for j, c in enumerate(anchors[n]):
            if clean_first_slot:
                tokens[n, Lmax + j * S] = seq[c + 1]
            for k in range(1 if clean_first_slot else 0, B):
                if c + 1 + k < len(seq):
                    slot_index.append(n * T + (c if shift and k == 0 else Lmax + j * S + k - (1 if shift else 0)))
                    slot_target.append(seq[c + 1 + k])
                    slot_k.append(k)
                    slot_block.append(n * 1000 + j)
    def t(x):
        return torch.tensor(x, dtype=torch.long)

    padded = None
    if feats is not None:
        padded = torch.zeros(N, Lmax, feats[0].shape[-1])
        for n, f in enumerate(feats):
            padded[n, :len(f)] = f.float()
    return Batch(tokens, positions, mask[:, None], t(ar_index), vocab_map[t(ar_target)], t(slot_index),
                 vocab_map[t(slot_target)], t(slot_k), t(slot_block), torch.tensor(Lmax), padded)


def batch_to(batch: Batch, device) -> Batch:
    """The batch with every tensor on `device`."""
    return Batch(*[None if getattr(batch, f.name) is None else getattr(batch, f.name).to(device)
                   for f in fields(Batch)])


def acceptance_from_slots(correct: torch.Tensor, slot_k: torch.Tensor, slot_block: torch.Tensor,
                          B: int) -> float:
    """Mean teacher-forced acceptance length (leading correct slots among the first B-1, + 1) over blocks:
    what synchronous decoding would get at these anchors if the target produced exactly this text."""
    taus = []
    for b in slot_block.unique():
        sel = slot_block == b
        ok = correct[sel][slot_k[sel].argsort()][:B - 1].tolist()
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        taus.append(n + 1)
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


def losses(model: Drafter, batch: Batch, cfg: TrainConfig, target=None) -> dict[str, torch.Tensor]:
    """Weighted denoising CE on block slots + ar_weight x next-token CE on the clean stream (one forward).
    DFlash drafters (`target` gives their context) weight slot k by exp(-(k-1)/gamma), slot 0 being given."""
    if model.cfg.kind == "dflash":
        h = _dflash_hidden(model, batch, target)
    else:
        h, _ = model.hidden(batch.tokens, mask=batch.mask, positions=batch.positions)
    h = h.reshape(-1, h.shape[-1])
    out = {}
    if len(batch.slot_index):
        slot_logits = model.head(h[batch.slot_index])
        first = 1 if model.cfg.kind == "dflash" else 0
        w = torch.exp(-(batch.slot_k - first).float() / cfg.gamma) * (batch.slot_target >= 0)
        ce = F.cross_entropy(slot_logits, batch.slot_target.clamp(min=0), reduction="none")
        out["denoise"] = (ce * w).sum() / w.sum().clamp(min=1e-6)
    loss = out.get("denoise", 0.0)
    if cfg.ar_weight > 0:
        out["ar"] = F.cross_entropy(model.head(h[batch.ar_index]), batch.ar_target, ignore_index=-100)
        loss = loss + cfg.ar_weight * out["ar"]
    out["loss"] = loss
    if not len(batch.slot_index):
        return out
    with torch.no_grad():
        correct = (slot_logits.argmax(-1) == batch.slot_target)
        out["tau"] = torch.tensor(acceptance_from_slots(correct, batch.slot_k, batch.slot_block,
                                                        model.block_size))
    return out


def draft_vocabulary(examples: list[Example], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), sorted by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(torch.tensor(ex.response_ids), minlength=vocab_size)
    counts[torch.tensor(always)] = counts.max() + 1
    return counts.topk(size).indices.sort().values


def vocab_map_for(model: Drafter) -> torch.Tensor:
    """Full-vocabulary id -> draft-vocabulary index (-100 where the draft head has no row)."""
    m = torch.full((model.args.vocab_size,), -100, dtype=torch.long)
    m[model.draft_ids] = torch.arange(len(model.draft_ids))
    return m


def dropped_layers(n: int, p: float, step: int, seed: int) -> set[int]:
    """LayerDrop (Fan et al., 2019): the stack layers skipped at `step`, each with probability p, never all.
    Training a drafter so makes it robust to losing any one layer, which is what `d3d prune` then exploits.
    The draw depends only on (seed, step), so a resumed run and every accelerate process agree on it."""
    if p <= 0:
        return set()
    rng = random.Random(seed * 7_919 + step)
    drop = {i for i in range(n) if rng.random() < p}
    if len(drop) == n:
        drop.discard(rng.randrange(n))
    return drop


def frozen_layers(model: Drafter, cfg: TrainConfig) -> list[int]:
    """Stack layers that do not train: those below cfg.freeze_below and those shared with the target."""
    return sorted(set(range(min(cfg.freeze_below, len(model.layers)))) | set(model.cfg.from_target))


def trainable_parameters(model: Drafter, cfg: TrainConfig | None = None) -> list[torch.nn.Parameter]:
    """The embedding and the LM head stay the target's (frozen), and so do frozen_layers; the rest of the
    stack, the final norm and the mask embedding train."""
    frozen = ("tok_embeddings", "output") + tuple(f"layers.{i}." for i in frozen_layers(model, cfg or TrainConfig()))
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(frozen))
    return [p for p in model.parameters() if p.requires_grad]


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _save_state(path: Path, model: Drafter, opt, step: int, history: list) -> None:
    """Weights that train (and buffers) + AdamW state: frozen weights are rebuilt on resume."""
    kept = {n for n, p in model.named_parameters() if p.requires_grad} | {n for n, _ in model.named_buffers()}
    state = {"model": {k: v for k, v in model.state_dict().items() if k in kept},
             "opt": opt.state_dict(), "step": step, "history": history}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(model: Drafter, examples: list[Example], cfg: TrainConfig, run_dir: Path, log=print,
          target=None, feats: list[torch.Tensor] | None = None) -> list[dict]:
    """Train in place; resumes from run_dir/state.pt if present. Returns the per-step history.

    Works single-process on CPU, and under `accelerate launch` (each process takes its own batches and
    gradients are averaged across processes before each step). DFlash drafters read the frozen `target`'s
    hidden states: precomputed per example in `feats` (target_features), else computed per batch.
    """
    from accelerate import Accelerator

    acc = Accelerator(cpu=not torch.cuda.is_available())
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / "state.pt"
    core = model.to(acc.device)
    core.release_cache()
    params = trainable_parameters(core, cfg)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, history = 0, []
    if state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        log(f"resumed from {state_path} at step {step}")
    model.train()
    if target is not None:
        target.to(acc.device)
    vmap = vocab_map_for(core)
    order = list(range(len(examples)))
    random.Random(cfg.seed).shuffle(order)
    per_step = cfg.batch_size * acc.num_processes
    bar = tqdm(total=cfg.steps, initial=step, desc="train", disable=not acc.is_main_process, mininterval=2)
    while step < cfg.steps:
        t0 = time.time()
        start = (step * per_step + acc.process_index * cfg.batch_size) % len(order)
        idx = [order[(start + i) % len(order)] for i in range(cfg.batch_size)]
        batch = make_batch([examples[i] for i in idx], cfg, core.block_size, vmap, core.mask_id,
                           random.Random(cfg.seed * 1_000_003 + step * 97 + acc.process_index),
                           clean_first_slot=core.cfg.kind == "dflash",
                           feats=None if feats is None else [feats[i] for i in idx], shift=core.cfg.shift)
        batch = batch_to(batch, acc.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        drop = dropped_layers(len(core.layers), cfg.layer_drop, step, cfg.seed)
        with bypassed(core, drop):
            out = losses(core, batch, cfg, target)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        if acc.num_processes > 1:
            for p in params:
                if p.grad is not None:
                    p.grad = acc.reduce(p.grad, reduction="mean")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ntok = batch.tokens.numel()
        rec = {"step": step, **{k: round(float(v.detach()), 4) for k, v in out.items()}, "lr": lr_at(step - 1, cfg),
               "tok_s": round(ntok / (time.time() - t0), 1)}
        if cfg.layer_drop > 0:
            rec["dropped"] = sorted(drop)
        history.append(rec)
        bar.set_postfix(loss=rec["loss"], tau=rec.get("tau"), tok_s=rec["tok_s"])
        bar.update(1)
        if acc.is_main_process and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
            _save_state(state_path, core, opt, step, history)
            atomic_write_json(run_dir / "history.json", history)
            log(f"step {step}: " + " ".join(f"{k}={v}" for k, v in rec.items() if k != "step"))
    bar.close()
    model.eval()
    return history


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
                           model.mask_id, random.Random(1234 + b), clean_first_slot=model.cfg.kind == "dflash",
                           shift=model.cfg.shift)
        for k, v in losses(model, batch_to(batch, model.draft_ids.device), cfg, target).items():
            tot[k] = tot.get(k, 0.0) + float(v) / n
    model.train(was_training)
    return {k: round(v, 4) for k, v in tot.items()}


INIT_TARGET = "target"  # --init-model value meaning the target itself


def init_model_drafter(target, tokenizer, target_name: str, target_dir: Path, init_model: str,
                       layers: list[int] | None, block_size: int, draft_ids: torch.Tensor | None,
                       freeze_below: int = 0) -> Drafter:
    """A token-shift D3D drafter converted from a whole pretrained causal LM (`init_model`: "target", a
    HF folder or a .gguf with the target's tokenizer), keeping `layers` of it (None: all). Made from the
    target's own weights, the frozen layers below `freeze_below` are recorded as shared with the target
    (cfg.from_target), so the checkpoint stores only what training changes (a delta checkpoint)."""
    from .drafter import drafter_from_model, tokenizer_fingerprint
    from .checkpoints import resolve_target
    from .target import load_target

    model_dir = target_dir if init_model == INIT_TARGET else resolve_target(init_model)
    same = Path(model_dir).resolve() == Path(target_dir).resolve()
    model, tok = (target, tokenizer) if same else load_target(str(model_dir))[:2]
    if not same and (tokenizer_fingerprint(tok) != tokenizer_fingerprint(tokenizer)
                     or model.args.vocab_size != target.args.vocab_size):
        raise D3DError(f"--init-model {init_model} does not share the target's tokenizer and vocabulary")
    layers = list(range(model.args.n_layers)) if layers is None else layers
    if not layers or not all(0 <= i < model.args.n_layers for i in layers):
        raise D3DError(f"--layers must lie in 0..{model.args.n_layers - 1} of the --init-model (got {layers})")
    d = drafter_from_model(model, tokenizer, target_name, target.args, layers, block_size, draft_ids,
                           shift=True, own_embeddings=not same)
    if same:
        d.cfg.from_target = list(range(min(freeze_below, len(layers))))
    return d


def train_drafter(target: str | None, data: Path, out: Path, run_dir: Path, layers: list[int] | None,
                  draft_vocab: int, block_size: int, cfg: TrainConfig, heldout: int = 64, command: str = "",
                  max_shards: int | None = None, kind: str = "d3d", target_layers: list[int] | None = None,
                  init: Path | None = None, init_model: str | None = None, max_file_mb: float | None = None) -> dict:
    """`d3d train`: build a drafter from the target's layers (or start from the drafter `init`, whose
    architecture then wins over layers / draft_vocab / block_size), train it on the distillation data,
    save it.

    kind "ar" trains a causal drafter (next-token loss only); "dflash" one conditioned on the target's
    hidden states after `target_layers` (the target stays loaded, frozen, to produce them).
    init_model: convert a whole pretrained causal LM (see init_model_drafter; layers None = all of it)."""
    from .data import load_dataset
    from .drafter import drafter_from_target, load_drafter, save_drafter
    from .checkpoints import DEFAULT_TARGET
    from .target import load_target

    model, tok, model_dir = load_target(target)
    examples = load_dataset(data, max_shards)
    train_set, held = examples[:-heldout], examples[-heldout:]
    if init is not None:
        drafter = load_drafter(init, model, tok).requires_grad_(True)
        if drafter.cfg.kind != kind:
            raise D3DError(f"--init {init} is a {drafter.cfg.kind!r} drafter, not {kind!r} (see --kind)")
        drafter.cfg.from_target = [i for i in drafter.cfg.from_target if i < cfg.freeze_below]
    else:
        draft_ids = draft_vocabulary(train_set, draft_vocab, model.args.vocab_size, [tok.eos_token_id]) \
            if draft_vocab else None
        if init_model is not None:
            drafter = init_model_drafter(model, tok, target or DEFAULT_TARGET, model_dir, init_model, layers,
                                         block_size, draft_ids, cfg.freeze_below)
        else:
            drafter = drafter_from_target(model, tok, target or DEFAULT_TARGET, layers, block_size, draft_ids,
                                          kind=kind, target_layers=target_layers)
    feature_target = model.requires_grad_(False) if kind == "dflash" else None
    feats = target_features(feature_target, train_set, cfg, drafter.cfg.target_layers) if kind == "dflash" else None
    del model
    before = evaluate(drafter, held, cfg, target=feature_target)
    history = train(drafter, train_set, cfg, run_dir, target=feature_target, feats=feats)
    after = evaluate(drafter, held, cfg, target=feature_target)
    drafter.cfg.training = {"command": command, "init": str(init) if init else None, "init_model": init_model,
                            "init_training": drafter.cfg.training if init else None,
                            "data": str(data), "examples": len(train_set), "heldout": heldout,
                            "data_response_tokens": sum(len(ex.response_ids) for ex in examples),
                            "config": cfg.__dict__, "steps_done": len(history), "heldout_before": before,
                            "heldout_after": after}
    save_drafter(drafter, out, max_file_mb=max_file_mb)
    atomic_write_json(run_dir / "summary.json", drafter.cfg.training)
    return drafter.cfg.training
