"""The D3D drafter: a standalone block-diffusion model that sees only token ids.

It is a small Llama-style stack (the target runtime's own layers) with the target's frozen embedding,
a learned mask embedding, and an LM head over an optional reduced draft vocabulary. It keeps a KV cache
of the verified text (causal) and drafts a block of B masked slots in one forward pass: slot k sits at
position c + 1 + k, where c is the last clean position, sees the whole clean context and the other
slots (bidirectionally). Slot 0 is the token right after the context. In synchronous D3D the context
ends with the target's bonus token and slots 0..B-2 are the draft; in asynchronous D3D the context
ends at the last accepted draft token, slot 0 lands on the bonus position and is replaced by the bonus.
Training (d3d.batches) uses exactly this layout.

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
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from .engine import generate
from .quantize import apply_quantize
from .registry import Method, Runner, Setup, register
from .errors import D3DError
from .target import ModelArgs, Transformer, pack_linears, rope_frequencies
from .verify import SamplingParams

CONFIG_NAME = "drafter.json"
WEIGHTS_NAME = "drafter.safetensors"


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps(vocab).encode()).hexdigest()[:16]


def weights_fingerprint(drafter_dir: str | Path) -> str:
    """First 16 hex digits of the sha256 of a drafter's weights (its weight files in order): which
    checkpoint a result came from."""
    h = hashlib.sha256()
    for f in weight_files(drafter_dir):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class DrafterConfig:
    args: dict                    # ModelArgs fields of the drafter stack (width = target width)
    block_size: int = 16
    init_layers: list[int] = field(default_factory=list)   # target layers the stack was initialised from
    draft_vocab_size: int = 0     # 0 = the full target vocabulary
    target: dict = field(default_factory=dict)             # name, vocab_size, tokenizer fingerprint
    training: dict = field(default_factory=dict)           # what produced the weights (data, steps, loss)
    kind: str = "d3d"             # d3d (block diffusion), dflash (target-conditioned), ar (causal drafter)
    target_layers: list[int] = field(default_factory=list)  # dflash: target layers whose states it reads
    shift: bool = False           # token shift: slot 0 is the clean last token's causal state (see module doc)
    from_target: list[int] = field(default_factory=list)    # stack layers equal to target layer init_layers[i]:
    #                               frozen in training, not stored, shared with the target at load time
    own_embeddings: bool = False  # embedding and LM head stored (initialised from another model than the target)

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

    @property
    def mask_slots(self) -> int:
        """Mask tokens fed per block: B, or B - 1 with token shift (slot 0 is then the last clean token)."""
        return self.block_size - 1 if self.cfg.shift else self.block_size

    @torch.no_grad()
    def draft_block(self, tokens: list[int]) -> torch.Tensor:
        """Make the cache hold `tokens` (the verified text) and draft the B slots after it in the same
        forward pass. Returns draft-vocabulary logits [B, V_draft] (slot k predicts the token k + 1 after
        the last of `tokens`); the cache keeps only `tokens`."""
        new = self.sync_context(tokens)
        if self.cfg.shift and not new:  # slot 0 is the last token's state: feed it again
            new = self.sync_context(tokens[:-1]) + tokens[-1:]
        n, L, B = len(new), self.cache_len, self.mask_slots
        device = self.draft_ids.device
        feed = torch.tensor([new + [self.mask_id] * B], device=device)
        positions = torch.cat([torch.arange(L, L + n), torch.arange(L + n, L + n + B)]).to(device)
        mask = torch.ones(n + B, L + n + B, dtype=torch.bool, device=device)
        mask[:n, L:] = torch.ones(n, n + B, dtype=torch.bool, device=device).tril()
        logits = self(feed, mask=mask, positions=positions, logits_to_keep=self.block_size)[0]
        self.cache_len = L + n
        self.cached_tokens += new
        return logits


@contextmanager
def bypassed(drafter: Drafter, drop: set[int] | list[int]):
    """Run `drafter` with the stack layers `drop` skipped (the residual stream passes through them).
    Used by pruning (trial removals) and by layer-drop training (d3d.train)."""
    layers = drafter.layers
    drafter.layers = nn.ModuleList(layer for i, layer in enumerate(layers) if i not in set(drop))
    try:
        yield drafter
    finally:
        drafter.layers = layers


def target_info(target_name: str, tokenizer, target_args: ModelArgs) -> dict:
    return {"name": target_name, "vocab_size": target_args.vocab_size, "dim": target_args.dim,
            "tokenizer": tokenizer_fingerprint(tokenizer)}


KINDS = ("d3d", "dflash", "ar")


def drafter_class(kind: str) -> type[Drafter]:
    if kind not in KINDS:
        raise D3DError(f"unknown drafter kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "dflash":
        from .dflash import DFlashDrafter
        return DFlashDrafter
    return Drafter


def drafter_from_target(target: Transformer, tokenizer, target_name: str, layers: list[int], block_size: int = 16,
                        draft_ids: torch.Tensor | None = None, kind: str = "d3d",
                        target_layers: list[int] | None = None, shift: bool = False) -> Drafter:
    """A drafter whose stack copies the given target layers, with the target's embedding (and head rows).
    kind="dflash" also reads the target's hidden states after `target_layers` (fused by a fresh linear layer).
    shift=True makes it a token-shift drafter (see the module doc): with every target layer and the full
    vocabulary, its slot 0 is the target's own next-token prediction."""
    return drafter_from_model(target, tokenizer, target_name, target.args, layers, block_size, draft_ids, kind,
                              target_layers, shift)


