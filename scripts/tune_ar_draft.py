"""The ar-draft baseline's draft length: adaptive k (the default) against fixed k, interleaved per prompt.

    python scripts/tune_ar_draft.py --benchmarks gsm8k,mt-bench --limit 2 --out results/tune_ar_draft.json
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from functools import partial

import torch

from d3d.ardraft import ARDraftProposer
from d3d.bench import machine_info
from d3d.data import atomic_write_json
from d3d.drafter import load_drafter
from d3d.engine import generate
from d3d.methods import BASELINE_SUFFIX, default_drafter
from d3d.prompts import benchmark_prompts, first_turn
from d3d.target import encode_prompt, load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--benchmarks", default="gsm8k,mt-bench")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(None)
    d = load_drafter(default_drafter(model_dir, BASELINE_SUFFIX["ar-draft"]), model, tok)
    V = model.args.vocab_size
    variants = {"adaptive (k0=4)": ARDraftProposer(d, V), **{f"fixed k={k}": ARDraftProposer(d, V, k=k, adaptive=False)
                                                             for k in (1, 2, 4, 8)}}
    runners = {"ar": partial(generate, model, tok)}
    runners |= {n: partial(generate, model, tok, proposer=p) for n, p in variants.items()}
    prompts = [encode_prompt(tok, first_turn(it))
               for b in args.benchmarks.split(",") for it in benchmark_prompts(b, args.limit)]
    for run in runners.values():
        run(prompts[0], max_new_tokens=8)
    rows = []
    for ids in prompts:
        out = {n: run(ids, max_new_tokens=args.max_new_tokens) for n, run in runners.items()}
        assert all(r.token_ids == out["ar"].token_ids for r in out.values())
        rows.append({n: {"tokens_per_s": round(r.tokens_per_s, 2), "tau": round(r.tau, 3)} for n, r in out.items()})
        print(rows[-1], file=sys.stderr)
    summary = {n: {"median_speedup_vs_ar": round(statistics.median(r[n]["tokens_per_s"] / r["ar"]["tokens_per_s"]
                                                                   for r in rows), 3),
                   "mean_tau": round(statistics.fmean(r[n]["tau"] for r in rows), 3)} for n in variants}
    atomic_write_json(args.out, {"command": "python " + shlex.join(sys.argv), "machine": machine_info("cpu"),
                                 "summary": summary, "per_prompt": rows, "lossless": True})
    print(summary)


if __name__ == "__main__":
    main()
