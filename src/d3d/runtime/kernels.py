"""d3d's CPU operators (csrc/), built once per machine with torch.utils.cpp_extension.

- torch.ops.d3d.int8_linear(x, packed, w_sum, w_scale, smooth, bias) (`--quantize int8`) quantizes each
  input row on its own (symmetric int8 of x * smooth) and multiplies it with per-row int8 weights packed
  [N/16, K/4, 16, 4] (AVX512-VNNI `vpdpbusd`: 16 outputs per instruction; AVX2 `vpmaddubsw`; NEON `sdot`;
  or plain loops): the integer sums are exact, so every path gives the same numbers.
- torch.ops.d3d.q4_linear(x, q, scales, factors, shape, bias) (`--quantize int4`): 4-bit weights (or 6- or
  8-bit for the tensors that need them) with GGUF Q4_K's scales, per 32 (6-bit sc, m) and per 256 (fp32 d, dmin), and
  activations quantized per 256 (csrc/q4_kernel.h); integer sums per super-block, so every path agrees.
- torch.ops.d3d.fp32_linear(x, packed, bias): fp32 products, each sum over k in order by fused
  multiply-adds, on weights packed [N/64, K, 64] (pack_fp32).
- torch.ops.d3d.layer(x, params, k_cache, v_cache, inv_freq, positions, mask, start, n_heads, eps): a
  whole decoder layer of one sequence (csrc/layer.cpp) over either kind of weights (layer_params);
  torch.ops.d3d.layers(x, params, k_caches, v_caches, ...) all of a model's layers in one call (params:
  each layer's in turn), as the target's forward runs them unless it taps hidden states.

Each is built for one vector path (D3D_KERNELS below; csrc/vec.h), and every path gives the same bits.
In all three a row's result is bitwise the same whatever else is in the call, so a verification pass or
a token tree computes exactly what one-token decoding steps compute, and one call per layer replaces
the ~25 small torch ops (and their Python) of a layer. Measured on this 2-core CPU at 2 threads
(SmolLM2-135M, all 30 layers): int8 products of one token 3.1 ms (16 rows 6.8, 64 rows 20); the first
version of int8_linear ran single-threaded (built without OpenMP, at::parallel_for ran serially).
"""
from __future__ import annotations

import hashlib
import os
import platform
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import D3DError

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "int8_linear.cpp", CSRC / "q4_linear.cpp", CSRC / "fp32_linear.cpp", CSRC / "layer.cpp"]
HEADERS = sorted(CSRC.glob("*.h"))
BUILD_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]  # -ffp-contract=off: every path's bits
BUILD_LDFLAGS = ["-fopenmp"]
LANES = 16  # outputs per packed int8 block (one 512-bit register of int32 sums)
FP32_GROUP = 64  # outputs per packed fp32 group (four 512-bit registers)

# D3D_KERNELS: which vector path the C++ kernels are built for. "auto" (default): the best this CPU runs,
# and the PyTorch layers for fp32 where that is only the plain loops (they are several times slower than
# PyTorch's own kernels). A named path is built and used as asked (for tests and comparisons); "pytorch"
# keeps the fp32 layers on PyTorch (--quantize int8 still needs the kernels, built for this CPU).
PATH_CHOICES = ("auto", "avx512", "avx2", "neon", "scalar", "pytorch")
_PATH_FLAGS = {"auto": [], "avx512": [], "neon": [], "pytorch": [],
               "avx2": ["-mno-avx512f", "-mno-avxvnni"],  # also drops every AVX-512 extension: a plain AVX2 CPU
               "scalar": ["-DD3D_SCALAR"]}


