"""The D3D drafter: a standalone block-diffusion model that sees only token ids.

It is a small Llama-style stack (the target runtime's own layers) with the target's frozen embedding,
a learned mask embedding, and an LM head over an optional reduced draft vocabulary. It keeps a KV cache
of the verified text (causal) and drafts a block of B masked slots in one forward pass: slot k sits at
position c + 1 + k, where c is the last clean position, sees the whole clean context and the other
slots (bidirectionally). Slot 0 is the token right after the context. In synchronous D3D the context
ends with the target's bonus token and slots 0..B-2 are the draft; in asynchronous D3D the context
ends at the last accepted draft token, slot 0 lands on the bonus position and is replaced by the bonus.
Training (d3d.train) uses exactly this layout.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from .quantize import apply_quantize
from .target import D3DError, ModelArgs, Transformer, decode_layout, rope_frequencies
from .verify import SamplingParams

CONFIG_NAME = "drafter.json"
WEIGHTS_NAME = "drafter.safetensors"


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps(vocab).encode()).hexdigest()[:16]


def weights_fingerprint(drafter_dir: str | Path) -> str:
    """First 16 hex digits of the sha256 of a drafter's weights: which checkpoint a result came from."""
    return hashlib.sha256((Path(drafter_dir) / WEIGHTS_NAME).read_bytes()).hexdigest()[:16]


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
    def draft_block(self, tokens: list[int]) -> torch.Tensor:
        """Make the cache hold `tokens` (the verified text) and draft the B slots after it in the same
        forward pass. Returns draft-vocabulary logits [B, V_draft]; the cache keeps only `tokens`."""
        new = self.sync_context(tokens)
        B, n, L = self.block_size, len(new), self.cache_len
        device = self.draft_ids.device
        feed = torch.tensor([new + [self.mask_id] * B], device=device)
        positions = torch.cat([torch.arange(L, L + n), torch.arange(L + n, L + n + B)]).to(device)
        mask = torch.ones(n + B, L + n + B, dtype=torch.bool, device=device)
        mask[:n, L:] = torch.ones(n, n + B, dtype=torch.bool, device=device).tril()
        logits = self(feed, mask=mask, positions=positions, logits_to_keep=B)[0]
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
                        target_layers: list[int] | None = None) -> Drafter:
    """A drafter whose stack copies the given target layers, with the target's embedding (and head rows).
    kind="dflash" also reads the target's hidden states after `target_layers` (fused by a fresh linear layer)."""
    a = target.args
    args = asdict(a) | {"n_layers": len(layers)}
    cfg = DrafterConfig(args=args, block_size=block_size, init_layers=list(layers),
                        draft_vocab_size=0 if draft_ids is None else len(draft_ids),
                        target=target_info(target_name, tokenizer, a), kind=kind,
                        target_layers=list(target_layers or []))
    d = drafter_class(kind)(cfg)
    sd = {"tok_embeddings.weight": target.tok_embeddings.weight, "norm.weight": target.norm.weight}
    for i, src in enumerate(layers):
        for k, v in target.layers[src].state_dict().items():
            if "cache" not in k:
                sd[f"layers.{i}.{k}"] = v
    head = target.output.weight if draft_ids is None else target.output.weight[draft_ids]
    sd["output.weight"] = head
    sd["draft_ids"] = torch.arange(a.vocab_size) if draft_ids is None else draft_ids.long()
    sd["mask_embedding"] = target.tok_embeddings.weight.mean(0)
    sd |= {k: v for k, v in d.state_dict().items() if k.startswith(d.extra_prefixes)}
    d.load_state_dict({k: v.detach().clone().float() for k, v in sd.items()}, strict=True)
    return d


def _trainable_state(d: Drafter) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: everything but the embedding and the LM head rows, which are the
    target's own (frozen in training) and are rebuilt from the target at load time."""
    return {k: v for k, v in d.state_dict().items() if k not in ("tok_embeddings.weight", "output.weight")}


def save_drafter(d: Drafter, folder: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write drafter.safetensors + drafter.json into `folder` atomically (via a sibling temp folder)."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in _trainable_state(d).items()}
    save_file(state, tmp / WEIGHTS_NAME)
    (tmp / CONFIG_NAME).write_text(json.dumps(asdict(d.cfg), indent=1) + "\n")
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)


def load_drafter(folder: str | Path, target: Transformer, tokenizer, device: str = "cpu") -> Drafter:
    """Load a drafter for `target`; a drafter trained for another tokenizer/target is a clear error."""
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
    with torch.device("meta"):
        d = drafter_class(cfg.kind)(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(folder / WEIGHTS_NAME).items()}
    state["tok_embeddings.weight"] = target.tok_embeddings.weight
    state["output.weight"] = target.output.weight[state["draft_ids"]]
    d.load_state_dict(state, strict=True, assign=True)
    d.inv_freq = rope_frequencies(cfg.model_args)
    d = decode_layout(d.to(device).eval().requires_grad_(False))
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
