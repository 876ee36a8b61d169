"""Outputs of d3d's C++ kernels on fixed inputs, for comparing kernel paths bit for bit.

Run as `D3D_KERNELS=<path> python tests/kernel_outputs.py OUT.pt` (tests/test_kernel_paths.py does): one
process per path, since a process loads one build of the operators. Covers the products (fp32 and int8,
shapes with and without whole register blocks, 1 to 16 rows), and whole decoder layers of two small models
(head dims 64 and 128, QKV bias as in Qwen2) in fp32 and int8: a prompt pass, one-token steps, a
verification pass and a token tree, whose rows each path must also match its own one-token steps.
"""
from __future__ import annotations

import os
import sys

import torch

from d3d.runtime.kernels import kernel_path, load_kernels, pack_fp32, pack_int8
from d3d.runtime.quantize import Int8Linear
from d3d.runtime.target import Transformer
from d3d.runtime.layers import ModelArgs


def products() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for K in (576, 100):
        w, bias = torch.randn(192, K, generator=g), torch.randn(192, generator=g)
        for M in (1, 2, 3, 4, 5, 7, 16):
            x = torch.randn(M, K, generator=g)
            out[f"fp32 {M}x{K}"] = torch.ops.d3d.fp32_linear(x, pack_fp32(w), bias)
            out[f"fp32 {M}x{K} no bias"] = torch.ops.d3d.fp32_linear(x, pack_fp32(w), None)
    for N, K in ((200, 99), (64, 576)):
        w, bias, smooth = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.rand(K, generator=g) + 0.5
        packed, w_sum, w_scale = pack_int8(w)
        for M in (1, 3, 4, 8, 9, 16):
            x = torch.randn(M, K, generator=g) * 3
            out[f"int8 {M}x{K}x{N}"] = torch.ops.d3d.int8_linear(x, packed, w_sum, w_scale, smooth, bias)
            out[f"int8 {M}x{K}x{N} plain"] = torch.ops.d3d.int8_linear(x, packed, w_sum, w_scale, None, None)
    return out


def small_model(head_dim: int, int8: bool) -> Transformer:
    with torch.random.fork_rng():
        torch.manual_seed(head_dim)
        model = Transformer(ModelArgs(vocab_size=256, dim=192, n_layers=2, n_heads=3, n_kv_heads=1,
                                      head_dim=head_dim, intermediate_size=320, norm_eps=1e-6, rope_theta=1e6,
                                      qkv_bias=True, max_seq_len=64))
        for p in model.parameters():
            p.data.normal_(0, 0.2)
    model.eval().requires_grad_(False)
    if int8:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear) and name != "output":
                    setattr(module, name, Int8Linear(child))
    model.pack_cpu_layers()
    assert model.cpu_layers is not None, "the small model is not on the C++ layers"
    return model


@torch.no_grad()
def layers(model: Transformer) -> dict[str, torch.Tensor]:
    """Logits of a prompt pass, then of 5 tokens fed one by one, as one verification pass, and as a tree."""
    prompt, feed = list(range(7, 40, 3)), [5, 200, 17, 99, 3]
    n = len(prompt)
    model.setup_cache(1, 32)
    out = {"prompt": model(torch.tensor([prompt]))[0]}
    out["steps"] = torch.cat([model(torch.tensor([[t]]))[0] for t in feed])
    model.rollback(n)
    out["verify"] = model(torch.tensor([feed]))[0]
    model.rollback(n)
    mask = torch.zeros(4, n + 4, dtype=torch.bool)  # root a; b and c under a; d under c
    mask[:, :n] = True
    for row, seen in enumerate(([0], [0, 1], [0, 2], [0, 2, 3])):
        mask[row, [n + s for s in seen]] = True
    out["tree"] = model(torch.tensor([feed[:4]]), mask=mask[None, None],
                        positions=torch.tensor([n, n + 1, n + 1, n + 2]))[0]
    model.rollback(n)
    out["branch a c d"] = torch.cat([model(torch.tensor([[feed[i]]]))[0] for i in (0, 2, 3)])
    return out


def main(path: str) -> None:
    # published runs use 2 threads; test_kernel_paths also runs 1 and checks that the split changes nothing
    torch.set_num_threads(int(os.environ.get("D3D_KERNEL_THREADS", "2")))
    load_kernels()
    out = {"path": kernel_path(), "tensors": products()}
    for head_dim in (64, 128):
        for int8 in (False, True):
            for key, t in layers(small_model(head_dim, int8)).items():
                out["tensors"][f"layers D={head_dim} {'int8' if int8 else 'fp32'} {key}"] = t
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