def cpu_flags() -> set[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def cpu_model() -> str:
    """This CPU's name as the OS reports it (recorded beside every measurement: machines differ)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model name")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def requested_path() -> str:
    """D3D_KERNELS, checked against what this CPU can run (a one-line error otherwise)."""
    path = os.environ.get("D3D_KERNELS", "auto").strip().lower() or "auto"
    if path not in PATH_CHOICES:
        raise D3DError(f"D3D_KERNELS={path!r} is not a kernel path; choose one of {', '.join(PATH_CHOICES)}")
    flags, arm = cpu_flags(), platform.machine() in ("aarch64", "arm64")
    runnable = {"avx512": "avx512f" in flags, "avx2": {"avx2", "fma"} <= flags, "neon": arm}
    if not runnable.get(path, True):
        raise D3DError(f"D3D_KERNELS={path}: this CPU ({cpu_model()}) cannot run the {path} kernels")
    return path


def _build_tag() -> str:
    """The build is for this CPU (-march=native) and these sources: the cached library's name says which
    (torch rebuilds when a .cpp changes, not when only a header does)."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    digest = hashlib.sha1(f"{platform.machine()} {flags} {torch.__version__}".encode())
    for header in HEADERS:
        digest.update(header.read_bytes())
    return digest.hexdigest()[:10]


@lru_cache(maxsize=None)
def load_kernels() -> None:
    """Build (first use on this machine, about 15-40 s; cached by torch in ~/.cache/torch_extensions) and
    load the operators for the path D3D_KERNELS asks for, and register the fakes torch.compile needs."""
    from torch.utils.cpp_extension import load

    path = requested_path()
    # a forced path that is the one -march=native gives anyway shares its build (AVX2 on a CPU without AVX-512)
    native = path == "avx2" and "avx512f" not in cpu_flags()
    flags = [] if native else _PATH_FLAGS[path]
    variant = path if flags else "native"
    try:
        load(name=f"d3d_kernels_{_build_tag()}_{variant}", sources=[str(s) for s in SOURCES],
             extra_include_paths=[str(CSRC)], is_python_module=False, extra_cflags=[*BUILD_CFLAGS, *flags],
             extra_ldflags=BUILD_LDFLAGS, verbose=False)
    except Exception as e:  # a failed build surfaces as many error types (compiler missing, ninja, linker)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise D3DError(f"d3d builds small C++ kernels for the CPU and needs a C++ compiler and ninja: {msg}") from None

    @torch.library.register_fake("d3d::int8_linear")
    def _(x, w, w_sum, w_scale, smooth, bias):
        return x.new_empty((*x.shape[:-1], w_scale.shape[0]))

    @torch.library.register_fake("d3d::q4_linear")
    def _(x, q, scales, factors, shape, bias):
        return x.new_empty((*x.shape[:-1], int(shape[0])))


@lru_cache(maxsize=None)
def kernels_available() -> bool:
    """Whether the fp32 runtime runs on the C++ layers here: they built, and they have a vector path for
    this CPU (or one was forced with D3D_KERNELS). Otherwise it stays on PyTorch; --quantize int8 uses the
    kernels whatever path they have (exact integer sums on every path)."""
    try:
        path = requested_path()
        if path == "pytorch":
            return False
        load_kernels()
    except D3DError as e:
        warnings.warn(f"{str(e).rstrip('.')}; the fp32 runtime stays on PyTorch (slower)", stacklevel=2)
        return False
    return path != "auto" or torch.ops.d3d.kernel_path() != "scalar"


def built_path() -> str | None:
    """The vector path of the loaded kernels ("avx512", "avx2", "neon", "scalar"), None where they did not build."""
    try:
        load_kernels()
    except D3DError:
        return None
    return torch.ops.d3d.kernel_path()


def kernel_path() -> str:
    """What the fp32 layers run on here: a vector path of the C++ kernels, or "pytorch"."""
    return built_path() if kernels_available() else "pytorch"


def runtime_info(quantized: bool = False) -> dict:
    """The CPU and the kernel path, recorded with every result (`d3d generate --json`, bench, report)."""
    if not quantized:
        return {"cpu": cpu_model(), "kernels": kernel_path()}
    built = built_path()
    return {"cpu": cpu_model(), "kernels": built or "none", "int8_kernels": torch.ops.d3d.int8_path() if built else "none",
            "int4_kernels": torch.ops.d3d.q4_path() if built else "none"}


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 [N/16, K/4, 16, 4], per-row sums int32 [N], per-row scales fp32 [N]) of an fp32
    weight [N, K]: symmetric per-row int8 (scale = max|w| / 127), zero-padded to whole blocks."""
    N, K = weight.shape
    scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    Np, Kp = -(-N // LANES) * LANES, -(-K // 4) * 4
    padded = torch.zeros(Np, Kp, dtype=torch.int8)
    padded[:N, :K] = q
    packed = padded.view(Np // LANES, LANES, Kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, q.sum(dim=1, dtype=torch.int32), scale.float()


Q4_SUPER, Q4_GROUP = 256, 32  # csrc/q4_kernel.h: super-blocks of 256 along k, groups of 32 with 6-bit sc and m


def pack_q4_parts(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                  bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights w[n, k] = d[n, k // 256] * sc[n, k // 32] * q[n, k] - dmin[n, k // 256] * m[n, k // 32] in
    q4_linear's layout (csrc/q4_kernel.h): (q u8 [N/16, G, bits * 64] for the G = ceil(K / 32) groups that hold
    any k < K, sc and m u8 [N/16, SB, 2, 8, 16], d and dmin fp32 [N/16, SB, 2, 16], shape int64 [N, K]). q [N, K]
    holds 0..15 (bits 4), 0..63 (bits 6) or 0..254 (bits 8), k padded with zeros to whole groups (the scales to
    whole super-blocks) and n to whole blocks of 16."""
    N, K = q.shape
    SB = -(-K // Q4_SUPER)
    Np, Kp = -(-N // LANES) * LANES, SB * Q4_SUPER

    def pad(t: torch.Tensor, cols: int) -> torch.Tensor:
        out = torch.zeros(Np, cols, dtype=t.dtype)
        out[:N, :t.shape[1]] = t
        return out

    q = pad(q.to(torch.uint8), Kp)
    if bits in (4, 6):  # (nb, l, sb, pair, half, j) -> (nb, sb, pair, l, j): low nibble step 2p, high 2p + 1
        v = (q & 15).view(Np // LANES, LANES, SB, 32, 2, 4).permute(0, 2, 3, 4, 1, 5)
        packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(Np // LANES, SB * 8, -1)
        if bits == 6:  # each group's top two bits after its nibbles: (nb, l, sb, g, plane, i, j) -> (nb, sb, g, plane, l, j, i)
            t = (q >> 4).view(Np // LANES, LANES, SB, 8, 2, 4, 4).permute(0, 2, 3, 4, 1, 6, 5)
            top = t[..., 0] | (t[..., 1] << 2) | (t[..., 2] << 4) | (t[..., 3] << 6)
            packed = torch.cat([packed, top.reshape(Np // LANES, SB * 8, -1)], 2)
    else:  # (nb, l, sb, step, j) -> (nb, sb, step, l, j)
        packed = q.view(Np // LANES, LANES, SB, 64, 4).permute(0, 2, 3, 1, 4)
    groups = [pad(t.to(torch.uint8), SB * 8).view(Np // LANES, LANES, SB, 8).permute(0, 2, 3, 1) for t in (sc, m)]
    factors = [pad(t.float(), SB).view(Np // LANES, LANES, SB).permute(0, 2, 1) for t in (d, dmin)]
    G = -(-K // Q4_GROUP)
    return (packed.reshape(Np // LANES, SB * 8, -1)[:, :G].contiguous(), torch.stack(groups, 2).contiguous(),
            torch.stack(factors, 2).contiguous(), torch.tensor([N, K], dtype=torch.int64))


def q4_parts(weight: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, ...]:
    """An fp32 weight [N, K] quantized as pack_q4_parts takes it: (q [N, K], sc and m [N, SB * 8], d and dmin
    [N, SB]). Per group of 32, asymmetric `bits`-bit values between min(w, 0) and max(w, 0); the group's step
    and offset as 6-bit multiples of per-super-block factors (as GGUF Q4_K), the step rounded up so that no
    weight is clipped."""
    N, K = weight.shape
    SB = -(-K // Q4_SUPER)
    w = torch.zeros(N, SB * Q4_SUPER)
    w[:, :K] = weight.float()
    g = w.view(N, SB, 8, Q4_GROUP)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    qmax = {4: 15, 6: 63, 8: 254}[bits]  # 8 bits: q - 127 fits a signed byte (csrc/q4_kernel.h, group_add8)
    scale, offset = (hi - lo) / qmax, -lo
    d = scale.amax(-1, keepdim=True) / 63
    dmin = offset.amax(-1, keepdim=True) / 63
    sc = torch.where(d > 0, torch.ceil(scale / d.clamp_min(1e-30) - 1e-4), 0).clamp(0, 63)
    m = torch.where(dmin > 0, torch.round(offset / dmin.clamp_min(1e-30)), 0).clamp(0, 63)
    step, base = d * sc, dmin * m
    q = torch.where(step[..., None] > 0, torch.round((g + base[..., None]) / step.clamp_min(1e-30)[..., None]), 0)
    q = q.clamp(0, qmax).to(torch.uint8).reshape(N, -1)[:, :K]
    return q, sc.to(torch.uint8).reshape(N, -1), m.to(torch.uint8).reshape(N, -1), d[..., 0], dmin[..., 0]


def quantize_q4(weight: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, ...]:
    """An fp32 weight [N, K] quantized and packed for q4_linear (q4_parts, pack_q4_parts)."""
    return pack_q4_parts(*q4_parts(weight, bits), bits)


def dequantize_q4(q: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that q4_linear's packed tensors stand for (for tests and quality checks)."""
    N, K = (int(v) for v in shape)
    NB, G, width = q.shape
    SB = -(-K // Q4_SUPER)
    q = torch.cat([q, q.new_zeros(NB, SB * 8 - G, width)], 1)  # the padding groups, back as zeros
    nibbles = Q4_GROUP * LANES // 2
    if width < 2 * nibbles:  # 4 or 6 bits
        v = q[..., :nibbles].reshape(NB, SB, 32, LANES, 4)
        vals = torch.stack([v & 15, v >> 4], 3).permute(0, 4, 1, 2, 3, 5)  # (nb, l, sb, pair, half, j)
        if width > nibbles:  # 6 bits: (nb, sb, g, plane, l, j) bytes of 4 steps' top bits -> (nb, l, sb, g, plane, i, j)
            t = q[..., nibbles:].reshape(NB, SB, 8, 2, LANES, 4)
            top = torch.stack([(t >> (2 * i)) & 3 for i in range(4)], 5).permute(0, 4, 1, 2, 3, 5, 6)
            vals = vals | (top.reshape(vals.shape) << 4)
    else:
        vals = q.view(NB, SB, 64, LANES, 4).permute(0, 3, 1, 2, 4)  # (nb, l, sb, step, j)
    vals = vals.reshape(NB * LANES, SB, 8, Q4_GROUP).float()
    sc, m = (scales[:, :, i].permute(0, 3, 1, 2).reshape(NB * LANES, SB, 8).float() for i in (0, 1))
    d, dmin = (factors[:, :, i].permute(0, 2, 1).reshape(NB * LANES, SB, 1) for i in (0, 1))
    w = (d * sc)[..., None] * vals - (dmin * m)[..., None]
    return w.reshape(NB * LANES, -1)[:N, :K]


def pack_fp32(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 weight [N, K] packed [N/64, K, 64] for fp32_linear (None where N is not a multiple of 64), in 2 MB
    pages where it spans some (empty_in_huge_pages)."""
    N, K = weight.shape
    if N % FP32_GROUP:
        return None
    packed = weight.detach().float().reshape(N // FP32_GROUP, FP32_GROUP, K).transpose(1, 2)
    if weight.device.type != "cpu":
        return packed.contiguous()
    return empty_in_huge_pages(packed.shape, packed.dtype).copy_(packed)


def empty_in_huge_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU whose whole 2 MB spans the kernel backs with 2 MB pages as they are first
    written (MADV_HUGEPAGE before any write): what into_huge_pages would otherwise collapse afterwards (0.7 s a GB)."""
    out = torch.empty(shape, dtype=dtype)
    madvise = _madvise()
    if madvise is not None and out.numel() * out.element_size() >= 2 * HUGE_PAGE:
        madvise(*_whole_spans(out.data_ptr(), out.numel() * out.element_size()), MADV_HUGEPAGE)
    return out


HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 1 << 16  # smaller tensors (norms, scales of small layers) stay where they are
TRIM_BYTES = 32 << 20  # moved between malloc_trim calls
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's madvise advice (MADV_COLLAPSE: 6.1 and later)


def _whole_spans(address: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the aligned 2 MB spans that lie wholly in nbytes at address (length 0: none)."""
    first = -(-address // HUGE_PAGE) * HUGE_PAGE
    return first, max(0, (address + nbytes) // HUGE_PAGE * HUGE_PAGE - first)


@lru_cache(maxsize=None)
def _madvise():
    """libc's madvise where the kernel offers transparent huge pages on request ("always" or "madvise"), else None."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    libc = _libc()
    if "[never]" in mode or libc is None or not hasattr(libc, "madvise"):
        return None
    import ctypes
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


@lru_cache(maxsize=None)
def _libc():
    import ctypes
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def into_huge_pages(tensors: list[torch.Tensor], sharers: list[torch.Tensor] = (), copy: bool = True) -> None:
    """Put the weights a forward streams (each tensor of `tensors` of at least HUGE_MIN_BYTES) in 2 MB pages. A
    one-token step reads every weight once, and with 4 KB pages it also misses the TLB on each page: SmolLM2's 30
    layers ran a one-row step in 0.89x the time in int4, 0.94x in fp32 (AMD EPYC, 2 threads, interleaved).

    A tensor holding whole aligned 2 MB spans has them collapsed in place (MADV_COLLAPSE: no copy, no extra
    memory). The smaller ones, with `copy`, are moved into one buffer of 2 MB pages (Tensor.set_), along with every
    tensor of `sharers` (a module's buffers) that held the same memory, so each old copy is freed as it moves.
    No-op where the kernel offers no huge pages (Linux "never", other systems)."""
    madvise = _madvise()
    big = [t for t in tensors if t.device.type == "cpu" and t.numel() * t.element_size() >= HUGE_MIN_BYTES
           and t.is_contiguous()]
    if madvise is None or not big:
        return
    small = []
    for t in big:
        spans = _whole_spans(t.data_ptr(), t.numel() * t.element_size())
        if spans[1] >= HUGE_PAGE and madvise(*spans, MADV_HUGEPAGE) == 0 and madvise(*spans, MADV_COLLAPSE) == 0:
            continue  # its whole spans are 2 MB pages now
        small.append(t)
    if copy and small:
        _copy_into_huge_pages(small, sharers, madvise)


def _copy_into_huge_pages(tensors: list[torch.Tensor], sharers: list[torch.Tensor], madvise) -> None:
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    arena = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    spans = _whole_spans(arena.data_ptr(), arena.numel())
    madvise(*spans, MADV_HUGEPAGE)
    start = spans[0] - arena.data_ptr()
    by_address: dict[tuple[int, int], list[torch.Tensor]] = {}
    for t in sharers:
        by_address.setdefault((t.data_ptr(), t.numel()), []).append(t)
    trim = getattr(_libc(), "malloc_trim", None)  # glibc: hand the freed copies back to the system as they go
    offset, moved = start, 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            view = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            for owner in by_address.pop((t.data_ptr(), t.numel()), []) + [t]:
                if owner.data_ptr() != view.data_ptr():
                    owner.set_(view)
            offset, moved = offset + size, moved + size
            if trim is not None and (moved >= TRIM_BYTES or offset + HUGE_PAGE >= arena.numel()):
                trim(0)
                moved = 0


def layer_params(block: torch.nn.Module) -> list[torch.Tensor] | None:
    """The tensors of one d3d.runtime.layers.Block in torch.ops.d3d.layer's order (csrc/layer.cpp): its norms, then
    five slots per linear layer (int8: packed, w_sum, w_scale, smooth, bias; int4: q, scales, factors, shape,
    bias; fp32: packed, -, -, -, bias);
    an empty tensor stands for an absent one. None where an fp32 weight cannot be packed."""
    none = torch.empty(0)
    att = block.attention
    params = [block.attention_norm.weight, block.ffn_norm.weight,
              att.q_norm.weight if att.q_norm is not None else none, att.k_norm.weight if att.k_norm is not None else none]
    for lin in (att.wqkv, att.wo, block.feed_forward.w13, block.feed_forward.w2):
        if hasattr(lin, "packed"):  # d3d.runtime.quantize.Int8Linear
            params += [lin.packed, lin.w_sum, lin.w_scale] + [none if t is None else t for t in (lin.smooth, lin.bias)]
        elif hasattr(lin, "q4"):  # d3d.runtime.quantize.Int4Linear
            params += [lin.q4, lin.scales, lin.factors, lin.shape, none if lin.bias is None else lin.bias]
        else:
            packed = pack_fp32(lin.weight)
            if packed is None:
                return None
            params += [packed, none, none, none, none if lin.bias is None else lin.bias]
    return [t.detach().contiguous() for t in params]
