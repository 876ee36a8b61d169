"""Training the D3D drafter: the loop (AdamW, warmup + cosine, LayerDrop, frozen layers, resumable,
accelerate-ready, optionally bfloat16 products) and `d3d train` (build or load a drafter, train it on
distillation data, save it). The batches and the objective are d3d.training.batches and d3d.training.losses.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..drafters.kinds import D3D, get_kind
from ..atomic import atomic_path
from .batches import TrainConfig, batch_to, draft_vocabulary, make_batch, target_features, vocab_map_for
from ..corpus.data import Example
from ..atomic import atomic_write_json
from ..drafters.drafter import Drafter, bypassed
from ..errors import D3DError
from ..drafters.lora import is_factor
from .losses import evaluate, losses


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
    stack, the final norm and the mask embedding train. A LoRA drafter trains its adapters and mask
    embedding only."""
    if model.cfg.lora_rank:
        for n, p in model.named_parameters():
            p.requires_grad_(is_factor(n) or n == "mask_embedding")
        return [p for p in model.parameters() if p.requires_grad]
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
    """Weights that train (and buffers) + AdamW state: frozen weights are rebuilt on resume. Written
    atomically and durably (d3d.atomic.atomic_path), so a resume finds the last state whole."""
    kept = {n for n, p in model.named_parameters() if p.requires_grad} | {n for n, _ in model.named_buffers()}
    state = {"model": {k: v for k, v in model.state_dict().items() if k in kept},
             "opt": opt.state_dict(), "step": step, "history": history}
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def _load_state(path: Path) -> dict:
    """A run folder's state.pt: tensors, numbers and lists only, so a crafted pickle cannot run code here."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise D3DError(f"cannot resume from {path} ({type(e).__name__}); delete it to start over") from e


def train(model: Drafter, examples: list[Example], cfg: TrainConfig, run_dir: Path, log=print,
          target=None, feats: list[torch.Tensor] | None = None, teacher=None) -> list[dict]:
    """Train in place; resumes from run_dir/state.pt if present. Returns the per-step history.

    Works single-process, under `torchrun` on CPUs (gloo) and under `accelerate launch` (each process takes
    its own batches and gradients are averaged across processes before each step). DFlash drafters read the frozen `target`'s
    hidden states: precomputed per example in `feats` (target_features), else computed per batch. With
    cfg.distill > 0 the frozen `teacher` (the target) gives soft labels, computed per batch (d3d.training.losses).
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
        state = _load_state(state_path)
        saved_ids = state["model"].get("draft_ids")
        if saved_ids is not None and not torch.equal(saved_ids, model.draft_ids.cpu()):
            raise D3DError(f"{state_path} was trained with another draft vocabulary than this drafter's")
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        log(f"resumed from {state_path} at step {step}")
    model.train()
    for frozen in (target, teacher):
        if frozen is not None:
            frozen.to(acc.device)
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
                           clean_first_slot=get_kind(core.cfg.kind).reads_target,
                           feats=None if feats is None else [feats[i] for i in idx], shift=core.cfg.shift)
        batch = batch_to(batch, acc.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        drop = dropped_layers(len(core.layers), cfg.layer_drop, step, cfg.seed)
        with bypassed(core, drop), torch.autocast(acc.device.type, torch.bfloat16, enabled=cfg.bf16):
            out = losses(core, batch, cfg, target, teacher)
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
               "tok_s": round(ntok / (time.time() - t0), 1), "examples": step * per_step}
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


INIT_TARGET = "target"  # --init-model value meaning the target itself


def init_model_drafter(target, tokenizer, target_name: str, target_dir: Path, init_model: str,
                       layers: list[int] | None, block_size: int, draft_ids: torch.Tensor | None,
                       freeze_below: int = 0, lora_rank: int = 0) -> Drafter:
    """A token-shift D3D drafter converted from a whole pretrained causal LM (`init_model`: "target", a
    HF folder or a .gguf with the target's tokenizer), keeping `layers` of it (None: all). Made from the
    target's own weights, the frozen layers below `freeze_below` are recorded as shared with the target
    (cfg.from_target), so the checkpoint stores only what training changes (a delta checkpoint).
    lora_rank > 0: the stack layers from `freeze_below` up train as rank-`lora_rank` adapters (d3d.drafters.lora)
    and the checkpoint stores only those and the mask embedding over `init_model`'s own weights."""
    from ..runtime.checkpoints import resolve_target
    from ..drafters.convert import drafter_from_model
    from ..drafters.drafter import tokenizer_fingerprint
    from ..runtime.loading import load_target

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
    if lora_rank:
        from ..drafters.lora import add_lora

        if init_model == INIT_TARGET:
            raise D3DError("--lora-rank needs --init-model NAME|PATH: its adapters are stored over that model")
        d.cfg.lora_rank, d.cfg.base_model = lora_rank, init_model
        add_lora(d, list(range(min(freeze_below, len(layers)), len(layers))), lora_rank)
    elif same:
        d.cfg.from_target = list(range(min(freeze_below, len(layers))))
    return d


