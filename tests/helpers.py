"""Shared test helpers: tiny random targets and drafters, a stub tokenizer, tiny training data.

Two tiny targets recur: the law tests' one (V = 8 tokens, EOS 7, tiny_model), small enough that its output
law can be enumerated (sampling_law.py), and the training tests' TINY (32 tokens, EOS 1).
"""
from __future__ import annotations

import importlib.util
import os
import random
import shutil

import pytest
import torch

from d3d.corpus.data import Example
from d3d.corpus.datastore import Datastore
from d3d.decoding.engine import generate
from d3d.decoding.verify import SamplingParams
from d3d.drafters.convert import drafter_from_target
from d3d.drafters.drafter import Drafter
from d3d.runtime.layers import ModelArgs
from d3d.runtime.target import Transformer

V = 8
EOS = 7

# --------------------------------------------------------------------------------------------
# What a test needs beyond README's test command: an optional extra (skipped, naming it) or a system tool
# (skipped, naming the Debian package; in CI, where .ci/run installs them, a one-line failure instead)

SUFFIX_EXTRA = 'pip install nanobind==2.9.2 cmake && pip install --no-build-isolation -e ".[suffix]"'
LLAMACPP_EXTRA = 'pip install -e ".[llamacpp]"'


def needs_suffix() -> None:
    """Skip unless the `suffix` method's package (arctic-inference, the `.[suffix]` extra) imports."""
    pytest.importorskip("arctic_inference.suffix_decoding", reason=f"needs the suffix extra: {SUFFIX_EXTRA}")


needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason=f"needs the llamacpp extra (builds llama.cpp): {LLAMACPP_EXTRA}")


def system_tool(*names: str, package: str) -> str:
    """The path of the first of `names` on PATH. Missing: a skip that says which Debian package to install, or
    in CI (CI set, as .ci/run runs) a one-line failure that says the same, so that CI never skips it silently."""
    found = next((path for path in map(shutil.which, names) if path), None)
    if found is None:
        msg = f"needs {names[0]}: apt-get install {package}"
        if os.environ.get("CI"):
            pytest.fail(f"{msg} (.ci/run installs it)", pytrace=False)
        pytest.skip(msg)
    return found


def tiny_args(vocab: int, max_seq_len: int, n_layers: int = 2, dim: int = 32) -> ModelArgs:
    """A tiny Llama-like stack: width 32 (or `dim`), two heads of 16 sharing one KV head."""
    return ModelArgs(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=2, n_kv_heads=1, head_dim=16,
                     intermediate_size=64, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=max_seq_len)


TINY = tiny_args(32, 256)


class StubTokenizer:
    """`vocab` tokens named t0, t1, ...; eos=-1 for none. encode is bytes mod `vocab`: what --quantize int8
    reads its calibration text through (d3d.runtime.quantize)."""

    def __init__(self, vocab: int = V, eos: int = EOS):
        self.vocab, self.eos_token_id = vocab, eos

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab)}

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [b % self.vocab for b in text.encode()]


def tiny_tokenizer(vocab: int = TINY.vocab_size) -> StubTokenizer:
    """The training tests' tokenizer: EOS is token 1."""
    return StubTokenizer(vocab, eos=1)


