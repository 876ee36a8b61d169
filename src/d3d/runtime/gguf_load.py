"""`--quantize int4` on a GGUF target: its tensors loaded straight into the int4 runtime, one at a time.

The usual way in (d3d.runtime.checkpoints) dequantizes a GGUF file once into fp32 safetensors: a 1.5B
Q4_K_M file becomes 6 GB and a 7-8B one does not fit a 24 GB machine. Here no tensor is ever held in fp32
beyond a chunk of rows:
- Q4_K tensors become Int4Linear weights bit for bit (the kernel's layout is Q4_K's: d * sc * q - dmin * m);
- Q6_K / Q5_0 / Q8_0 / F16 tensors (a Q4_K_M file keeps its sensitive tensors in them) are dequantized a
  chunk of rows at a time and requantized over the same scales: Q6_K and Q5_0 to 6 bits (in 8 they made the
  pair's Q4_K_M target read 1.13 GB a token against llama.cpp's 0.98), Q8_0 / F16 to 8; Q4_0 / Q4_1 / F32
  matrices to 4;
- projections fused by the runtime (q, k, v; gate, up) are joined row-wise, a part of fewer bits promoted exactly
  to the most any part has (q * 2^(bits - b) over d / 2^(bits - b));
- the token embedding is kept as int8 rows with one scale each (QuantEmbedding), looked up row by row.
The model folder beside it (config.json, tokenizer, SOURCE_FILE naming the GGUF) holds no weights.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..atomic import atomic_folder
from ..errors import D3DError, first_line
from .checkpoints import DEFAULT_TARGET, SOURCE_FILE, cache_dir, cache_lock, content_key, known_gguf, read_hf_config
from .kernels import pack_q4_parts, q4_parts
from .known_models import KNOWN_MODELS
from .layers import ModelArgs, rope_frequencies
from .quantize import HEAD_BITS, Int4Linear
from .target import Transformer

CHUNK_ROWS = 4096  # rows dequantized at once (Q6_K head of a 151,936-token vocabulary: 25 MB of fp32 per chunk)
SOURCE_BITS = {"Q4_0": 4, "Q4_1": 4, "F32": 4, "Q5_0": 6, "Q5_1": 6, "Q5_K": 6, "Q6_K": 6}  # requantized to; others 8


def target_gguf(target: str | None) -> tuple[Path, str] | None:
    """(GGUF file, model name) where `target` comes from a GGUF file (a KNOWN_MODELS name or a .gguf path);
    None for the embedded default (loaded from its converted folder) and Hugging Face folders."""
    if target is None or target == DEFAULT_TARGET:
        return None
    if target in KNOWN_MODELS:
        return known_gguf(target), target
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise D3DError(f"not a model: {target} is not a GGUF file")
        return path, f"{path.stem}-{content_key(path)}"
    return None


def gguf_model_folder(gguf: Path, name: str) -> Path:
    """A weightless model folder for `gguf` (config.json, tokenizer files, SOURCE_FILE), written once and
    atomically into the d3d cache; named as the fp32 conversion would be, so shipped drafters and datastores
    are found by the same name."""
    out = cache_dir() / "gguf-models" / name
    if (out / "config.json").exists() and (out / SOURCE_FILE).exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    with cache_lock(f"gguf-model-{name}"):
        if (out / "config.json").exists() and (out / SOURCE_FILE).exists():
            return out
        print(f"d3d: reading the configuration and tokenizer of {gguf.name} (once)", file=sys.stderr)
        with atomic_folder(out) as tmp:
            try:
                AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
                AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            except Exception as e:
                raise D3DError(f"cannot read {gguf}: {first_line(e)}") from None
            (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve()), "weights": "gguf"}) + "\n")
    return out


class QuantEmbedding(nn.Module):
    """A token embedding kept as int8 rows, one fp32 scale per row (max |row| / 127): a quarter of fp32's
    memory, and a lookup dequantizes only the rows it needs."""

    def __init__(self, rows: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", rows, persistent=False)  # `weight`: where code asks for the device
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens].float() * self.scale[tokens, None]


def _data(t, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start..stop of GGUF tensor `t` as stored, read from the file rather than through the reader's
    memory map: pages read through a map stay in this process's resident set until it ends."""
    shape = t.data.shape  # the map's shape: reading it touches no data
    stop = shape[0] if stop is None else stop
    row = t.n_bytes // shape[0]
    with open(t.data.filename, "rb") as f:
        f.seek(t.data_offset + start * row)
        raw = f.read((stop - start) * row)
    return np.frombuffer(raw, dtype=t.data.dtype).reshape(stop - start, *shape[1:])


