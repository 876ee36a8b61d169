"""`--quantize int8` / `int4`: 8- or 4-bit weights for the target and its drafter on the CPU, like llama.cpp's
Q8_0 and Q4_K (int4: Int4Linear and csrc/q4_kernel.h, which say how; the rest of this doc is int8's).

Each linear layer's weight is quantized per output row (symmetric, scale = max|w| / 127) and each
input row per token (symmetric int8 with its own scale), and d3d's own kernel (d3d.runtime.kernels) sums
the integer products exactly: a quarter of fp32's bytes, which is what decoding is bound by on a CPU.

Batch invariance. Every row is quantized and multiplied on its own and the integer sums are exact, so a
row's output is bitwise the same in any batch (tests/test_quantize.py checks it). The rest of a target
layer (norms, rotary embedding, attention, SiLU) runs row by row in C++ too, one call per layer
(torch.ops.d3d.layer, csrc/layer.cpp): a 16-token verification or a token tree computes what
16 one-token decoding steps compute. A quantized target is its own reference: speculative methods are
lossless with respect to the target as it runs. (The first version used fbgemm's dynamic int8 linear,
which quantizes a whole call with one scale, plus about ten small ops per layer call to make it
batch-invariant, and attention as one SDPA call per row.)

Activation outliers. Per-token activation quantization alone loses a lot on this model: a few input
channels are 10-100x the median, and the rest then get few levels. So, as in SmoothQuant, each input
channel j is divided by s_j = peak|x_j|^a / peak|W_j|^(1-a) (a = 0.7; peaks measured once, at load
time, on a fixed calibration text) and the weight's column j multiplied by it: the same product, with
the difficulty moved from activations to weights. Greedy agreement with fp32, teacher-forced on three
GSM8K prompts and their answers (437 positions; measured with the fbgemm version): weights-only int8
97%, plain per-token int8 81%, smoothed 92%.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import D3DError
from .kernels import load_kernels, pack_int8, quantize_q4

QUANTIZE_MODES = ("int8", "int4")
SMOOTH_ALPHA = 0.7
CALIBRATION_TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did she sell altogether? In April she sold 48 clips; in May 48 / 2 = 24. 48 + 24 = 72.\n"
    "def is_palindrome(s: str) -> bool:\n    s = s.lower()\n    return s == s[::-1]\n\n"
    "Three simple tips for better sleep: keep a regular schedule, avoid screens an hour before bed, and "
    "keep the bedroom cool, dark and quiet. The history of the Roman Empire spans more than a thousand years."
)
KEEP_WEIGHT = ("output", "fc")  # LM head (drafters borrow its rows; tied: no extra memory), DFlash fusion


class Int8Linear(nn.Module):
    """nn.Linear replacement: int8 weight packed for d3d.runtime.kernels (per-row scales), per-token int8
    activations (see the module doc), SmoothQuant channel scaling, fp32 bias added after scaling back."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, input_peak: torch.Tensor | None = None):
        super().__init__()
        load_kernels()
        w = linear.weight.detach().float()
        smooth = None
        if input_peak is not None:
            s = input_peak.clamp_min(1e-5) ** SMOOTH_ALPHA / w.abs().amax(0).clamp_min(1e-5) ** (1 - SMOOTH_ALPHA)
            s = s.clamp_min(1e-5)
            w, smooth = w * s, (1 / s).float().contiguous()
        packed, w_sum, w_scale = pack_int8(w)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        # buffers, not plain attributes: torch.compile then takes their shapes as fixed
        for name, t in (("packed", packed), ("w_sum", w_sum), ("w_scale", w_scale), ("smooth", smooth), ("bias", bias)):
            self.register_buffer(name, t, persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.d3d.int8_linear(x, self.packed, self.w_sum, self.w_scale, self.smooth, self.bias)


class Int4Linear(nn.Module):
    """nn.Linear replacement for `--quantize int4`: weights in GGUF Q4_K's layout (csrc/q4_kernel.h), 4 bits
    (or 6 / 8 for tensors that need them: a GGUF's Q6_K and Q5_0 tensors in 6, the LM head and Q8_0 tensors in 8),
    activations quantized per 256 inputs by torch.ops.d3d.q4_linear. Built from an fp32 nn.Linear (from_linear) or from packed parts
    (d3d.runtime.gguf_load, a GGUF file tensor by tensor)."""

    def __init__(self, parts: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None):
        super().__init__()
        load_kernels()
        q4, scales, factors, shape = parts
        for name, t in (("q4", q4), ("scales", scales), ("factors", factors), ("shape", shape), ("bias", bias)):
            self.register_buffer(name, t, persistent=False)
        self.out_features, self.in_features = (int(v) for v in shape)
        self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, keep_weight: bool = False) -> "Int4Linear":
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        return cls(quantize_q4(linear.weight.detach(), bits), bias, linear.weight if keep_weight else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.d3d.q4_linear(x, self.q4, self.scales, self.factors, self.shape, self.bias)


@torch.no_grad()
def input_peaks(model: nn.Module, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Per-channel max |input| of every nn.Linear of `model` over one causal pass on `tokens`."""
    peaks: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
            peaks[name] = torch.maximum(peaks[name], x) if name in peaks else x
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return peaks


def quantize_int8(model: nn.Module, tokenizer, batch_invariant: bool = True) -> nn.Module:
    """Replace every nn.Linear of `model` (CPU only) by an Int8Linear smoothed on CALIBRATION_TEXT, in
    place; returns `model`. batch_invariant (a d3d.runtime.target.Transformer): its layers then run as one
    torch.ops.d3d.layer call each, row by row, so that a verification pass computes bitwise what
    decoding computes; a drafter does not need it (d3d.drafters.files puts it on them for speed)."""
    if next(model.parameters()).device.type != "cpu":
        raise D3DError("--quantize int8 runs on the CPU; use --device cpu")
    peaks = input_peaks(model, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))
    return replace_linears(model, "int8", batch_invariant, lambda full, layer: Int8Linear(
        layer, keep_weight=full in KEEP_WEIGHT, input_peak=peaks.get(full)))


HEAD_BITS = 8  # the LM head in 8 bits, as GGUF Q4_K_M files keep it in Q6_K: its errors reach every logit


def quantize_int4(model: nn.Module, batch_invariant: bool = True) -> nn.Module:
    """Replace every nn.Linear of `model` (CPU only) by an Int4Linear, in place (4 bits; the LM head
    HEAD_BITS); returns `model`. batch_invariant as in quantize_int8. Already quantized: unchanged."""
    if getattr(model, "quantized", None) == "int4":
        return model
    if next(model.parameters()).device.type != "cpu":
        raise D3DError("--quantize int4 runs on the CPU; use --device cpu")
    return replace_linears(model, "int4", batch_invariant, lambda full, layer: Int4Linear.from_linear(
        layer, HEAD_BITS if full == "output" else 4, keep_weight=full in KEEP_WEIGHT))


def replace_linears(model: nn.Module, mode: str, batch_invariant: bool, make) -> nn.Module:
    """Every nn.Linear of `model` replaced, in place, by make(its full name, it); the C++ layers repacked
    (batch_invariant, as in quantize_int8) and `model.quantized` set to `mode`; returns `model`."""
    for name, module in list(model.named_modules()):
        for child, layer in list(module.named_children()):
            if isinstance(layer, nn.Linear):
                setattr(module, child, make(f"{name}.{child}" if name else child, layer))
    if batch_invariant and hasattr(model, "pack_cpu_layers"):
        model.pack_cpu_layers()
    model.quantized = mode
    return model


def apply_quantize(model: nn.Module, mode: str | None, tokenizer, batch_invariant: bool = True) -> nn.Module:
    """`model` quantized as `mode` (None: unchanged); batch_invariant as in quantize_int8."""
    if mode is None:
        return model
    if mode not in QUANTIZE_MODES:
        raise D3DError(f"unknown --quantize mode {mode!r}; choose from {', '.join(QUANTIZE_MODES)}")
    if mode == "int4":
        return quantize_int4(model, batch_invariant)
    return quantize_int8(model, tokenizer, batch_invariant)
