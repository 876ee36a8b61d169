"""Classic speculative decoding with a draft model (baseline): any pretrained causal LM with the target's
tokenizer drafts k tokens one by one and the target verifies them in one pass, as transformers' assisted
generation, llama.cpp's `-md` and vLLM's draft_model do.

The draft model (`--draft-model`: a known name, a Hugging Face folder or a .gguf file) is loaded like a
target, on d3d's runtime and its C++ layers (d3d.runtime.loading.load_runtime), in int8 with --quantize-drafter
int8 (otherwise as the target: fp32 unless --quantize int8). Drafting is ar-draft's (ARDraftProposer): k
adapts (+2 after a round that accepted every draft, -1 otherwise, within [1, 15]; the method option
draft_k, `--draft-k`, fixes it), drafts are greedy at temperature 0 and sampled from the draft model's own
distribution otherwise, and d3d.decoding.verify's rule keeps the output exactly the target's.

Cache sync: the draft model's KV cache holds exactly `cached_tokens`. After drafting it holds the verified
text plus every draft but the last. The next round first rolls it back to the longest common prefix with
the new verified text (the rejected drafts go), then feeds the rest in one pass (the bonus token, and the
last draft too when every draft was accepted), so it holds the verified text before it drafts again.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from .ar_draft import ARDraftProposer
from ..runtime.checkpoints import load_tokenizer, read_hf_config, resolve_target
from ..drafters.drafter import Drafter, tokenizer_fingerprint
from ..decoding.engine import generate
from ..errors import D3DError
from ..runtime.loading import load_runtime
from ..runtime.quantize import apply_quantize
from .registry import Method, Runner, Setup, register
from ..runtime.target import Transformer

NEEDS = "a model with the target's tokenizer (a known name, a Hugging Face folder or a .gguf file)"


class DraftModel:
    """A causal LM on d3d's runtime behind the interface ARDraftProposer drafts through (Drafter's): the
    token ids its KV cache holds, kept by Drafter's own sync_context and extend, and draft_ids, here every
    token of the vocabulary it shares with the target. A wrapper rather than a Drafter copy, so that the
    model's weights are held once."""

    sync_context = Drafter.sync_context
    extend = Drafter.extend

    def __init__(self, model: Transformer):
        self.model, self.cached_tokens = model, []
        self.draft_ids = torch.arange(model.args.vocab_size, device=model.tok_embeddings.weight.device)

    def __call__(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.model(tokens, **kwargs)

    def setup_cache(self, max_batch: int, max_len: int) -> None:
        self.model.setup_cache(max_batch, max_len)

    def rollback(self, length: int) -> None:
        self.model.rollback(length)

    def hidden(self, tokens: torch.Tensor):
        return self.model.hidden(tokens)


class DraftModelProposer(ARDraftProposer):
    """ar-draft's proposer over a DraftModel."""

    name = "draft-model"


def check_same_vocabulary(name: str, model_dir: Path, target, tokenizer) -> None:
    """Refuse a draft model whose vocabulary is not the target's, read from its files before its weights
    load: draft token ids and their distributions index the target's logits directly."""
    rows = read_hf_config(model_dir).get("vocab_size")
    if rows != target.args.vocab_size:
        raise D3DError(f"draft model {name} has {rows} vocabulary rows, the target {target.args.vocab_size}: "
                       f"--draft-model needs {NEEDS}")
    try:
        same = tokenizer_fingerprint(load_tokenizer(model_dir)) == tokenizer_fingerprint(tokenizer)
    except (OSError, ValueError) as e:
        raise D3DError(f"could not load the tokenizer of draft model {name}: {str(e).strip().splitlines()[0]}") \
            from None
    if not same:
        raise D3DError(f"draft model {name} has another tokenizer than the target: --draft-model needs {NEEDS}")


def load_draft_model(s: Setup) -> Transformer:
    """The model s.drafter_path names, checked to share the target's vocabulary, on d3d's runtime on the
    drafter's device; int8 as --quantize-drafter says, else as the target (as learned drafters are)."""
    name = str(s.drafter_path)
    model_dir = resolve_target(name)
    check_same_vocabulary(name, model_dir, s.model, s.tokenizer)
    model = load_runtime(model_dir, s.draft_device or s.device)
    quantize = s.quantize_drafter or getattr(s.model, "quantized", None)
    model = apply_quantize(model, quantize, s.tokenizer, batch_invariant=False)
    model.pack_cpu_layers()  # the C++ layers, fp32 or int8
    return model


def _draft_model_runner(s: Setup) -> Runner:
    k = s.options.get("draft_k")
    fixed = {} if k is None else {"k": k, "adaptive": False}
    model = load_draft_model(s)
    max_len = min(s.model.args.max_seq_len, model.args.max_seq_len)
    proposer = DraftModelProposer(DraftModel(model), s.model.args.vocab_size, max_len=max_len, **fixed)
    return Runner(partial(generate, s.model, s.tokenizer, proposer=proposer, block_size=s.block_size),
                  block_size=s.block_size, draft_k=k)


DRAFT_MODEL = register(Method("draft-model", _draft_model_runner, drafter_kind="model", drafter_option="draft-model",
                              drafter_required=f"NAME|PATH: {NEEDS}",
                              help="baseline: classic speculative decoding with a smaller model of the same tokenizer"))
