"""How well a tree method's node scores predict verification, alone and under load.

Runs `--method` (lookup-tree or d3d-tree) in one process on `--lanes` generations at once (one Scheduler, as
`d3d bench --clients` does; 1: a single stream on the same scheduler), over the `d3d loadtest --throughput`
prompts, greedy, learning off. Every round it records the score (the estimated chance that verification reaches
the node) of each node the tree kept and whether verification reached it, and how many candidate nodes scored
at least --worth (about what a node must be accepted to pay at 8 lanes on a 2-core CPU). Prints and writes: per
score bucket the nodes kept and the share reached; per round the mean tree width, tokens committed and such
candidates available.

    python scripts/tree_calibration.py --lanes 1,8 --out results/tree_calibration_smol_cpu.json
"""
from __future__ import annotations

import argparse
import shlex
import sys
import threading

import torch

import d3d.decoding.tokentree as tokentree
import d3d.methods.tree as tree_methods
from d3d.atomic import atomic_write_json
from d3d.bench.batched import run_level
from d3d.bench.harness import machine_info
from d3d.corpus.prompts import encode_prompt
from d3d.decoding.verify import SamplingParams
from d3d.methods.catalog import make_runner
from d3d.runtime.loading import load_target
from d3d.server.loadtest_throughput import throughput_prompts


class Recorder:
    """Each round's ranked node scores (from TreeDraft.ranked, per generation thread), the kept ones' outcome
    (from TreeProposer.accept); `instrument` routes both to the recorder in use."""

    def __init__(self, worth: float):
        self.worth, self.local, self.lock = worth, threading.local(), threading.Lock()
        self.buckets = [[0.0, 0, 0] for _ in range(10)]  # per tenth of score: sum of scores, kept, reached
        self.widths, self.tokens, self.available = [], [], []

    def ranked(self, draft, ranked: list[int]) -> None:
        self.local.fits = [draft.nodes[i].score for i in ranked]

    def record(self, width: int, path: list[int]) -> None:
        fits = getattr(self.local, "fits", [])
        kept, reached = fits[:width - 1], set(path)  # select keeps a prefix of what it ranked
        with self.lock:
            for j, score in enumerate(kept):  # kept node j is tree node j + 1 (select keeps them in this order)
                b = self.buckets[min(9, int(score * 10))]
                b[0], b[1], b[2] = b[0] + score, b[1] + 1, b[2] + ((j + 1) in reached)
            self.widths.append(width)
            self.tokens.append(len(path) + 1)
            self.available.append(sum(s >= self.worth for s in fits))

    def summary(self) -> dict:
        n = max(1, len(self.widths))
        return {"rounds": len(self.widths), "mean_width": sum(self.widths) / n, "mean_tokens": sum(self.tokens) / n,
                "mean_available": sum(self.available) / n,
                "buckets": [{"score": f"{i / 10:.1f}-{(i + 1) / 10:.1f}", "kept": b[1],
                             "mean_score": b[0] / b[1], "reached": b[2] / b[1]}
                            for i, b in enumerate(self.buckets) if b[1]]}


def instrument() -> list:
    """Wrap TreeDraft.ranked and TreeProposer.accept once; returns the one-element list holding the recorder
    in use."""
    current: list[Recorder | None] = [None]
    ranked, accept = tokentree.TreeDraft.ranked, tree_methods.TreeProposer.accept

    def recorded_ranked(draft, budget, max_depth):
        out = ranked(draft, budget, max_depth)
        current[0].ranked(draft, out)
        return out

    def recorded_accept(proposer, tree, path):
        current[0].record(len(tree), path)
        return accept(proposer, tree, path)

    tokentree.TreeDraft.ranked = recorded_ranked
    tree_methods.TreeProposer.accept = recorded_accept
    return current


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--method", default="lookup-tree", choices=["lookup-tree", "d3d-tree"])
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worth", type=float, default=0.45)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(args.target)
    ids = [encode_prompt(tok, t) for t in throughput_prompts(args.requests)]
    levels = [int(n) for n in args.lanes.split(",")]
    out, current = {}, instrument()
    for lanes in levels:
        recorder = current[0] = Recorder(args.worth)
        summary, _ = run_level(model, lambda slot: make_runner(args.method, slot, tok, model_dir, learn=False), ids,
                               lanes, max(levels), SamplingParams(), args.max_new_tokens)
        out[lanes] = summary | recorder.summary()
        s = out[lanes]
        print(f"{lanes} lane(s): {s['aggregate_tokens_per_s']:.2f} tok/s, {s['rounds']} rounds, mean width "
              f"{s['mean_width']:.2f}, tokens per round {s['mean_tokens']:.2f}, candidates scoring >= {args.worth} "
              f"{s['mean_available']:.2f} per round", flush=True)
        for b in s["buckets"]:
            print(f"   score {b['score']}: {b['kept']} kept, mean score {b['mean_score']:.2f}, reached {b['reached']:.2f}")
    if args.out:
        atomic_write_json(args.out, {"command": "python scripts/tree_calibration.py " + shlex.join(sys.argv[1:]),
                                     "machine": machine_info("cpu"), "target": args.target, "method": args.method,
                                     "max_new_tokens": args.max_new_tokens, "requests": len(ids), "worth": args.worth,
                                     "lanes": out})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
