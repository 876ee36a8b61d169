"""Which target layers should initialise a 4-layer drafter? Train each candidate briefly, same budget.

    python scripts/drafter_init.py --steps 16 --out results/drafter_init.json
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from d3d.data import atomic_write_json, load_dataset
from d3d.drafter import drafter_from_target
from d3d.target import load_target
from d3d.train import TrainConfig, draft_vocabulary, evaluate, train

CANDIDATES = ([26, 27, 28, 29], [0, 1, 2, 3], [0, 10, 20, 29], [0, 1, 28, 29])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/distill")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load_target(None)
    examples = load_dataset(args.data)
    train_set, held = examples[:-64], examples[-64:]
    draft_ids = draft_vocabulary(train_set, 8192, model.args.vocab_size, [tok.eos_token_id])
    cfg = TrainConfig(batch_size=8, steps=args.steps, checkpoint_every=10**9, warmup=3, lr=1e-3,
                      max_prompt_tokens=64, blocks_per_seq=8)
    results = {}
    for layers in CANDIDATES:
        drafter = drafter_from_target(model, tok, "SmolLM2-135M-Instruct", layers, draft_ids=draft_ids)
        run = Path(tempfile.mkdtemp())
        hist = train(drafter, train_set, cfg, run, log=lambda *_: None)
        shutil.rmtree(run)
        results[str(layers)] = {"last4_train_loss": sum(h["loss"] for h in hist[-4:]) / 4,
                                "heldout": evaluate(drafter, held, cfg)}
        print(layers, results[str(layers)], flush=True)
    atomic_write_json(Path(args.out), {"command": "python " + shlex.join(sys.argv), "train_config": cfg.__dict__,
                                       "examples": len(train_set), "results": results})


if __name__ == "__main__":
    main()
