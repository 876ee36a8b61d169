"""Run by tests/test_accelerate.py under `accelerate launch --multi_gpu --num_processes 2` on CPUs: trains the tiny D3D
drafter for STEPS steps in RUN_DIR (resuming from it if it holds a state) and writes, per process, the
history this process saw and a hash of the weights after every optimizer step to OUT_DIR/rank<i>.json.

usage: accelerate_train.py RUN_DIR OUT_DIR STEPS
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from torch.optim.optimizer import register_optimizer_step_post_hook

from d3d.training.train import TrainConfig, train
from helpers import tiny_examples, trainable_drafter


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(run_dir: Path, out_dir: Path, steps: int) -> None:
    torch.set_num_threads(1)
    model = trainable_drafter(seed=0)
    hashes: list[str] = []
    register_optimizer_step_post_hook(lambda *_: hashes.append(weights_hash(model)))
    cfg = TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup=2, blocks_per_seq=2, checkpoint_every=3)
    history = train(model, tiny_examples(), cfg, run_dir, log=lambda *_: None)
    rank = PartialState().process_index
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"history": history, "hashes": hashes,
                                                          "final": weights_hash(model)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
