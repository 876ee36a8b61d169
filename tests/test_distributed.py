"""Training in several processes (torchrun, gloo on the CPU): each process takes its own batches, the
gradients are averaged, every process ends with the same weights and one of them writes the drafter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_cpu_processes_train_one_drafter(tmp_path):
    out, run = tmp_path / "w", tmp_path / "w.run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "d3d.cli",
                        "train", "--data", str(ROOT / "data" / "distill"), "--max-shards", "1", "--heldout", "2",
                        "--layers", "29", "--draft-vocab", "512", "--steps", "2", "--batch-size", "1",
                        "--out", str(out), "--run-dir", str(run), "--threads", "1"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    history = json.loads((run / "history.json").read_text())
    assert history[-1]["step"] == 2 and history[-1]["examples"] == 4  # 2 steps x 1 example x 2 processes
    assert (out / "drafter.json").exists() and json.loads((run / "summary.json").read_text())["steps_done"] == 2
