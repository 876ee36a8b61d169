"""End-to-end tokens/s of one method with several drafters, interleaved per prompt in one run.

The question it answers: does a drafter change (pruning, longer training) make `d3d-async` / `d3d`
faster on this machine? Plain decoding runs on every prompt too, as the reference.

    python scripts/drafter_speed.py --method d3d-async --drafters before=runs/d3d-6l/drafter \
        after=runs/d3d-6l-pruned --benchmarks gsm8k,mt-bench --limit 3 --out results/prune/speed.json
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch

from d3d.bench import machine_info
from d3d.data import atomic_write_json
from d3d.drafter import weights_fingerprint
from d3d.engine import generate
from d3d.methods import make_runner
from d3d.prompts import benchmark_prompts, first_turn
from d3d.target import encode_prompt, load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="d3d-async", choices=("d3d", "d3d-async"))
    ap.add_argument("--drafters", nargs="+", required=True, help="NAME=PATH ...")
    ap.add_argument("--benchmarks", default="gsm8k,mt-bench")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(None)
    runners = {"ar": lambda ids, **kw: generate(model, tok, ids, **kw)}
    for spec in args.drafters:
        name, path = spec.split("=", 1)
        runners[name] = make_runner(args.method, model, tok, model_dir, drafter=path)
    prompts = [encode_prompt(tok, first_turn(it))
               for b in args.benchmarks.split(",") for it in benchmark_prompts(b, args.limit)]
    for run in runners.values():  # warm-up
        run(prompts[0], max_new_tokens=8)
    rows = []
    for i, ids in enumerate(prompts):
        out = {name: run(ids, max_new_tokens=args.max_new_tokens) for name, run in runners.items()}
        row = {"prompt": i, **{f"{n}_tokens_per_s": round(r.tokens_per_s, 2) for n, r in out.items()},
               **{f"{n}_tau": round(r.tau, 3) for n, r in out.items() if n != "ar"},
               "lossless": all(r.token_ids == out["ar"].token_ids for r in out.values())}
        rows.append(row)
        print(row, file=sys.stderr)
    names = [n for n in runners if n != "ar"]
    summary = {n: {"median_speedup_vs_ar": statistics.median(r[f"{n}_tokens_per_s"] / r["ar_tokens_per_s"]
                                                            for r in rows),
                   "mean_tau": round(statistics.fmean(r[f"{n}_tau"] for r in rows), 3)} for n in names}
    if len(names) == 2:
        a, b = names
        summary[f"median_{b}_over_{a}"] = statistics.median(r[f"{b}_tokens_per_s"] / r[f"{a}_tokens_per_s"]
                                                            for r in rows)
    atomic_write_json(args.out, {"command": "python " + shlex.join(sys.argv), "machine": machine_info("cpu"),
                                 "method": args.method, "max_new_tokens": args.max_new_tokens,
                                 "drafters": {n: {"path": p, "weights": weights_fingerprint(p)}
                                              for n, p in (s.split("=", 1) for s in args.drafters)},
                                 "summary": summary,
                                 "per_prompt": rows})
    print(summary)


if __name__ == "__main__":
    main()
