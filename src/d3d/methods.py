"""The decoding methods by name: each becomes a function prompt_ids -> GenerationResult on one target."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import torch

from .async_engine import generate_async
from .drafter import D3DProposer, load_drafter
from .engine import GenerationResult, generate
from .errors import D3DError
from .ngram import NgramProposer

METHODS = ("ar", "ngram", "ar-draft", "dflash", "d3d", "d3d-async", "hf", "hf-lookup", "llama-cpp", "llama-cpp-q8",
           "d3d-tree")
# llama.cpp references: the GGUF weight type each runs on
LLAMA_CPP_WEIGHTS = {"llama-cpp": "f32", "llama-cpp-q8": "q8_0"}
# baselines' drafters ship beside the D3D one, under the target's name + this suffix
BASELINE_SUFFIX = {"ar-draft": "-ar", "dflash": "-dflash"}
DEFAULT_DRAFTERS = Path(__file__).parent / "assets" / "drafters"
BEST_METHOD = "ngram"  # what `d3d demo` compares against plain decoding

Runner = Callable[..., GenerationResult]


def make_runner(method: str, model, tokenizer, model_dir: Path, drafter: str | Path | None = None,
                block_size: int = 16, draft_device: str | None = None, tree_budget: int | None = None) -> Runner:
    """A function (prompt_ids, params=..., max_new_tokens=..., stop=...) -> GenerationResult.
    tree_budget: tokens per verified tree for d3d-tree, fixed (None = fitted to this device: d3d.tree.auto_tree)."""
    if method == "ar":
        return partial(generate, model, tokenizer)
    if method == "ngram":
        return partial(generate, model, tokenizer, proposer=NgramProposer(), block_size=block_size)
    path = drafter_path(method, model_dir, drafter)
    if method == "d3d":
        d = _d3d_kind(load_drafter(path, model, tokenizer, device=_device_of(model)))
        proposer = D3DProposer(d, model.args.vocab_size, max_len=model.args.max_seq_len)
        return partial(generate, model, tokenizer, proposer=proposer, block_size=d.block_size)
    if method == "d3d-tree":
        from .tree import TreeProposer, auto_tree, generate_tree

        d = _d3d_kind(load_drafter(path, model, tokenizer, device=_device_of(model)))
        proposer = D3DProposer(d, model.args.vocab_size, max_len=model.args.max_seq_len)
        tree = TreeProposer(proposer, tree_budget) if tree_budget else auto_tree(model, proposer)
        return partial(generate_tree, model, tokenizer, proposer=tree, max_depth=d.block_size - 1)
    if method in BASELINE_SUFFIX:
        from .ardraft import ARDraftProposer
        from .dflash import DFlashProposer

        d = load_drafter(path, model, tokenizer, device=_device_of(model))
        want = {"ar-draft": "ar", "dflash": "dflash"}[method]
        if d.cfg.kind != want:
            raise D3DError(f"method {method} needs a drafter of kind {want!r}; {path} is {d.cfg.kind!r}")
        cls = ARDraftProposer if method == "ar-draft" else DFlashProposer
        proposer = cls(d, model.args.vocab_size, max_len=model.args.max_seq_len)
        return partial(generate, model, tokenizer, proposer=proposer, block_size=block_size)
    if method in ("hf", "hf-lookup"):
        from .hf import HFRunner, load_hf_model

        return HFRunner(load_hf_model(model_dir, _device_of(model)), tokenizer, prompt_lookup=method == "hf-lookup")
    if method in LLAMA_CPP_WEIGHTS:
        from .llamacpp import LlamaCppRunner, reference_gguf

        return LlamaCppRunner(reference_gguf(model_dir, LLAMA_CPP_WEIGHTS[method]), tokenizer,
                              threads=torch.get_num_threads(), context=model.args.max_seq_len)
    if method == "d3d-async":
        d = _d3d_kind(load_drafter(path, model, tokenizer, device=draft_device or _device_of(model)))
        run = partial(generate_async, model, tokenizer, drafter=d, draft_device=draft_device)
        return _split_cpu_threads(run) if _device_of(d) == "cpu" == _device_of(model) else run
    raise D3DError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def drafter_path(method: str, model_dir: Path, drafter: str | Path | None = None) -> Path | None:
    """The checkpoint `method` drafts with: `drafter` if given, else the one shipped for the target; None
    for methods without a learned drafter."""
    if method in ("d3d", "d3d-async", "d3d-tree"):
        return Path(drafter) if drafter else default_drafter(model_dir)
    if method in BASELINE_SUFFIX:
        return Path(drafter) if drafter else default_drafter(model_dir, BASELINE_SUFFIX[method])
    return None


def _d3d_kind(d):
    if d.cfg.kind != "d3d":
        raise D3DError(f"d3d methods need a D3D drafter; this one is of kind {d.cfg.kind!r} "
                       f"(use --method {'dflash' if d.cfg.kind == 'dflash' else 'ar-draft'})")
    return d


def parse_methods(spec: str) -> list[str]:
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise D3DError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not methods:
        raise D3DError("no method given")
    return methods


def _split_cpu_threads(run: Runner) -> Runner:
    """On one CPU the verifier (main thread) and the drafter (worker thread) each run their own OpenMP
    team; with the full thread count on both, 2 x N threads fight over N cores and both collapse. So
    each side gets half the cores while an asynchronous generation runs."""

    def wrapped(*args, **kwargs) -> GenerationResult:
        n = torch.get_num_threads()
        torch.set_num_threads(max(1, n // 2))
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapped


def _device_of(model) -> str:
    return str(next(model.parameters()).device)


def default_drafter(model_dir: Path, suffix: str = "") -> Path:
    """The drafter shipped for a target (by the target folder's name), or a clear error."""
    path = DEFAULT_DRAFTERS / (Path(model_dir).name + suffix)
    if not (path / "drafter.json").exists():
        raise D3DError(f"no drafter is shipped at {path.name} for target {Path(model_dir).name}; train one with "
                       f"`d3d train` and pass --drafter PATH")
    return path