def _rows(t, start: int, stop: int) -> np.ndarray:
    """Rows start..stop of GGUF tensor `t` dequantized to fp32 [rows, K]."""
    from gguf.quants import dequantize

    return dequantize(_data(t, start, stop), t.tensor_type).reshape(stop - start, -1)


def _q4k_parts(t, start: int = 0, stop: int | None = None) -> tuple:
    """Rows start..stop of a Q4_K tensor as q4_parts' (q, sc, m, d, dmin) and 4 bits, exactly: d * sc * q -
    dmin * m."""
    blocks = _data(t, start, stop)
    N = blocks.shape[0]
    blocks = blocks.reshape(N, -1, 144)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    dmin = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    s = blocks[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = blocks[..., 16:].reshape(N, -1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], 3).reshape(N, -1)  # groups 2c (low nibbles) and 2c + 1 (high) of chunk c
    return (torch.from_numpy(q), torch.from_numpy(sc.reshape(N, -1)), torch.from_numpy(m.reshape(N, -1)), d, dmin, 4)


def _parts(t, min_bits: int = 4) -> tuple:
    """q4_parts of GGUF matrix `t` (Q4_K exactly; other types requantized a chunk of rows at a time, to
    SOURCE_BITS or 8; at least min_bits)."""
    kind = t.tensor_type.name
    if kind == "Q4_K":
        return _q4k_parts(t)
    bits = max(min_bits, SOURCE_BITS.get(kind, 8))
    N = t.data.shape[0]
    chunks = [q4_parts(torch.from_numpy(_rows(t, i, min(N, i + CHUNK_ROWS))), bits) for i in range(0, N, CHUNK_ROWS)]
    return (*(torch.cat(c) for c in zip(*(c[:5] for c in chunks))), bits)


def _join(parts: list[tuple]) -> tuple:
    """Row-wise concatenation of q4_parts; a part of fewer bits than another is promoted exactly (4 to 6 bits:
    q 0..60, 4 to 8: 0..240, 6 to 8: 0..252)."""
    bits = max(p[5] for p in parts)
    joined = []
    for q, sc, m, d, dmin, b in parts:
        if b < bits:
            q, d = q.to(torch.uint8) * 2 ** (bits - b), d / 2 ** (bits - b)
        joined.append((q.to(torch.uint8), sc, m, d, dmin))
    return (*(torch.cat(c) for c in zip(*joined)), bits)


def _linear(parts: list[tuple], bias: torch.Tensor | None = None):
    q, sc, m, d, dmin, bits = _join(parts)
    return Int4Linear(pack_q4_parts(q, sc, m, d, dmin, bits), bias)


def _head(t) -> Int4Linear:
    """The LM head (Q4_K's own 4 bits, 6 for a Q6_K head as Q4_K_M files keep it, else HEAD_BITS), packed a
    chunk of rows at a time: its transients stay a chunk's, not a whole vocabulary's."""
    N = t.data.shape[0]
    packed = []
    for i in range(0, N, CHUNK_ROWS):
        rows = min(N, i + CHUNK_ROWS) - i
        if t.tensor_type.name == "Q4_K":
            parts = _q4k_parts(t, i, i + rows)
        else:
            bits = 6 if t.tensor_type.name == "Q6_K" else HEAD_BITS
            parts = (*q4_parts(torch.from_numpy(_rows(t, i, i + rows)), bits), bits)
        packed.append(pack_q4_parts(*parts))
    return Int4Linear((*(torch.cat([p[j] for p in packed]) for j in range(3)), torch.tensor([N, packed[0][3][1]])))