def drafter_from_model(model: Transformer, tokenizer, target_name: str, target_args: ModelArgs, layers: list[int],
                       block_size: int = 16, draft_ids: torch.Tensor | None = None, kind: str = "d3d",
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
    d = drafter_class(kind)(cfg)
    sd = {"tok_embeddings.weight": model.tok_embeddings.weight, "norm.weight": model.norm.weight}
    for i, src in enumerate(layers):
        for k, v in model.layers[src].state_dict().items():
            if "cache" not in k:
                sd[f"layers.{i}.{k}"] = v
    head = model.output.weight if draft_ids is None else model.output.weight[draft_ids]
    sd["output.weight"] = head
    sd["draft_ids"] = torch.arange(a.vocab_size) if draft_ids is None else draft_ids.long()
    sd["mask_embedding"] = model.tok_embeddings.weight.mean(0)
    sd |= {k: v for k, v in d.state_dict().items() if k.startswith(d.extra_prefixes)}
    d.load_state_dict({k: v.detach().clone().float() for k, v in sd.items()}, strict=True)
    return d


def _layer_prefixes(indices: list[int]) -> tuple[str, ...]:
    return tuple(f"layers.{i}." for i in indices)


def _trainable_state(d: Drafter) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: everything but what is rebuilt from the target at load time: the
    embedding and the LM head rows (unless cfg.own_embeddings) and the stack layers in cfg.from_target
    (a delta checkpoint: a drafter made from the whole target stores only what training changed)."""
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
    """Write drafter.safetensors + drafter.json into `folder` atomically (via a sibling temp folder).
    max_file_mb: split the weights into files of at most that size (drafter-00001-of-0000N.safetensors)."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in _trainable_state(d).items()}
    shards = _shards(state, None if max_file_mb is None else int(max_file_mb * 2**20))
    for i, part in enumerate(shards):
        name = WEIGHTS_NAME if len(shards) == 1 else f"drafter-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, tmp / name)
    (tmp / CONFIG_NAME).write_text(json.dumps(asdict(d.cfg), indent=1) + "\n")
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)


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


def load_drafter(folder: str | Path, target: Transformer, tokenizer, device: str = "cpu") -> Drafter:
    """Load a drafter for `target`; a drafter trained for another tokenizer/target is a clear error.
    What the checkpoint does not store (embedding, head rows, cfg.from_target layers) comes from `target`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG_NAME).exists():
        raise D3DError(f"not a drafter: {folder} (no {CONFIG_NAME})")
    cfg = DrafterConfig(**json.loads((folder / CONFIG_NAME).read_text()))
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
        d = drafter_class(cfg.kind)(cfg)
    state = {}
    for f in files:
        state |= {k: v.float() if v.is_floating_point() else v for k, v in load_file(f).items()}
    if not cfg.own_embeddings:
        state["tok_embeddings.weight"] = target.tok_embeddings.weight
        state["output.weight"] = target.output.weight[state["draft_ids"]]
    state |= _share_target_layers(d, target)
    d.load_state_dict(state, strict=True, assign=True)
    d.inv_freq = rope_frequencies(cfg.model_args)
    d = pack_linears(d.to(device).eval().requires_grad_(False))
    return apply_quantize(d, getattr(target, "quantized", None), tokenizer, batch_invariant=False)  # drafts need no invariance


class D3DProposer:
    """Synchronous D3D: draft the block after the verified text (which ends with the bonus token)."""

    name = "d3d"

    def __init__(self, drafter: Drafter, vocab_size: int, max_len: int = 4096):
        self.drafter, self.vocab_size, self.max_len = drafter, vocab_size, max_len
        self.params = SamplingParams()

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter.setup_cache(1, self.max_len)
        self.drafter.cached_tokens = []
        self.generator = draft_generator(self.params, self.drafter.draft_ids.device)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        logits = self.drafter.draft_block(tokens)[:k]
        return sample_draft(self.drafter, logits, self.params, self.vocab_size, self.generator)


def draft_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """The drafter's own stream of randomness, distinct from (not a copy of) the target's: equal seeds
    would correlate draft sampling with the acceptance draws."""
    g = torch.Generator(device=device)
    seed = torch.seed() if params.seed is None else (params.seed * 0x9E3779B97F4A7C15 + 0x2545F491) % 2**64
    g.manual_seed(seed)
    return g


def sample_draft(drafter: Drafter, logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                 generator: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
    """Greedy: argmax drafts, one-hot q. Sampling: each slot sampled from softmax(logits / T), and that q
    returned over the full vocabulary (slots come from one parallel pass, so each q is a fixed proposal)."""
    if params.greedy:
        return drafter.draft_ids[logits.argmax(-1)].tolist(), None
    q = torch.softmax(logits.float() / params.temperature, dim=-1)
    picks = torch.multinomial(q, 1, generator=generator).squeeze(-1)
    full = torch.zeros(q.shape[0], vocab_size, dtype=q.dtype, device=q.device)
    full.scatter_(-1, drafter.draft_ids.expand_as(q), q)
    return drafter.draft_ids[picks].tolist(), full


def _d3d_runner(s: Setup):
    d = s.drafter("d3d", "d3d")
    proposer = D3DProposer(d, s.model.args.vocab_size, max_len=s.model.args.max_seq_len)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=d.block_size),
                  block_size=d.block_size)


D3D = register(Method("d3d", _d3d_runner, help="the D3D diffusion drafter, draft then verify", drafter_kind="d3d"))
