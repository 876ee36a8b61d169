"""Plain decoding (`ar`) of the new runtime against the previous one, paired prompt by prompt.

The previous runtime is the same model with its linear layers switched back to plain nn.Linear
(F.linear on the row-major [out, in] weight), which is what d3d ran before the prepacked kernels;
everything else is shared. For each prompt both run in turn (previous, new, and optionally int8),
greedy; the script records decode tokens/s, the per-prompt ratio new / previous, and whether the
tokens are identical (they must be: the same fp32 model).

    python scripts/runtime_speedup.py --benchmarks gsm8k,humaneval,mt-bench --limit 3 --threads 2 \
        --max-new-tokens 128 --out results/runtime_speedup_cpu.json
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn as nn

from d3d.bench.harness import machine_info
from d3d.atomic import atomic_write_json
from d3d.runtime.fastpath import PackedLinear
from d3d.runtime.loading import load_target
from d3d.methods.catalog import make_runner
from d3d.corpus.prompts import MultiTurn, benchmark_prompts, encode_prompt


def unpacked(model: nn.Module, on: bool) -> None:
    """Switch the model's PackedLinear layers to plain nn.Linear (on) or back (off), in place."""
    for m in model.modules():
        if type(m) in (nn.Linear, PackedLinear):
            m.__class__ = nn.Linear if on else PackedLinear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--benchmarks", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="also time the --quantize int8 target")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(None)
    ar = make_runner("ar", model, tok, model_dir)
    runners = {"previous": lambda ids, n: _run(model, ar, ids, n, True), "new": lambda ids, n: _run(model, ar, ids, n, False)}
    if args.int8:
        q, _, _ = load_target(None, quantize="int8")
        q_ar = make_runner("ar", q, tok, model_dir)
        runners["int8"] = lambda ids, n: q_ar(ids, max_new_tokens=n)
    rows = []
    for bench in args.benchmarks.split(","):
        for item in benchmark_prompts(bench, args.limit):
            ids = encode_prompt(tok, item.turns[0] if isinstance(item, MultiTurn) else item)
            for r in runners.values():
                r(ids, 4)  # warm-up
            res = {name: r(ids, args.max_new_tokens) for name, r in runners.items()}
            row = {"benchmark": bench, "tokens": res["new"].new_tokens,
                   "identical_to_previous": res["new"].token_ids == res["previous"].token_ids}
            row |= {f"{name}_tok_s": round(r.tokens_per_s, 2) for name, r in res.items()}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    summary = {"median_new_over_previous": round(statistics.median(r["new_tok_s"] / r["previous_tok_s"] for r in rows), 3),
               "median_tok_s": {n: statistics.median(r[f"{n}_tok_s"] for r in rows) for n in runners},
               "all_identical": all(r["identical_to_previous"] for r in rows)}
    if args.int8:
        summary["median_int8_over_new"] = round(statistics.median(r["int8_tok_s"] / r["new_tok_s"] for r in rows), 3)
    print(summary)
    atomic_write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": machine_info("cpu"),
                                 "summary": summary, "per_prompt": rows})


def _run(model, ar, ids, n, previous: bool):
    unpacked(model, previous)
    try:
        return ar(ids, max_new_tokens=n)
    finally:
        unpacked(model, False)


if __name__ == "__main__":
    main()