def stored_weights(folder: Path) -> dict[str, torch.Tensor]:
    """What a drafter's weight files hold, as stored (a LoRA drafter: its factors, mask embedding and draft ids)."""
    from ..drafters.files import read_safetensors, weight_files

    return {k: v for f in weight_files(folder) for k, v in read_safetensors(f).items()}


def adapted_layers(stored: dict[str, torch.Tensor]) -> list[int]:
    """The stack layers whose adapters a LoRA drafter's stored weights (stored_weights) hold."""
    return sorted({int(k.split(".")[1]) for k in stored if is_factor(k)})


def continued_lora_drafter(init: Path, target, tokenizer, target_name: str, target_dir: Path, freeze_below: int,
                           lora_rank: int = 0) -> Drafter:
    """The LoRA drafter `init` set up to train further from its files alone (its run folder and optimizer state
    may be on another machine): its base model converted again, with adapters of rank max(lora_rank, its own) on
    the stack layers from `freeze_below` up (at most its lowest adapted layer), its stored factors in their first
    ranks (the other ranks start with B = 0, so it starts exactly as saved), its mask embedding and draft
    vocabulary kept."""
    from ..drafters.files import read_drafter_config

    cfg = read_drafter_config(init)
    stored = stored_weights(init)
    lowest = adapted_layers(stored)[0]
    if freeze_below > lowest:
        raise D3DError(f"--freeze-below {freeze_below} would drop the trained adapters of layers {lowest}.."
                       f"{freeze_below - 1} of {init}")
    d = init_model_drafter(target, tokenizer, target_name, target_dir, cfg.base_model, cfg.init_layers, cfg.block_size,
                           stored["draft_ids"], freeze_below, max(lora_rank, cfg.lora_rank))
    params = dict(d.named_parameters())
    with torch.no_grad():
        for key, value in stored.items():
            if key.endswith(".lora_a"):
                params[key][:value.shape[0]] = value.float()
            elif key.endswith(".lora_b"):
                params[key][:, :value.shape[1]] = value.float()
        params["mask_embedding"].copy_(stored["mask_embedding"].float())
    d.cfg.training = cfg.training
    return d


def target_shape(target: str | None):
    """(weightless model, tokenizer, model_dir) of a target: its shape on the meta device, all that
    converting another model into its drafter needs (the target's weights never load)."""
    from ..runtime.checkpoints import read_hf_config, resolve_target
    from ..runtime.loading import load_tokenizer
    from ..runtime.target import Transformer
    from ..runtime.layers import ModelArgs

    model_dir = resolve_target(target)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf_config(read_hf_config(model_dir)))
    return model, load_tokenizer(model_dir), model_dir


def resumed_draft_ids(run_dir: Path) -> torch.Tensor | None:
    """The draft vocabulary of the run being resumed in run_dir, if any. It must not be recomputed:
    the vocabulary is the most frequent tokens of the training data, so data added before a resume would
    pick other head rows than the ones the saved adapters and mask embedding were trained with."""
    state_path = run_dir / "state.pt"
    if not state_path.exists():
        return None
    return _load_state(state_path)["model"].get("draft_ids")


