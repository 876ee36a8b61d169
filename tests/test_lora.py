"""LoRA conversion (d3d.drafters.lora): adapters over a whole pretrained model, checkpoints that store only the
factors, loading that merges them into the base model's weights."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3d.training.batches import TrainConfig, draft_vocabulary
from d3d.corpus.data import load_dataset
from d3d.drafters.files import load_drafter, save_drafter, weight_files
from d3d.drafters.lora import LoRALinear
from d3d.training.train import init_model_drafter, train_drafter, trainable_parameters

ROOT = Path(__file__).resolve().parents[1]


def test_lora_linear_starts_as_its_base_and_merges_to_its_output():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6, bias=True)
    x = torch.randn(3, 8)
    before = base(x)
    m = LoRALinear(base, rank=2)
    assert torch.equal(m(x), before)
    torch.nn.init.normal_(m.lora_b)
    adapted = m(x)
    assert not torch.allclose(adapted, before)
    assert torch.allclose(m.merged()(x), adapted, atol=1e-5)


def test_lora_drafter_trains_only_adapters_and_round_trips_through_a_small_checkpoint(tmp_path, smol):
    model, tok, model_dir = smol
    d = init_model_drafter(model, tok, "SmolLM2-135M-Instruct", model_dir, str(model_dir), None, 16, None,
                           freeze_below=28, lora_rank=4)
    params = trainable_parameters(d)
    names = {n for n, p in d.named_parameters() if p.requires_grad}
    assert names == {"mask_embedding"} | {f"layers.{i}.{m}.{f}" for i in (28, 29) for f in ("lora_a", "lora_b")
                                          for m in ("attention.wqkv", "attention.wo", "feed_forward.w13",
                                                    "feed_forward.w2")}
    assert sum(p.numel() for p in params) < 200_000
    with torch.no_grad():  # a trained-looking update, rounded to the checkpoint's fp16
        for n, p in d.named_parameters():
            if n.endswith("lora_b"):
                p.copy_((torch.randn_like(p) * 0.02).half().float())
            if n.endswith("lora_a"):
                p.copy_(p.half().float())
        d.mask_embedding.copy_(d.mask_embedding.half().float())
    d.eval().setup_cache(1, 64)
    expected = d.draft_block([1, 504, 3203, 28, 2683, 314])
    save_drafter(d, tmp_path / "lora")
    saved = json.loads((tmp_path / "lora" / "drafter.json").read_text())
    assert saved["lora_rank"] == 4 and saved["base_model"] == str(model_dir)
    assert sum(f.stat().st_size for f in weight_files(tmp_path / "lora")) < 1_000_000  # factors only
    loaded = load_drafter(tmp_path / "lora", model, tok)
    loaded.setup_cache(1, 64)
    got = loaded.draft_block([1, 504, 3203, 28, 2683, 314])
    assert torch.allclose(got, expected, atol=1e-3, rtol=1e-4)
    assert not torch.allclose(expected, init_model_drafter(
        model, tok, "SmolLM2-135M-Instruct", model_dir, str(model_dir), None, 16, None).eval().draft_block(
        [1, 504, 3203, 28, 2683, 314]), atol=1e-2)  # the adapters changed the drafts


def test_train_with_lora_rank_resumes_and_writes_factors(tmp_path, smol):
    _, _, model_dir = smol
    cfg = TrainConfig(steps=2, batch_size=1, lr=1e-3, warmup=0, blocks_per_seq=2, freeze_below=29,
                      checkpoint_every=1)
    summary = train_drafter(None, ROOT / "data" / "distill", tmp_path / "w", tmp_path / "w.run", None, 512, 16, cfg,
                            heldout=1, max_shards=1, init_model=str(model_dir), lora_rank=2)
    assert summary["steps_done"] == 2 and summary["heldout_after"]["loss"] != summary["heldout_before"]["loss"]
    keys = torch.load(tmp_path / "w.run" / "state.pt", weights_only=True)["model"].keys()
    assert any(k.endswith(".lora_b") for k in keys) and not any(k.endswith(".weight") for k in keys)

    # resuming over more data keeps the run's draft vocabulary (the more data's own would differ)
    first_ids = torch.load(tmp_path / "w.run" / "state.pt", weights_only=True)["model"]["draft_ids"]
    more = load_dataset(ROOT / "data" / "distill", 2)[:-1]
    model, tok, _ = smol
    assert not torch.equal(draft_vocabulary(more, 512, model.args.vocab_size, [tok.eos_token_id]), first_ids)
    summary = train_drafter(None, ROOT / "data" / "distill", tmp_path / "w", tmp_path / "w.run", None, 512, 16,
                            TrainConfig(**(cfg.__dict__ | {"steps": 3})), heldout=1, max_shards=2,
                            init_model=str(model_dir), lora_rank=2)
    assert summary["steps_done"] == 3
    assert torch.equal(load_drafter(tmp_path / "w", model, tok).draft_ids, first_ids)

    # --init of a LoRA drafter trains its adapters on from its files alone (no run folder), at a higher rank if asked
    from d3d.errors import D3DError
    from d3d.training.train import continued_lora_drafter

    prompt = [1, 504, 3203, 28, 2683, 314]
    saved = load_drafter(tmp_path / "w", model, tok)
    saved.setup_cache(1, 64)
    went_on = continued_lora_drafter(tmp_path / "w", model, tok, "SmolLM2-135M-Instruct", model_dir, 29, lora_rank=4)
    assert went_on.layers[29].attention.wqkv.lora_a.shape[0] == 4 and went_on.cfg.lora_rank == 4
    assert torch.equal(went_on.draft_ids, first_ids)
    went_on.eval().setup_cache(1, 64)
    assert torch.allclose(went_on.draft_block(prompt), saved.draft_block(prompt), atol=1e-3, rtol=1e-4)
    with pytest.raises(D3DError, match="would drop the trained adapters of layers 29..29"):
        continued_lora_drafter(tmp_path / "w", model, tok, "SmolLM2-135M-Instruct", model_dir, 30)
    trained = summary
    summary = train_drafter(None, ROOT / "data" / "distill", tmp_path / "v", tmp_path / "v.run", None, 512, 16,
                            TrainConfig(**(cfg.__dict__ | {"steps": 1})), heldout=1, max_shards=2,
                            init=tmp_path / "w", lora_rank=4)
    assert summary["steps_done"] == 1 and summary["init_training"]["steps_done"] == 3
    # it starts where the files left it (their factors are stored in fp16)
    assert summary["heldout_before"]["loss"] == pytest.approx(trained["heldout_after"]["loss"], rel=1e-3)
    assert json.loads((tmp_path / "v" / "drafter.json").read_text())["lora_rank"] == 4


@pytest.mark.slow
def test_lora_rank_without_a_base_model_is_a_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "d3d.cli", "train", "--out", str(tmp_path / "x"), "--init-model",
                        "--lora-rank", "8", "--data", str(ROOT / "data" / "distill")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("d3d: error: --lora-rank")