class ChatTokenizer:
    """One token id per chat; the chats are kept so fake runners can see their prompt."""
    chat_template = "fake"

    def __init__(self):
        self.chats: list[list[dict]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        assert add_generation_prompt and tokenize
        self.chats.append([dict(m) for m in messages])
        return [len(self.chats) - 1]


# --------------------------------------------------------------------------------------------
# The law tests' tiny target (V tokens) and what drafts for it


def tiny_model(noise: float = 0.0) -> Transformer:
    """The tiny target (same weights every time), or with `noise` added to its output layer: a drafter
    that agrees with it only part of the time."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(tiny_args(V, 64, dim=LAW_DIM))
        model.output.weight.data.add_(noise * torch.randn(model.output.weight.shape))
    model.output.weight.data.mul_(2.5)  # peakier next-token laws, far from uniform
    return on_cpu_layers(model.eval().requires_grad_(False))


LAW_DIM = 64  # every projection a whole number of the C++ layers' 64-output groups (d3d.runtime.kernels.pack_fp32)


def on_cpu_layers(model: Transformer) -> Transformer:
    """`model` on the C++ layers, as d3d loads a target or a drafter on the CPU (PyTorch's layers where the
    kernels did not build): the tests run what users run, and a tiny forward takes about 0.13 ms there
    against 0.45 ms in PyTorch's small ops."""
    model.pack_cpu_layers()
    return model


def tiny_drafter(target: Transformer, block: int = 4) -> Drafter:
    """An untrained D3D drafter copied from the tiny target's layers: right part of the time."""
    return on_cpu_layers(drafter_from_target(target, StubTokenizer(), "tiny", [0, 1], block).eval().requires_grad_(False))


def tiny_datastore(target: Transformer, prompt: list[int], n: int = 24) -> Datastore:
    """A datastore of the tiny target's own sampled continuations of `prompt` (temperature 1, 6 tokens
    each), as `d3d datastore` makes one of distillation data: often, not always, what it says next."""
    sep = (1 << V.bit_length()) - 1
    tokens = []
    for seed in range(n):
        res = generate(target, StubTokenizer(), prompt, SamplingParams(temperature=1.0, seed=1000 + seed), 6)
        tokens += prompt[-2:] + res.token_ids + [sep]
    return Datastore(torch.tensor(tokens).numpy(), V)


def tiny_pair(vocab: int, block: int, seed: int = 0, favour: tuple[int, float] | None = None,
              peaky: bool = True) -> tuple[Transformer, Drafter]:
    """A tiny random target and a drafter copied from its layers (tokenizer StubTokenizer(vocab, eos=-1)).
    `favour` = (token, strength) adds a direction common to most hidden states to that token's head row
    (before the drafter copies it), so that greedy outputs mix that token with others and drafts are
    accepted at every depth; without it, `peaky` scales the head by 2.5."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        target = Transformer(tiny_args(vocab, 128, dim=LAW_DIM)).eval().requires_grad_(False)
        with torch.no_grad():
            if favour is not None:
                x, _ = target.hidden(torch.randint(vocab, (8, 32)))
                mean = target.norm(x).reshape(-1, target.args.dim).mean(0)
                target.output.weight[favour[0]] += favour[1] * mean / mean.norm()
            elif peaky:
                target.output.weight.mul_(2.5)  # peakier next-token laws, far from uniform
        drafter = drafter_from_target(target, StubTokenizer(vocab, eos=-1), "tiny", [0, 1], block)
    return on_cpu_layers(target), on_cpu_layers(drafter.eval().requires_grad_(False))


# --------------------------------------------------------------------------------------------
# The training tests' TINY target


def trainable_drafter(seed: int = 0, block_size: int = 4) -> Drafter:
    """A D3D drafter copied from a random TINY target (torch.manual_seed(seed), not forked), in training mode."""
    torch.manual_seed(seed)
    target = Transformer(TINY)
    return drafter_from_target(target, tiny_tokenizer(), "tiny", [0, 1], block_size)


def tiny_examples(n: int = 64, seed: int = 0) -> list[Example]:
    """Sequences with an easy rule (t, t+1, t+2, ... within TINY's vocabulary, restarting at random), so a
    drafter can learn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(2, TINY.vocab_size)
        seq = [(start + i) % (TINY.vocab_size - 2) + 2 for i in range(40)]
        out.append(Example(prompt_ids=seq[:6], response_ids=seq[6:], source="tiny", hash=""))
    return out


def sliced_prompt(ids: list[int], chunk: int) -> list[int]:
    """`ids` repeated to 2 * chunk + 10 tokens: a prompt of three prefill slices, the last one short."""
    return (ids * (2 * chunk // len(ids) + 1))[:2 * chunk + 10]


def check_raising_after(n: int, calls: list):
    """A prefill_check that records each call in `calls` and raises TimeoutError once there are more than n."""
    def check():
        calls.append(1)
        if len(calls) > n:
            raise TimeoutError
    return check


def drafted_rounds(res, max_new_tokens: int) -> int:
    """Rounds of a generation that had drafts: all but one that started with a single token left to make
    (the loop asks for no draft then; only the last round can)."""
    return res.rounds - (1 + sum(res.acceptance_lengths[:-1]) == max_new_tokens - 1)
