"""Resuming training never unpickles code, and `d3d data` checks its numbers before loading a model."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from d3d.training.batches import TrainConfig
from d3d.errors import D3DError
from d3d.training.train import train

from helpers import tiny_examples, trainable_drafter

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_crafted_state_file_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "state.pt").write_bytes(pickle.dumps({"model": Payload()}))
    with pytest.raises(D3DError, match="cannot resume from .*state.pt"):
        train(trainable_drafter(), tiny_examples(), TrainConfig(steps=1, batch_size=1), run, log=lambda m: None)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--shard-size", "--batch-size", "--max-new-tokens", "--max-tokens"])
def test_data_numbers_are_checked_before_the_model_loads(tmp_path, option):
    r = subprocess.run([sys.executable, "-m", "d3d.cli", "data", "--out", str(tmp_path / "d"), option, "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"d3d: error: {option} must be > 0 (got 0)"


def test_damaged_inputs_are_one_line_errors(tmp_path, smol):
    from d3d.bench.harness import read_prompts_file
    from d3d.corpus.datastore import SHIPPED, load_datastore
    from d3d.drafters.files import load_drafter

    model, tok, _ = smol
    truncated = tmp_path / "t.npz"
    truncated.write_bytes((SHIPPED / "SmolLM2-135M-Instruct.npz").read_bytes()[:30000])
    with pytest.raises(D3DError, match="is not a d3d datastore, or is truncated"):
        load_datastore(truncated)
    latin = tmp_path / "p.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(D3DError, match="is not UTF-8 text"):
        read_prompts_file(latin)
    for text in ('{"args": ', '["not", "an", "object"]', '{"args": {}, "colour": "red"}'):
        (tmp_path / "d").mkdir(exist_ok=True)
        (tmp_path / "d" / "drafter.json").write_text(text)
        with pytest.raises(D3DError, match="is not a valid drafter config"):
            load_drafter(tmp_path / "d", model, tok)
