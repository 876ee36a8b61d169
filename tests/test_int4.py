"""`--quantize int4`: the 4-bit kernel computes what its integer math says, rows are batch-invariant, GGUF
Q4_K tensors load bit for bit, a GGUF file loads straight into the int4 runtime (llama's q / k order
included), the int4 model stays close to fp32, and every speculative method equals int4 plain decoding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from d3d.errors import D3DError
from d3d.methods.catalog import make_runner
from d3d.runtime.gguf_load import _parts, gguf_model_folder, load_gguf_int4
from d3d.runtime.kernels import dequantize_q4, load_kernels, pack_q4_parts, q4_parts, quantize_q4
from d3d.runtime.loading import load_target
from d3d.runtime.quantize import Int4Linear
from test_quantize import (DRAFTING, GREEDY_NEW, GREEDY_PROMPTS, SPECULATIVE, assert_plain_outputs, loaded_drafter,
                           runner)


def reference(x: torch.Tensor, parts: tuple, bias: torch.Tensor) -> torch.Tensor:
    """q4_linear in float64 from its definition: activations quantized per 256 (symmetric int8, round half
    to even), weights dequantized (csrc/q4_kernel.h)."""
    K = x.shape[1]
    Kp = -(-K // 256) * 256
    xp = torch.zeros(x.shape[0], Kp)
    xp[:, :K] = x
    blocks = xp.view(x.shape[0], -1, 256)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = (torch.round(blocks * (1 / scale)) * scale).view(x.shape[0], Kp)[:, :K]
    return (xq.double() @ dequantize_q4(*parts).double().T + bias.double()).float()


@pytest.mark.parametrize("n, k, bits", [(48, 512, 4), (40, 300, 4), (32, 256, 6), (17, 600, 6), (32, 256, 8),
                                         (17, 600, 8)])
def test_int4_kernel_equals_its_math_and_is_batch_invariant(n, k, bits):
    load_kernels()
    torch.manual_seed(n + k)
    w, x, bias = torch.randn(n, k) * 0.05, torch.randn(6, k), torch.randn(n)
    parts = quantize_q4(w, bits)
    # only the groups of 32 inputs that hold weights: a padding group left a gap in the weights' stream
    assert parts[0].shape == (-(-n // 16), -(-k // 32), 64 * bits)
    y = torch.ops.d3d.q4_linear(x, *parts, bias)
    assert torch.allclose(y, reference(x, parts, bias), rtol=1e-4, atol=1e-4)
    rows = torch.cat([torch.ops.d3d.q4_linear(x[i:i + 1], *parts, bias) for i in range(len(x))])
    assert torch.equal(y, rows)  # each row on its own gives the same bits
    error = (dequantize_q4(*parts) - w).norm() / w.norm()
    assert error < {4: 0.1, 6: 0.03, 8: 0.01}[bits], error  # Gaussian weights: 4 bits ~8%, 6 bits ~2%, 8 bits ~0.5%


def q4k_blocks(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF Q4_K blocks (144 bytes per 256 weights: fp16 d and dmin, 12 bytes of 6-bit scales and
    mins, 128 bytes of nibbles), as a GGUF file stores a [rows, k] tensor."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows, k // 256, 144), dtype=np.uint8)
    b[..., 0:4] = np.abs(rng.normal(0, 1e-3, size=(rows, k // 256, 2))).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


class FakeTensor:
    """What gguf_load reads of a GGUFReader tensor: its type, stored rows (a file on disk) and offset."""

    def __init__(self, path, data: np.ndarray, kind: str):
        from gguf import GGMLQuantizationType

        path.write_bytes(data.tobytes())
        self.data = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
        self.tensor_type, self.data_offset, self.n_bytes = GGMLQuantizationType[kind], 0, data.nbytes


def test_gguf_q4_k_tensors_load_bit_for_bit(tmp_path):
    from gguf.quants import dequantize

    raw = q4k_blocks(40, 768)
    t = FakeTensor(tmp_path / "q4k.bin", raw, "Q4_K")
    parts = _parts(t)
    assert parts[5] == 4
    want = torch.from_numpy(dequantize(raw, t.tensor_type).reshape(40, 768))
    assert torch.equal(dequantize_q4(*pack_q4_parts(*parts)), want)


def test_gguf_q8_0_tensors_load_in_8_bits_closely(tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(1).normal(0, 0.02, size=(24, 512)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    parts = _parts(FakeTensor(tmp_path / "q8.bin", raw, "Q8_0"))
    assert parts[5] == 8
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(24, 512))
    got = dequantize_q4(*pack_q4_parts(*parts))
    assert ((got - want).norm() / want.norm()) < 0.01


@pytest.mark.parametrize("kind, bits", [("Q6_K", 6), ("Q5_0", 6)])
def test_gguf_q6_k_and_q5_0_tensors_load_in_6_bits_closely(tmp_path, kind, bits):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if kind == "Q6_K":  # random Q6_K blocks (210 bytes per 256 weights: 128 + 64 bytes of q, 16 int8 scales, fp16 d)
        rng = np.random.default_rng(2)
        raw = rng.integers(0, 256, size=(24, 2, 210), dtype=np.uint8)
        raw[..., 208:210] = np.full((24, 2, 1), 1e-3, dtype=np.float16).view(np.uint8)
        raw = raw.reshape(24, -1)
    else:
        from gguf.quants import quantize
        raw = quantize(np.random.default_rng(3).normal(0, 0.02, size=(24, 512)).astype(np.float32),
                       GGMLQuantizationType.Q5_0)
    parts = _parts(FakeTensor(tmp_path / "q.bin", raw, kind))
    assert parts[5] == bits
    packed = pack_q4_parts(*parts)
    assert packed[0].shape[2] == 64 * bits
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(24, 512))
    got = dequantize_q4(*packed)
    assert ((got - want).norm() / want.norm()) < 0.03


def test_parts_of_fewer_bits_join_exactly():
    from d3d.runtime.gguf_load import _join

    w = [torch.randn(16, 256) * 0.02 for _ in range(3)]
    parts = [(*q4_parts(x, b), b) for x, b in zip(w, (4, 6, 8))]
    for pair in ([parts[0], parts[1]], [parts[0], parts[2]], [parts[1], parts[2]]):
        joined = _join(pair)
        assert joined[5] == max(p[5] for p in pair)
        want = torch.cat([dequantize_q4(*pack_q4_parts(*p)) for p in pair])
        assert torch.allclose(dequantize_q4(*pack_q4_parts(*joined)), want, rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def int4_target(smol):
    return load_target(None, quantize="int4")


@pytest.fixture(scope="module")
def gguf_int4_target(smol):
    """The embedded default's own GGUF file (Q4_1, llama: q / k rows permuted) straight into int4."""
    from d3d.methods.llamacpp import source_gguf

    src = source_gguf(smol[2])
    folder = gguf_model_folder(src, smol[2].name)
    return load_gguf_int4(src, folder), smol[1], folder


