"""Loading a target: its checkpoint (d3d.runtime.checkpoints) onto the native Llama-family runtime (d3d.runtime.target)
or, for other architectures, transformers' model (d3d.runtime.hf.HFRuntime); then int8 or compiled as asked.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoints import load_state_dict, load_tokenizer, read_hf_config, resolve_target
from ..errors import D3DError
from .fastpath import compile_decode, pack_linears
from .target import Transformer
from .layers import ModelArgs, rope_frequencies

LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}


def _hf_to_runtime(sd: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    out["output.weight"] = sd["model.embed_tokens.weight"] if a.tie_embeddings or "lm_head.weight" not in sd \
        else sd["lm_head.weight"]
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        out[q + "attention.wqkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        if a.qkv_bias:
            out[q + "attention.wqkv.bias"] = torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        if a.qk_norm:
            out[q + "attention.q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[q + "attention.k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out[q + "attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[q + "feed_forward.w13.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[q + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[q + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def load_runtime(model_dir: Path, device: str = "cpu", max_seq_len: int | None = None) -> Transformer:
    cfg = read_hf_config(model_dir)
    if cfg.get("model_type") not in LLAMA_FAMILY:
        raise D3DError(f"model type {cfg.get('model_type')!r} has no native runtime; use HFRuntime")
    a = ModelArgs.from_hf_config(cfg)
    if max_seq_len:
        a.max_seq_len = max_seq_len
    with torch.device("meta"):
        model = Transformer(a)
    model.load_state_dict(_hf_to_runtime(load_state_dict(model_dir), a), assign=True, strict=True)
    model.inv_freq = rope_frequencies(a)
    return pack_linears(model.to(device).eval().requires_grad_(False))


def load_target(target: str | None = None, device: str = "cpu", max_seq_len: int | None = None,
                quantize: str | None = None, compile: bool = False):
    """(runtime, tokenizer, model_dir) for `--target` (None = the embedded default); `quantize`: None
    (fp32), "int8" or "int4" (see d3d.runtime.quantize; drafters loaded for this target follow it; int4 loads a
    GGUF target straight from its file, d3d.runtime.gguf_load); `compile`: compile
    its forward passes over one sequence (compile_decode; fp32 CPU only)."""
    from .gguf_load import gguf_model_folder, load_gguf_int4, target_gguf
    from .quantize import apply_quantize

    if compile and (quantize is not None or device != "cpu"):
        raise D3DError("--compile supports the fp32 CPU runtime only (drop --quantize / --device)")
    if quantize is not None and device != "cpu":
        raise D3DError(f"--quantize {quantize} runs on the CPU; use --device cpu")
    gguf = target_gguf(target) if quantize == "int4" else None  # loaded as it is, never in fp32
    model_dir = gguf_model_folder(*gguf) if gguf else resolve_target(target)
    cfg = read_hf_config(model_dir)
    if quantize is not None and cfg.get("model_type") not in LLAMA_FAMILY:
        raise D3DError(f"--quantize needs the native runtime; model type {cfg.get('model_type')!r} has none")
    if gguf:
        return load_gguf_int4(gguf[0], model_dir, max_seq_len), load_tokenizer(model_dir), model_dir
    if cfg.get("model_type") in LLAMA_FAMILY:
        model = load_runtime(model_dir, device, max_seq_len)
    else:
        from .hf import HFRuntime  # imports transformers: only when needed

        model = HFRuntime(model_dir, device)
    tokenizer = load_tokenizer(model_dir)
    model = apply_quantize(model, quantize, tokenizer)  # int8 takes the C++ layers itself
    if compile:
        return compile_decode(model), tokenizer, model_dir
    if quantize is None and isinstance(model, Transformer):
        model.pack_cpu_layers()  # fp32: the C++ layers (d3d.runtime.kernels), where they can run
    return model, tokenizer, model_dir