def _permuted(parts: tuple, n_heads: int) -> tuple:
    """Rows of a llama q / k projection put back in Hugging Face order (llama.cpp's converter interleaves
    each head's rotary halves; transformers' GGUF loader undoes it the same way)."""
    rows = parts[0].shape[0]
    order = torch.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(-1)
    return (*(p[order] for p in parts[:5]), parts[5])


def _embedding(t) -> QuantEmbedding:
    N = t.data.shape[0]
    rows, scales = [], []
    for i in range(0, N, CHUNK_ROWS):
        w = torch.from_numpy(_rows(t, i, min(N, i + CHUNK_ROWS)))
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        rows.append(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return QuantEmbedding(torch.cat(rows), torch.cat(scales))


def load_gguf_int4(gguf: Path, model_dir: Path, max_seq_len: int | None = None) -> Transformer:
    """The Llama-family GGUF model in `gguf` on the int4 runtime (this module's doc), its C++ layers packed."""
    from gguf import GGUFReader

    a = ModelArgs.from_hf_config(read_hf_config(model_dir))
    if max_seq_len:
        a.max_seq_len = max_seq_len
    try:
        tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    except Exception as e:
        raise D3DError(f"cannot read {gguf}: {first_line(e)}") from None
    arch = read_hf_config(model_dir).get("model_type")

    def vector(name: str) -> torch.Tensor | None:
        return torch.from_numpy(_data(tensors[name]).astype(np.float32)) if name in tensors else None

    def matrix(name: str, heads: int | None = None, min_bits: int = 4) -> tuple:
        if name not in tensors:
            raise D3DError(f"{gguf.name} has no tensor {name}: not a Llama-family model d3d can load")
        if tensors[name].data.ndim != 2:
            raise D3DError(f"{gguf.name}: tensor {name} is not a matrix")
        parts = _parts(tensors[name], min_bits)
        return _permuted(parts, heads) if heads and arch == "llama" else parts

    with torch.device("meta"):
        model = Transformer(a)
    model.tok_embeddings = _embedding(tensors["token_embd.weight"])
    model.norm.weight = nn.Parameter(vector("output_norm.weight"), requires_grad=False)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied: the embedding's matrix
    model.output = _head(tensors[head])
    for i, block in enumerate(model.layers):
        p, att, ffn = f"blk.{i}.", block.attention, block.feed_forward
        qkv = [matrix(p + "attn_q.weight", a.n_heads), matrix(p + "attn_k.weight", a.n_kv_heads), matrix(p + "attn_v.weight")]
        biases = [vector(p + f"attn_{n}.bias") for n in "qkv"]
        att.wqkv = _linear(qkv, torch.cat(biases) if all(b is not None for b in biases) else None)
        att.wo = _linear([matrix(p + "attn_output.weight")])
        ffn.w13 = _linear([matrix(p + "ffn_gate.weight"), matrix(p + "ffn_up.weight")])
        ffn.w2 = _linear([matrix(p + "ffn_down.weight")])
        block.attention_norm.weight = nn.Parameter(vector(p + "attn_norm.weight"), requires_grad=False)
        block.ffn_norm.weight = nn.Parameter(vector(p + "ffn_norm.weight"), requires_grad=False)
        for norm, name in ((att.q_norm, "attn_q_norm"), (att.k_norm, "attn_k_norm")):
            if norm is not None:
                norm.weight = nn.Parameter(vector(p + f"{name}.weight"), requires_grad=False)
    model.inv_freq = rope_frequencies(a)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise D3DError(f"{gguf.name}: no weights for {', '.join(left[:3])}: not a model d3d can load")
    model.eval().requires_grad_(False)
    model.quantized = "int4"
    # large tensors' 2 MB spans in place, no copies: the loader's freed copies stayed in the heap (the pair's peak rose
    # from 2.03 to 2.48 GB with all of its tensors moved into a buffer of 2 MB pages)
    model.pack_cpu_layers(copy_to_huge_pages=False)
    return model
