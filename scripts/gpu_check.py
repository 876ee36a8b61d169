"""Component timings of asynchronous D3D on one machine, with random weights (no model files needed).

Measures, for a target of a given shape and a drafter of `--draft-layers` layers of the same width:
verify (the target feeding B tokens after `--context` cached tokens), the packed draft (V plus one
B-slot block per acceptance count, B + B*B tokens), and both launched together (CUDA: two streams on
one GPU, or the drafter on a second GPU with --draft-device; CPU: two threads with half the cores
each). overlap = (verify + draft - both) / min(verify, draft): 1 means the shorter one is fully hidden.

    python scripts/gpu_check.py --shape qwen3-8b --device cuda:0                  # one GPU, two streams
    python scripts/gpu_check.py --shape qwen3-8b --device cuda:0 --draft-device cuda:1
    python scripts/gpu_check.py --shape smollm2 --device cpu --iters 5            # this CPU
    python scripts/gpu_check.py --shape qwen3-8b --device cuda:0 --decode           # + decode vs bandwidth
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import torch

from d3d.drafters.drafter import Drafter, DrafterConfig
from d3d.decoding.packed import packed_draft
from d3d.runtime.target import Transformer
from d3d.runtime.layers import ModelArgs, rope_frequencies

SHAPES = {
    "qwen3-8b": ModelArgs(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                          intermediate_size=12288, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=4096),
    "smollm2": ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         intermediate_size=1536, norm_eps=1e-5, rope_theta=1e5, max_seq_len=4096),
    "tiny": ModelArgs(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=128, norm_eps=1e-5, rope_theta=1e4, max_seq_len=1024),
}


def build(module: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights straight on the device (an 8B model in seconds, no files)."""
    module = module.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return module.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, device: str, iters: int) -> float:
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--draft-device", default=None)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    ap.add_argument("--decode", action="store_true",
                    help="also time plain decoding (one token per step), eager and torch.compile'd, as a "
                         "fraction of the memory bandwidth --peak-gbs")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="memory bandwidth (default: H200's 4.8 TB/s)")
    ap.add_argument("--levers", action="store_true",
                    help="also time the packed pass's cost levers (LM head, candidates, successor slots, vocabulary)")
    args = ap.parse_args()
    dev, ddev = args.device, args.draft_device or args.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    a, B = SHAPES[args.shape], args.block
    if dev == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    with torch.device("meta"):
        target = Transformer(a)
        dargs = asdict(a) | {"n_layers": args.draft_layers}
        drafter = Drafter(DrafterConfig(args=dargs, block_size=B, draft_vocab_size=min(args.draft_vocab,
                                                                                     a.vocab_size)))
    target, drafter = build(target, dev, dtype), build(drafter, ddev, dtype)
    target.inv_freq, drafter.inv_freq = rope_frequencies(a, dev), rope_frequencies(a, ddev)
    drafter.draft_ids = torch.arange(drafter.output.weight.shape[0], device=ddev)
    L = args.context
    target.setup_cache(1, L + 2 * B + 8)
    drafter.setup_cache(1, L + 2 * B + B * B + 8)
    ctx = torch.randint(a.vocab_size, (1, L), device=dev)
    with torch.no_grad():
        target(ctx, last_only=True)
        drafter.cached_tokens = ctx[0].tolist()
        drafter(ctx.to(ddev), last_only=True)
    V = torch.randint(a.vocab_size, (B,)).tolist()
    vin = torch.tensor([V], device=dev)
    stream = torch.cuda.Stream(ddev) if ddev.startswith("cuda") else None

    @torch.no_grad()
    def verify() -> None:
        target(vin)
        target.rollback(L)

    @torch.no_grad()
    def draft() -> None:
        if stream is not None:
            with torch.cuda.stream(stream):
                packed_draft(drafter, V, None, B, False)
        else:
            packed_draft(drafter, V, None, B, False)
        drafter.rollback(L)
        del drafter.cached_tokens[L:]

    pool = ThreadPoolExecutor(1)

    def both() -> None:
        if stream is not None:
            draft()  # queued on its own stream; verify's kernels interleave with it on the GPU
            verify()
            stream.synchronize()
        else:
            fut = pool.submit(draft)
            verify()
            fut.result()

    threads = torch.get_num_threads()
    for fn in (verify, draft, both):
        timed(fn, dev, 2)
    t_verify, t_draft = timed(verify, dev, args.iters), timed(draft, ddev, args.iters)
    if dev == "cpu":
        torch.set_num_threads(max(1, threads // 2))
    t_both = timed(both, dev, args.iters)
    torch.set_num_threads(threads)
    overlap = (t_verify + t_draft - t_both) / min(t_verify, t_draft)
    rows = {"shape": args.shape, "device": dev, "draft_device": ddev, "dtype": str(dtype).replace("torch.", ""),
            "context": L, "block": B, "draft_layers": args.draft_layers, "packed_tokens": B + B * B,
            "verify_ms": round(1000 * t_verify, 2), "packed_draft_ms": round(1000 * t_draft, 2),
            "both_ms": round(1000 * t_both, 2), "sum_ms": round(1000 * (t_verify + t_draft), 2),
            "overlap": round(overlap, 3),
            "gpu": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else None}
    if args.levers:
        rows["levers_ms"] = levers(drafter, target, V, L, B, ddev, args.iters)
    if args.decode:
        rows["decode"] = decode_rates(target, L, dev, args.iters, args.peak_gbs)
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"{k.ljust(width)}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows | {"command": "python " + " ".join(sys.argv)}, f, indent=1)


@torch.no_grad()
def decode_rates(target: Transformer, L: int, dev: str, iters: int, peak_gbs: float) -> dict:
    """Plain decoding after L cached tokens: ms per token, weight bytes streamed per token (every
    parameter once; the tied embedding counted once) over that time, eager and compiled. Compilation
    time is reported too (dynamic shapes: the cache length grows every step)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in target.parameters()}.values())
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)
    out = {"weight_gb": round(weight_bytes / 1e9, 3), "peak_gbs": peak_gbs}
    for name, fn in (("eager", target), ("compiled", torch.compile(target, dynamic=True))):
        t0 = time.perf_counter()
        fn(token)  # compiles on first call
        sync(dev)
        compile_s = time.perf_counter() - t0
        target.rollback(L)

        def step() -> None:
            fn(token)
            target.rollback(L)
        t = timed(step, dev, iters)
        gbs = weight_bytes / t / 1e9
        out[name] = {"ms_per_token": round(1000 * t, 3), "tokens_per_s": round(1 / t, 1), "gb_per_s": round(gbs, 1),
                     "fraction_of_peak": round(gbs / peak_gbs, 3), "first_call_s": round(compile_s, 1)}
    return out


def levers(drafter: Drafter, target: Transformer, V: list[int], L: int, B: int, dev: str, iters: int) -> dict:
    """Median ms of the drafter-side work of one round under each cost lever of the packed pass."""

    def packed(cands=None, slots=B, head=False):
        @torch.no_grad()
        def run() -> None:
            h = packed_draft(drafter, V, cands, slots, head)
            if not head:
                drafter.head(h[0])  # the LM head on the one candidate the target picks
            drafter.rollback(L)
            del drafter.cached_tokens[L:]
        return run

    @torch.no_grad()
    def sync_draft() -> None:
        drafter.draft_block(drafter.cached_tokens + V[:2])
        drafter.sync_context(drafter.cached_tokens[:L])

    x = torch.randn(B * B, drafter.args.dim, device=dev, dtype=drafter.output.weight.dtype)
    full_head = target.output.weight.to(dev)
    cases = {
        "sync draft (2 new tokens + 16 masks)": sync_draft,
        "packed, all 16 candidates, head on all": packed(head=True),
        "packed, all 16 candidates, head on the chosen one": packed(),
        "packed, 8 likeliest candidates": packed(cands=list(range(8))),
        "packed, 4 likeliest candidates": packed(cands=list(range(4))),
        "packed, 16 candidates x 8 successor slots": packed(slots=8),
        f"head alone over {B * B} slots, draft vocab {drafter.output.weight.shape[0]}":
            lambda: drafter.output(x),
        f"head alone over {B * B} slots, full vocab {full_head.shape[0]}": lambda: x @ full_head.T,
    }
    for fn in cases.values():
        timed(fn, dev, 2)
    return {name: round(1000 * timed(fn, dev, iters), 2) for name, fn in cases.items()}


if __name__ == "__main__":
    main()