def agreement(fp32, model, tok, model_dir, prompt_ids) -> float:
    """Teacher-forced on fp32's own greedy answers: how often `model`'s greedy token is fp32's."""
    ar = make_runner("ar", fp32, tok, model_dir)
    agree = []
    for ids in prompt_ids[:3] + prompt_ids[-1:]:
        seq = ids + ar(ids, max_new_tokens=48).token_ids
        picks = []
        for m in (fp32, model):
            m.setup_cache(1, len(seq) + 8)
            picks.append(m(torch.tensor([seq]))[0, len(ids) - 1:-1].argmax(-1))
        agree.append(picks[0] == picks[1])
    return torch.cat(agree).float().mean().item()


@torch.no_grad()
def test_int4_agrees_with_fp32_on_fp32_answers(smol, int4_target, gguf_int4_target, prompt_ids):
    assert isinstance(int4_target[0].layers[0].feed_forward.w13, Int4Linear)
    assert int4_target[0].cpu_layers is not None  # on the C++ layers
    rate = agreement(smol[0], int4_target[0], smol[1], smol[2], prompt_ids)
    assert rate >= 0.7, rate
    # from the GGUF file, never in fp32 (the fp32 model is the same file dequantized by transformers)
    assert gguf_int4_target[0].output.weight is None and gguf_int4_target[0].tok_embeddings.weight.dtype == torch.int8
    rate = agreement(smol[0], gguf_int4_target[0], smol[1], smol[2], prompt_ids)
    assert rate >= 0.7, rate


@pytest.fixture(scope="module")
def int4_ar(int4_target, gguf_int4_target, prompt_ids):
    out = {}
    for name, (model, tok, model_dir) in (("int4", int4_target), ("gguf", gguf_int4_target)):
        ar = make_runner("ar", model, tok, model_dir)
        out[name] = [ar(prompt_ids[i], max_new_tokens=GREEDY_NEW).token_ids for i in GREEDY_PROMPTS]
    return out


@pytest.mark.parametrize("method", SPECULATIVE)
def test_int4_speculative_methods_equal_int4_plain_decoding(int4_target, prompt_ids, int4_ar, method):
    model, tok, model_dir = int4_target
    spec = runner(method, model, tok, model_dir)
    if method in DRAFTING:  # the drafter follows the target into int4
        assert isinstance(loaded_drafter(model, tok, model_dir, method).layers[0].feed_forward.w13, Int4Linear)
    assert_plain_outputs(spec, prompt_ids, int4_ar["int4"])


@pytest.mark.parametrize("method", ["lookup-tree", "ngram"])
def test_a_gguf_int4_target_is_lossless(gguf_int4_target, prompt_ids, int4_ar, method):
    model, tok, model_dir = gguf_int4_target
    assert_plain_outputs(make_runner(method, model, tok, model_dir), prompt_ids, int4_ar["gguf"])


def test_int4_off_the_cpu_is_a_clear_error():
    with pytest.raises(D3DError, match="int4 runs on the CPU"):
        load_target("Qwen2.5-Coder-1.5B-Instruct", device="cuda", quantize="int4")


def test_q4_parts_keep_zero_rows_and_clip_nothing():
    w = torch.zeros(16, 256)
    w[1] = torch.linspace(-1, 2, 256)
    q, sc, m, d, dmin = q4_parts(w, 4)
    back = dequantize_q4(*pack_q4_parts(q, sc, m, d, dmin, 4))
    assert torch.equal(back[0], torch.zeros(256))
    assert (back[1] - w[1]).abs().max() <= (w[1].max() - w[1].min()) / 15  # within a step: no clipping