def train_drafter(target: str | None, data: Path, out: Path, run_dir: Path, layers: list[int] | None,
                  draft_vocab: int, block_size: int, cfg: TrainConfig, heldout: int = 64, command: str = "",
                  max_shards: int | None = None, kind: str = D3D.name, target_layers: list[int] | None = None,
                  init: Path | None = None, init_model: str | None = None, max_file_mb: float | None = None,
                  extra_data: list[Path] = (), lora_rank: int = 0) -> dict:
    """`d3d train`: build a drafter from the target's layers (or start from the drafter `init`, whose
    architecture then wins over layers / draft_vocab / block_size), train it on the distillation data,
    save it.

    kind: a drafter kind's name (d3d.drafters.kinds); one that reads the target is conditioned on its hidden
    states after `target_layers` (the target stays loaded, frozen, to produce them).
    init_model: convert a whole pretrained causal LM (see init_model_drafter; layers None = all of it).
    extra_data: datasets whose every example joins the training set; the held-out examples stay the last
    `heldout` of `data`, so runs with and without extra data compare."""
    from ..runtime.checkpoints import DEFAULT_TARGET, resolve_target
    from ..corpus.data import load_dataset
    from ..drafters.convert import drafter_from_target
    from ..drafters.files import load_drafter, read_drafter_config, save_drafter
    from ..runtime.loading import load_target

    init_cfg = read_drafter_config(init) if init is not None else None
    lora_init = init_cfg is not None and init_cfg.lora_rank > 0
    base = init_cfg.base_model if lora_init else init_model
    converting_other = (init is None or lora_init) and base not in (None, INIT_TARGET) and get_kind(kind).converts \
        and not cfg.distill and resolve_target(base).resolve() != resolve_target(target).resolve()
    model, tok, model_dir = target_shape(target) if converting_other else load_target(target)
    getattr(model, "drop_cpu_layers", lambda: None)()  # training runs on the PyTorch layers
    examples = load_dataset(data, max_shards)
    if len(examples) <= heldout:
        raise D3DError(f"{data} holds {len(examples)} examples: more than the {heldout} held out are needed")
    train_set, held = examples[:-heldout], examples[-heldout:]
    extra = [e for x in extra_data for e in load_dataset(x)]
    train_set += extra
    if lora_init:
        drafter = continued_lora_drafter(init, model, tok, target or DEFAULT_TARGET, model_dir, cfg.freeze_below,
                                         lora_rank)
    elif init is not None:
        drafter = load_drafter(init, model, tok).requires_grad_(True)
        if drafter.cfg.kind != kind:
            raise D3DError(f"--init {init} is a {drafter.cfg.kind!r} drafter, not {kind!r} (see --kind)")
        drafter.cfg.from_target = [i for i in drafter.cfg.from_target if i < cfg.freeze_below]
    else:
        draft_ids = resumed_draft_ids(run_dir) if draft_vocab else None
        if draft_ids is not None and len(draft_ids) != draft_vocab:
            raise D3DError(f"{run_dir} resumes a run with a {len(draft_ids)}-token draft vocabulary, not {draft_vocab}")
        if draft_ids is None and draft_vocab:
            draft_ids = draft_vocabulary(train_set, draft_vocab, model.args.vocab_size, [tok.eos_token_id])
        if init_model is not None:
            drafter = init_model_drafter(model, tok, target or DEFAULT_TARGET, model_dir, init_model, layers,
                                         block_size, draft_ids, cfg.freeze_below, lora_rank)
        else:
            drafter = drafter_from_target(model, tok, target or DEFAULT_TARGET, layers, block_size, draft_ids,
                                          kind=kind, target_layers=target_layers)
    reads_target = get_kind(kind).reads_target
    feature_target = model.requires_grad_(False) if reads_target else None
    feats = target_features(feature_target, train_set, cfg, drafter.cfg.target_layers) if reads_target else None
    teacher = model.requires_grad_(False) if cfg.distill > 0 else None
    del model
    before = evaluate(drafter, held, cfg, target=feature_target)
    history = train(drafter, train_set, cfg, run_dir, target=feature_target, feats=feats, teacher=teacher)
    after = evaluate(drafter, held, cfg, target=feature_target)
    drafter.cfg.training = {"command": command, "init": str(init) if init else None, "init_model": init_model,
                            "init_training": drafter.cfg.training if init else None,
                            "data": str(data), "extra_data": [str(x) for x in extra_data],
                            "examples": len(train_set), "heldout": heldout,
                            "data_response_tokens": sum(len(ex.response_ids) for ex in examples + extra),
                            "config": cfg.__dict__, "steps_done": len(history), "heldout_before": before,
                            "heldout_after": after}
    from accelerate import PartialState

    if PartialState().is_main_process:  # one writer: every process holds the same averaged weights
        save_drafter(drafter, out, max_file_mb=max_file_mb)
        atomic_write_json(run_dir / "summary.json", drafter.cfg.training)
    return drafter.cfg.training
