"""Drafter checkpoints: a folder with drafter.json (the DrafterConfig) and drafter.safetensors (or shards),
fp16, holding only what the target cannot supply: the embedding and LM head rows and the stack layers
shared with the target (cfg.from_target, a delta checkpoint) are taken from the target at load time; a
LoRA drafter's weights are its base model's (installed by name) plus its stored low-rank factors.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..atomic import atomic_folder
from ..runtime.checkpoints import read_safetensors
from .convert import model_state
from .drafter import Drafter, DrafterConfig, tokenizer_fingerprint
from .kinds import get_kind
from ..errors import D3DError, first_line
from ..runtime.fastpath import pack_linears
from .lora import is_factor, merge_factors
from ..runtime.quantize import apply_quantize
from ..runtime.target import Transformer
from ..runtime.layers import rope_frequencies

CONFIG_NAME = "drafter.json"
WEIGHTS_NAME = "drafter.safetensors"


def weights_fingerprint(checkpoint: str | Path) -> str:
    """First 16 hex digits of the sha256 of a drafter's weights (its weight files in order), or of a draft
    model's (a known name, HF folder or .gguf, as converted into the cache): which checkpoint a result came from."""
    files = weight_files(checkpoint) if Path(checkpoint).is_dir() else []
    if not files:
        from ..runtime.checkpoints import resolve_target

        files = sorted(resolve_target(str(checkpoint)).glob("*.safetensors"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _layer_prefixes(indices: list[int]) -> tuple[str, ...]:
    return tuple(f"layers.{i}." for i in indices)


def _trainable_state(d: Drafter) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: everything but what is rebuilt from the target at load time: the
    embedding and the LM head rows (unless cfg.own_embeddings) and the stack layers in cfg.from_target
    (a delta checkpoint: a drafter made from the whole target stores only what training changed). A LoRA
    drafter (cfg.lora_rank) stores its adapters' factors, mask embedding and draft ids: the rest is its
    base model's, which installs by name."""
    if d.cfg.lora_rank:
        return {k: v for k, v in d.state_dict().items()
                if is_factor(k) or k in ("mask_embedding", "draft_ids")}
    borrowed = () if d.cfg.own_embeddings else ("tok_embeddings.weight", "output.weight")
    shared = _layer_prefixes(d.cfg.from_target)
    return {k: v for k, v in d.state_dict().items() if k not in borrowed and not k.startswith(shared)}


def weight_files(folder: str | Path) -> list[Path]:
    """A drafter's weight files: drafter.safetensors, or its shards drafter-00001-of-0000N.safetensors."""
    folder = Path(folder)
    if (folder / WEIGHTS_NAME).exists():
        return [folder / WEIGHTS_NAME]
    return sorted(folder.glob("drafter-*-of-*.safetensors"))


def _shards(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Split a state dict into consecutive groups of files of at most max_bytes each (counting each
    tensor's safetensors header entry too); a tensor that cannot fit a file alone is an error."""
    if max_bytes is None:
        return [state]
    out, size = [{}], 8
    for k, v in state.items():
        n = v.numel() * v.element_size() + len(k) + 128
        if n + 8 > max_bytes:
            raise D3DError(f"{k} ({n / 2**20:.1f} MB) does not fit in a weight file of {max_bytes / 2**20:.1f} MB")
        if out[-1] and size + n > max_bytes:
            out.append({})
            size = 8
        out[-1][k] = v
        size += n
    return out


def save_drafter(d: Drafter, folder: Path, dtype: torch.dtype = torch.float16,
                 max_file_mb: float | None = None) -> None:
    """Write drafter.safetensors + drafter.json into `folder`, atomically and durably: the files are written
    in a temp folder beside it that then takes its place (d3d.atomic.atomic_folder), so `folder` holds the
    old drafter or the new one, whole, at every moment (where the file system can swap two folders in one
    rename: see d3d.atomic.replace_folder), and an interruption leaves no temp folder.
    max_file_mb: split the weights into files of at most that size (drafter-00001-of-0000N.safetensors)."""
    from safetensors.torch import save_file

    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in _trainable_state(d).items()}
    shards = _shards(state, None if max_file_mb is None else int(max_file_mb * 2**20))
    with atomic_folder(Path(folder)) as tmp:
        for i, part in enumerate(shards):
            name = WEIGHTS_NAME if len(shards) == 1 else f"drafter-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, tmp / name)
        (tmp / CONFIG_NAME).write_text(json.dumps(asdict(d.cfg), indent=1) + "\n")


def _share_target_layers(d: Drafter, target: Transformer) -> dict[str, torch.Tensor]:
    """Give the stack layers in cfg.from_target the target's own modules (weights shared, no copy; an
    int8 target's packed layers too); each layer keeps its own attention module and so its own KV cache.
    Returns their state entries, so the rest of the state can be loaded strictly."""
    for i in d.cfg.from_target:
        if not 0 <= i < len(d.layers) or not 0 <= d.cfg.init_layers[i] < len(target.layers):
            raise D3DError(f"delta drafter: stack layer {i} has no target layer to come from")
        mine, src = d.layers[i], target.layers[d.cfg.init_layers[i]]
        for name in ("wqkv", "wo", "q_norm", "k_norm"):
            setattr(mine.attention, name, getattr(src.attention, name))
        mine.feed_forward = src.feed_forward
        mine.attention_norm, mine.ffn_norm = src.attention_norm, src.ffn_norm
    return {k: v for k, v in d.state_dict().items() if k.startswith(_layer_prefixes(d.cfg.from_target))}


def _merged_over_base(cfg: DrafterConfig, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA drafter's full state: its base model's weights (cfg.base_model, loaded in fp32 from the d3d
    cache, installed by name on first use) with the stored factors merged in."""
    from ..runtime.checkpoints import resolve_target
    from ..runtime.loading import load_runtime

    if not cfg.base_model:
        raise D3DError("LoRA drafter without a base_model in its drafter.json")
    base = load_runtime(resolve_target(cfg.base_model), "cpu")
    if not all(0 <= i < base.args.n_layers for i in cfg.init_layers) or base.args.dim != cfg.model_args.dim:
        raise D3DError(f"drafter base model {cfg.base_model} does not match the drafter's layers or width")
    factors = {k: stored.pop(k) for k in list(stored) if is_factor(k)}
    state = model_state(base, cfg.init_layers, stored["draft_ids"]) | stored
    merge_factors(state, factors)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def read_drafter_config(folder: Path) -> DrafterConfig:
    """A drafter folder's DrafterConfig, or a one-line D3DError naming drafter.json when it is missing, not
    JSON (or not UTF-8), or not the fields of a DrafterConfig and of its ModelArgs."""
    path = folder / CONFIG_NAME
    if not path.exists():
        raise D3DError(f"not a drafter: {folder} (no {CONFIG_NAME})")
    try:
        cfg = DrafterConfig(**json.loads(path.read_text()))
        if not isinstance(cfg.args, dict) or not isinstance(cfg.target, dict):
            raise TypeError("'args' and 'target' must be objects")
        cfg.model_args  # ModelArgs(**args): a missing or unknown field is a TypeError
    except (ValueError, TypeError) as e:  # not JSON, not an object, or fields a DrafterConfig does not have
        raise D3DError(f"{path} is not a valid drafter config ({type(e).__name__}: {e})") from None
    return cfg


def load_drafter(folder: str | Path, target: Transformer, tokenizer, device: str = "cpu",
                 quantize: str | None = None) -> Drafter:
    """Load a drafter for `target`; a drafter trained for another tokenizer/target is a clear error.
    What the checkpoint does not store (embedding, head rows, cfg.from_target layers) comes from `target`.
    quantize: "int8" quantizes the drafter whatever the target's precision (its numerics only change which
    tokens are proposed, never the output, which verification takes from the target); "fp32" keeps it in fp32
    (`d3d prune --quantize`: removals and the saved drafter need the fp32 weights); None: as the target."""
    folder = Path(folder)
    cfg = read_drafter_config(folder)
    t = cfg.target
    if t.get("tokenizer") != tokenizer_fingerprint(tokenizer) or t.get("vocab_size") != target.args.vocab_size \
            or t.get("dim") != target.args.dim:
        raise D3DError(f"drafter {folder} was trained for target {t.get('name')!r} (vocab {t.get('vocab_size')}, "
                       f"dim {t.get('dim')}), not for this target (vocab {target.args.vocab_size}, "
                       f"dim {target.args.dim}, or a different tokenizer)")
    files = weight_files(folder)
    if not files:
        raise D3DError(f"not a drafter: {folder} has no {WEIGHTS_NAME}")
    with torch.device("meta"):
        d = get_kind(cfg.kind).model_class()(cfg)
    state = {}
    for f in files:
        state |= {k: v.float() if v.is_floating_point() else v for k, v in read_safetensors(f).items()}
    if not cfg.own_embeddings:
        state["tok_embeddings.weight"] = target.tok_embeddings.weight
        state["output.weight"] = target.output.weight[state["draft_ids"]]
    if cfg.lora_rank:
        state = _merged_over_base(cfg, state)
    state |= _share_target_layers(d, target)
    try:
        d.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise D3DError(f"drafter {folder}: its weights do not match its {CONFIG_NAME} ({first_line(e)})") from None
    d.inv_freq = rope_frequencies(cfg.model_args)
    d = pack_linears(d.to(device).eval().requires_grad_(False))
    mode = quantize or getattr(target, "quantized", None)
    d = apply_quantize(d, None if mode == "fp32" else mode, tokenizer, batch_invariant=False)
    if type(d) is Drafter:
        d.pack_cpu_layers()  # the C++ layers, fp32 or int8, as the target (DFlash's own forward stays in PyTorch)
    return d
