"""The token-shift drafter converted from a whole pretrained LM: layout, initialisation from the target,
delta checkpoints, losslessness in d3d and d3d-async."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3d.training.batches import TrainConfig, make_batch, vocab_map_for
from d3d.drafters.convert import drafter_from_target
from d3d.drafters.files import load_drafter, save_drafter, weight_files
from d3d.decoding.engine import generate
from d3d.decoding.packed import keep_prefix, packed_draft
from d3d.methods.d3d import D3DProposer
from d3d.runtime.target import Transformer
from d3d.training.train import train_drafter
from helpers import TINY, tiny_examples, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_target() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY).eval().requires_grad_(False)


def shift_drafter(target: Transformer, block_size: int = 4):
    d = drafter_from_target(target, tiny_tokenizer(), "tiny", list(range(target.args.n_layers)), block_size,
                            shift=True)
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def whole(smol):
    model, tok, _ = smol
    return drafter_from_target(model, tok, "SmolLM2-135M-Instruct", list(range(model.args.n_layers)), 16,
                               shift=True).eval().requires_grad_(False)


def test_slot0_is_the_pretrained_next_token_and_masks_see_context_and_each_other(tiny_target):
    d = shift_drafter(tiny_target)
    seq = [random.Random(0).randrange(2, TINY.vocab_size) for _ in range(12)]
    d.setup_cache(1, 64)
    logits = d.draft_block(seq)
    assert logits.shape[0] == d.block_size and d.cache_len == len(seq)
    assert torch.allclose(logits[0], tiny_target(torch.tensor([seq]))[0, -1], atol=1e-5)
    # the masks see the context (changing an early token moves them) and each other (the same masks
    # without the last one differ), and the slots do not leak into the cache
    d.setup_cache(1, 64)
    d.cached_tokens = []
    other = d.draft_block([seq[0] + 1 if seq[0] + 1 < TINY.vocab_size else 2] + seq[1:])
    assert not torch.allclose(logits[1:], other[1:])
    again = d.draft_block(seq)
    assert torch.allclose(again, logits, atol=1e-5)


def test_shift_training_layout_equals_inference(tiny_target):
    """A training block anchored at c computes the same slot logits as draft_block after seq[:c + 1],
    and slot k is supervised with token c + 1 + k."""
    d = shift_drafter(tiny_target)
    ex = tiny_examples(1)
    seq = ex[0].prompt_ids + ex[0].response_ids
    b = make_batch(ex, TrainConfig(blocks_per_seq=3), d.block_size, vocab_map_for(d), d.mask_id,
                   random.Random(0), shift=True)
    h, _ = d.hidden(b.tokens, mask=b.mask, positions=b.positions)
    slot_logits = d.head(h.reshape(-1, h.shape[-1])[b.slot_index])
    T = b.tokens.shape[1]
    anchors = {}
    for row, (flat, k) in enumerate(zip(b.slot_index.tolist(), b.slot_k.tolist())):
        block = int(b.slot_block[row])
        if k == 0:
            anchors[block] = flat % T  # slot 0 sits on the clean anchor itself
        c = anchors[block]
        assert seq[c + 1 + k] == int(b.slot_target[row])
        d.setup_cache(1, 128)
        d.cached_tokens = []
        assert torch.allclose(slot_logits[row], d.draft_block(seq[:c + 1])[k], atol=1e-4)
    assert b.tokens.shape[1] == len(seq) + 3 * (d.block_size - 1)  # B - 1 masks per block


def test_packed_candidates_equal_synchronous_drafts(tiny_target):
    d = shift_drafter(tiny_target, block_size=5)
    ctx = [random.Random(1).randrange(2, TINY.vocab_size) for _ in range(9)]
    V = [3, 7, 9, 4, 11]
    d.setup_cache(1, 128)
    d.draft_block(ctx + V[:1])
    keep_prefix(d, len(ctx))
    cands = [0, 2, 4]
    out = packed_draft(d, V, cands, d.block_size)
    assert out.shape[:2] == (len(cands), d.block_size)
    for i, a in enumerate(cands):
        keep_prefix(d, len(ctx))
        assert torch.allclose(out[i], d.draft_block(ctx + V[:a + 1]), atol=1e-5)


def test_delta_checkpoint_stores_only_trained_layers_and_reloads_exactly(tmp_path, tiny_target):
    d = shift_drafter(tiny_target)
    d.cfg.from_target = [0]
    with torch.no_grad():
        for p in d.layers[1].parameters():
            p.add_(0.01 * torch.randn_like(p))
        d.mask_embedding.add_(0.1)
    save_drafter(d, tmp_path / "dr", dtype=torch.float32, max_file_mb=0.02)
    files = weight_files(tmp_path / "dr")
    assert len(files) > 1 and all(f.stat().st_size <= 0.02 * 2**20 for f in files)
    from safetensors.torch import load_file
    stored = set().union(*(load_file(f).keys() for f in files))
    assert not any(k.startswith("layers.0.") for k in stored) and "layers.1.attention.wqkv.weight" in stored
    assert "tok_embeddings.weight" not in stored and "mask_embedding" in stored
    back = load_drafter(tmp_path / "dr", tiny_target, tiny_tokenizer())
    assert back.cfg == d.cfg and back.layers[0].attention.wqkv is tiny_target.layers[0].attention.wqkv
    for (k, a), b in zip(d.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
    save_drafter(back, tmp_path / "again", dtype=torch.float32)
    again = load_drafter(tmp_path / "again", tiny_target, tiny_tokenizer())
    seq = [5, 6, 7, 8, 9, 10]
    logits = []
    for m in (d, back, again):
        m.setup_cache(1, 64)
        m.cached_tokens = []
        logits.append(m.draft_block(seq))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)  # a loaded drafter may run other (packed) kernels
    assert torch.equal(logits[1], logits[2])


def test_whole_target_drafts_the_targets_greedy_token_first(smol, prompt_ids, whole):
    model, tok, _ = smol
    for ids in prompt_ids[:3]:
        model.setup_cache(1, len(ids) + 1)
        greedy = int(model(torch.tensor([ids]), last_only=True)[0, -1].argmax())
        whole.setup_cache(1, len(ids) + 17)
        whole.cached_tokens = []
        assert int(whole.draft_block(ids)[0].argmax()) == greedy


def test_whole_drafter_greedy_is_identical_to_ar_in_d3d_and_d3d_async(smol, prompt_ids, whole):
    from d3d.decoding.async_engine import generate_async

    model, tok, _ = smol
    proposer = D3DProposer(whole, model.args.vocab_size)
    for ids in prompt_ids[:2]:
        ar = generate(model, tok, ids, max_new_tokens=24)
        sync = generate(model, tok, ids, max_new_tokens=24, proposer=proposer, block_size=whole.block_size)
        assert sync.token_ids == ar.token_ids
        assert min(sync.acceptance_lengths[:-1]) >= 2  # the first draft token is the target's own
        # the packed pass of a 30-layer drafter is costly at 1 thread: pack the 3 likeliest outcomes
        asyn = generate_async(model, tok, ids, max_new_tokens=16, drafter=whole, max_candidates=3)
        assert asyn.token_ids == ar.token_ids[:16] and asyn.stats["packed_hits"] > 0


def test_train_init_model_target_writes_a_small_delta_checkpoint(tmp_path, smol):
    model, tok, _ = smol
    cfg = TrainConfig(steps=1, batch_size=1, lr=1e-4, warmup=0, blocks_per_seq=2, freeze_below=29)
    summary = train_drafter(None, ROOT / "data" / "distill", tmp_path / "w", tmp_path / "w.run", None, 0, 16, cfg,
                            heldout=1, max_shards=1, init_model="target", max_file_mb=16)
    saved = json.loads((tmp_path / "w" / "drafter.json").read_text())
    assert summary["init_model"] == "target" and saved["shift"] and saved["from_target"] == list(range(29))
    files = weight_files(tmp_path / "w")
    assert files and all(f.stat().st_size <= 16 * 2**20 for f in files)
    d = load_drafter(tmp_path / "w", model, tok)
    assert len(d.layers) == model.args.n_layers and d.layers[0].feed_forward is model.layers[0].feed_forward


@pytest.mark.slow
def test_init_model_bad_input_is_a_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "d3d.cli", "train", "--out", str(tmp_path / "x"), "--init-model",
                        "--kind", "ar", "--data", str(ROOT / "data" / "distill")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("d3d: error: --init-model")
