"""Acceptance length of several D3D drafters per benchmark, from one set of target continuations.

At temperature 0 the tau of a `d3d` run is a function of the drafter and of the target's greedy output
(d3d.estimate, tested against real runs), so the target's continuations are generated once (cached in
--cache) and every drafter is replayed against them: a same-prompts comparison in minutes.

    python scripts/compare_drafters.py --drafters v0=src/d3d/assets/drafters/SmolLM2-135M-Instruct \
        lambda0=runs/d3d-v0-lambda0/drafter --limit 4 --out results/ablation_lambda.json
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from d3d.bench import machine_info
from d3d.data import atomic_write_json
from d3d.drafter import load_drafter, weights_fingerprint
from d3d.estimate import benchmark_continuations, mean_tau
from d3d.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", nargs="+", required=True, help="NAME=PATH ...")
    ap.add_argument("--benchmarks", default="gsm8k,math500,humaneval,mt-bench")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache", default="runs/continuations.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, _ = load_target(None)
    conts = benchmark_continuations(model, tok, args.benchmarks.split(","), args.limit, args.max_new_tokens,
                                    Path(args.cache))
    table = {}
    for spec in args.drafters:
        name, path = spec.split("=", 1)
        d = load_drafter(path, model, tok)
        row = {"path": path, "weights": weights_fingerprint(path), "layers": len(d.layers),
               "training": d.cfg.training.get("command"), "heldout_teacher_forced": d.cfg.training.get("heldout_after")}
        for b, pairs in conts.items():
            row[b] = round(mean_tau(d, [p for p, _ in pairs], [c for _, c in pairs], args.max_new_tokens), 4)
        row["mean"] = round(sum(row[b] for b in conts) / len(conts), 4)
        table[name] = row
        print(name, {k: v for k, v in row.items() if k in conts or k == "mean"}, file=sys.stderr)
    atomic_write_json(Path(args.out), {"command": "python " + shlex.join(sys.argv), "machine": machine_info("cpu"),
                                       "what": "estimated greedy d3d tau (replay against the target's continuations)",
                                       "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                                       "drafters": table})


if __name__ == "__main__":
    main()
