"""d3d's training loop under `accelerate launch` (what `accelerate launch -m d3d.cli train` runs): two CPU
processes (gloo) on the tiny drafter take different batches, keep identical weights after every step, and
a run resumed from its run folder ends exactly where an uninterrupted two-process run does."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher not installed")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, out_dir: Path, steps: int) -> list[dict]:
    """Two processes of tests/accelerate_train.py; their per-rank records."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]), "OMP_NUM_THREADS": "1",
                        "CUDA_VISIBLE_DEVICES": ""}  # CPU processes even where a GPU is present
    # --multi_gpu is accelerate's multi-process launcher (torchrun); with no GPU visible it runs on gloo
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(TESTS / "accelerate_train.py"),
           str(run_dir), str(out_dir), str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_processes_agree_step_by_step_and_resume_exactly(tmp_path):
    whole = launch(tmp_path / "whole", tmp_path / "whole-out", 6)
    assert len(whole[0]["hashes"]) == 6 and whole[0]["hashes"] == whole[1]["hashes"]  # same weights every step
    losses = [[h["loss"] for h in rank["history"]] for rank in whole]
    assert losses[0] != losses[1]  # each process trained on its own batches
    assert len(set(whole[0]["hashes"])) == 6  # and the weights moved every step

    first = launch(tmp_path / "resumed", tmp_path / "first-out", 3)
    assert first[0]["hashes"] == whole[0]["hashes"][:3]
    rest = launch(tmp_path / "resumed", tmp_path / "rest-out", 6)  # resumes from the state saved at step 3
    assert rest[0]["hashes"] == rest[1]["hashes"] == whole[0]["hashes"][3:]
    assert rest[0]["final"] == rest[1]["final"] == whole[0]["final"]
