"""Making the CPU runtime fast: linear layers on oneDNN-prepacked weights (PackedLinear; load_runtime
packs every runtime it loads) and forward passes compiled by inductor (compile_decode;
load_target(compile=True)).

Both are speed only: packed products equal F.linear to about 1e-5, and the compiled graphs give
eager's greedy tokens. d3d.runtime.target's Transformer holds the compiled graphs and decides when they run.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import D3DError
from .target import COMPILED_MIN_START, Transformer

PACK_ROWS = 16  # oneDNN picks its blocked weight layout for this many input rows (see PackedLinear)


class PackedLinear(nn.Linear):
    """nn.Linear whose CPU inference runs on a copy of the weight prepacked in oneDNN's blocked layout.

    Measured on this 2-core CPU (1 thread, all 30 layers + LM head of SmolLM2-135M): one row 37 ms with
    F.linear on the [out, in] weight, 26 ms with x @ W^T contiguous, 19 ms prepacked for 16 rows; 16 rows
    88 / 78 / 34 ms. The weight Parameter stays as it is (state_dict, drafters borrowing head rows,
    training all see a plain nn.Linear); the packed copy costs memory, not bandwidth, and is remade
    when the weight changes (its version counter moves with every in-place update, e.g. an optimizer
    step). Training (autograd) and other devices use F.linear. Results equal F.linear to about 1e-5."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w, self.bias)
        key = (w.data_ptr(), w._version)
        if self._packed_key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
            self._packed_key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> nn.Module:
    """Turn every nn.Linear of `model` into a PackedLinear in place (same parameters, same
    state_dict; see PackedLinear); a no-op where oneDNN is unavailable. Returns `model`."""
    if torch.backends.mkldnn.is_available():
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = PackedLinear
    return model


def compile_decode(model: Transformer) -> Transformer:
    """Compile `model`'s forward passes over one sequence with torch.compile (inductor, C++ wrapper,
    weights frozen as constants): one graph for a one-token decoding step (with the LM head), one for
    the layers over 2 or more tokens under any attention mask (prefill, verification, token trees).
    Hidden-state taps (DFlash) and batches stay eager. Returns `model`, compiled and warmed up (1-2
    minutes on a 2-core CPU, in every process: frozen weights keep inductor from caching it).

    Why: on a CPU, eager decoding spends a quarter of each step on hundreds of small ops between the
    matrix products; inductor fuses them into a few C++ loops. The KV cache length and the number of
    tokens are symbolic, so each graph serves every length (positions >= COMPILED_MIN_START); guards
    are skipped at call time because each graph is the only entry. The graphs are bound to the KV
    cache they were compiled with, so that cache is allocated here for the model's whole context and
    kept by later setup_cache calls (one that replaces it turns the compiled graphs off). The weights are baked in:
    compile after any change to them (quantization, pruning), never before. fp32 CPU only."""
    p = next(model.parameters())
    # not int8: the compiled step's fused norms round a few activations to other int8 levels than the eager,
    # row-by-row verification does, so the two would no longer agree bitwise (measured: tokens differ)
    if not isinstance(model, Transformer) or getattr(model, "quantized", None) or p.device.type != "cpu" \
            or p.dtype != torch.float32:
        raise D3DError("--compile supports the native fp32 CPU runtime only (not --quantize, another device or "
                       "the transformers fallback)")
    if not hasattr(torch.compiler, "set_stance"):
        raise D3DError(f"--compile needs torch >= 2.6 (this is {torch.__version__})")
    model.drop_cpu_layers()  # the graphs trace the PyTorch layers
    model.setup_cache(1, model.args.max_seq_len)
    model.compiled_cache = model.layers[0].attention.k_cache
    model.compiled_step = torch.compile(model.decode_step, dynamic=True)
    model.compiled_layers = torch.compile(model.run_layers, dynamic=True)
    model.compiled_warm = False
    try:
        from torch._inductor import config as inductor_config
        from torch.fx.experimental import _config as shape_config

        # no duck shaping: a width equal to some other size at warm-up (e.g. 3 KV heads) would be tied to it
        with torch.no_grad(), _mkldnn_linear_packing(), inductor_config.patch(freezing=True, cpp_wrapper=True), \
                shape_config.patch(use_duck_shape=False):
            for width in (1, 3):  # the cache contents do not matter: setup_cache starts every sequence afresh
                model.cache_len = COMPILED_MIN_START
                model(torch.zeros(1, width, dtype=torch.long, device=p.device))
    except Exception as e:  # inductor needs a working C++ compiler; say so in one line
        model.compiled_step = model.compiled_layers = None
        raise D3DError(f"--compile failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                       f"run without it") from e
    finally:
        model.cache_len = 0
    model.compiled_warm = True
    return model


@contextmanager
def _mkldnn_linear_packing():
    """While inductor compiles: prepack fp32 linear weights for oneDNN in the layout PackedLinear uses.

    For a static batch size (one token) inductor prepacks them for MKL instead, which measured 27 ms
    for all of SmolLM2's linears at 1 thread against oneDNN's 19 ms (see PackedLinear); it picks oneDNN
    when the batch size is symbolic, packed for a hint size. So, during compilation only, the batch
    size reads as symbolic and the hint as PACK_ROWS. A no-op where this pass does not exist."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion as fusion
        saved = fusion.has_free_symbols, fusion.optimization_hint
    except (ImportError, AttributeError):
        yield
        return
    fusion.has_free_symbols = lambda x: isinstance(x, int) or saved[0](x)
    fusion.optimization_hint = lambda x, *a, **k: PACK_ROWS
    try:
        yield
    finally:
        fusion.has_free_symbols, fusion.optimization_hint = saved

