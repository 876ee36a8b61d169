"""The D3D drafter: attention layout, training, checkpoints, cache consistency, losslessness."""
import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3d.training import train as train_mod
from d3d.training.batches import TrainConfig, block_layout, make_batch, vocab_map_for
from d3d.corpus.data import load_dataset
from d3d.drafters.convert import drafter_from_target
from d3d.drafters.drafter import tokenizer_fingerprint
from d3d.drafters.files import load_drafter, save_drafter
from d3d.decoding.engine import generate
from d3d.errors import D3DError
from d3d.training.losses import teacher_log_probs
from d3d.methods.catalog import DEFAULT_DRAFTERS
from d3d.corpus.prompts import benchmark_prompt_hashes
from d3d.methods.d3d import D3DProposer
from d3d.runtime.target import Transformer
from d3d.training.train import dropped_layers, train
from helpers import TINY, drafted_rounds, tiny_examples, tiny_tokenizer, trainable_drafter

ROOT = Path(__file__).resolve().parents[1]


def test_block_layout_who_attends_to_whom():
    positions, mask, block_of, _ = block_layout([6], [[2, 4]], B=3)
    m = mask[0]
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 5, 6, 7]
    assert m[3, :4].all() and not m[3, 4:].any()                  # clean token 3: causal
    first = range(6, 9)                                             # block anchored at c = 2
    for q in first:
        assert m[q, :3].all() and not m[q, 3:6].any()               # context 0..2 only
        assert m[q, 6:9].all() and not m[q, 9:].any()               # its own block, bidirectional
    for q in range(9, 12):                                          # block anchored at c = 4
        assert m[q, :5].all() and not m[q, 5:9].any() and m[q, 9:].all()
    assert not m[:6, 6:].any()                                      # clean tokens never see slots


def test_padding_is_invisible():
    _, mask, _, _ = block_layout([3, 5], [[1], [1, 3]], B=2)
    m = mask[0]  # row 0: clean length 3 of 5, one real block (slots 5, 6) and one empty block (7, 8)
    for pad in (3, 4, 7, 8):
        others = [q for q in range(9) if q != pad]
        assert not m[others, pad].any()
        assert m[pad, pad]  # a pad sees itself, so no softmax row is empty


def test_loss_decreases_on_tiny_model(tmp_path):
    d = trainable_drafter()
    ex = tiny_examples()
    cfg = TrainConfig(steps=60, batch_size=8, lr=1e-2, warmup=5, blocks_per_seq=4, checkpoint_every=100)
    hist = train(d, ex, cfg, tmp_path / "run", log=lambda *_: None)
    first, last = sum(h["loss"] for h in hist[:5]) / 5, sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert hist[-1]["tau"] > hist[0]["tau"]


def test_bf16_training_follows_fp32_and_keeps_fp32_weights(tmp_path):
    """--bf16: the products in bfloat16, everything stored in fp32; the first step's loss is fp32's to bf16's
    precision, and it learns as fp32 does."""
    ex = tiny_examples()
    cfg = TrainConfig(steps=30, batch_size=8, lr=1e-2, warmup=5, blocks_per_seq=4, checkpoint_every=100)
    fp32 = train(trainable_drafter(), ex, cfg, tmp_path / "a", log=lambda *_: None)
    d = trainable_drafter()
    bf16 = train(d, ex, dataclasses.replace(cfg, bf16=True), tmp_path / "b", log=lambda *_: None)
    assert abs(bf16[0]["loss"] - fp32[0]["loss"]) < 0.02 * fp32[0]["loss"], (bf16[0], fp32[0])
    assert bf16[0]["loss"] != fp32[0]["loss"]  # the products did run in bfloat16
    last = [sum(h["loss"] for h in run[-5:]) / 5 for run in (fp32, bf16)]
    assert last[1] < 0.6 * sum(h["loss"] for h in bf16[:5]) / 5 and abs(last[1] - last[0]) < 0.1 * last[0], last
    assert all(p.dtype == torch.float32 for p in d.parameters())


def test_training_resumes_exactly_after_a_kill(tmp_path, monkeypatch):
    ex = tiny_examples()
    cfg = TrainConfig(steps=6, batch_size=4, lr=1e-3, warmup=2, blocks_per_seq=3, checkpoint_every=2)
    straight = trainable_drafter()
    train(straight, ex, cfg, tmp_path / "a", log=lambda *_: None)

    calls = {"n": 0}
    real = train_mod.atomic_write_json

    def dies_after_step_4(path, obj):
        real(path, obj)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "atomic_write_json", dies_after_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(trainable_drafter(), ex, cfg, tmp_path / "b", log=lambda *_: None)
    monkeypatch.setattr(train_mod, "atomic_write_json", real)
    resumed = trainable_drafter()
    hist = train(resumed, ex, cfg, tmp_path / "b", log=lambda *_: None)
    assert len(hist) == 6
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def test_layer_drop_draws_are_reproducible_never_empty_the_stack_and_hit_the_rate():
    assert all(dropped_layers(4, 0.0, step, 0) == set() for step in range(50))
    draws = [dropped_layers(4, 0.3, step, 0) for step in range(4000)]
    assert draws == [dropped_layers(4, 0.3, step, 0) for step in range(4000)]
    assert all(len(d) < 4 and d <= {0, 1, 2, 3} for d in draws)
    for layer in range(4):
        rate = sum(layer in d for d in draws) / len(draws)
        assert 0.27 < rate < 0.33, (layer, rate)
    assert draws != [dropped_layers(4, 0.3, step, 1) for step in range(4000)]
    assert all(len(dropped_layers(2, 0.99, step, 0)) == 1 for step in range(50))


def test_layer_drop_training_leaves_the_skipped_layers_untouched_that_step(tmp_path):
    seed = next(s for s in range(100) if dropped_layers(2, 0.5, 0, s) == {1})
    cfg = TrainConfig(steps=1, batch_size=4, lr=1e-2, warmup=0, blocks_per_seq=3, layer_drop=0.5, seed=seed)
    d = trainable_drafter()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    hist = train(d, tiny_examples(), cfg, tmp_path / "run", log=lambda *_: None)
    assert hist[0]["dropped"] == [1]
    after = d.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("layers.1."))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("layers.0."))
    assert len(d.layers) == 2


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    target = Transformer(TINY)
    d = drafter_from_target(target, tiny_tokenizer(), "tiny", [1], 4, draft_ids=torch.tensor([1, 3, 5, 7, 9]))
    with torch.no_grad():
        for p in d.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_drafter(d, tmp_path / "dr", dtype=torch.float32)
    back = load_drafter(tmp_path / "dr", target, tiny_tokenizer())
    assert back.cfg == d.cfg
    for (k, a), b in zip(d.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
    save_drafter(d, tmp_path / "dr")  # overwrite in place, atomically
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dr"]
    mask = os.umask(0o022)  # written as under a usual umask, not private as temp files are born
    try:
        save_drafter(d, tmp_path / "dr")
    finally:
        os.umask(mask)
    assert (tmp_path / "dr").stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "dr").iterdir()} == \
        {"drafter.safetensors": 0o644, "drafter.json": 0o644}


def test_train_can_fine_tune_a_shipped_drafter(tmp_path, smol):
    from d3d.training.train import train_drafter

    shipped, data = DEFAULT_DRAFTERS / "SmolLM2-135M-Instruct", Path(__file__).resolve().parents[1] / "data" / "distill"
    cfg = TrainConfig(steps=1, batch_size=1, lr=1e-4, warmup=0)
    with pytest.raises(D3DError, match="is a 'ar' drafter, not 'd3d'"):
        train_drafter(None, data, tmp_path / "x", tmp_path / "x.run", [], 0, 16, cfg, heldout=2,
                      init=shipped.with_name(shipped.name + "-ar"))
    summary = train_drafter(None, data, tmp_path / "tuned", tmp_path / "tuned.run", [], 0, 16, cfg, heldout=2,
                            max_shards=1, init=shipped)
    tuned, original = json.loads((tmp_path / "tuned" / "drafter.json").read_text()), \
        json.loads((shipped / "drafter.json").read_text())
    assert summary["init"] == str(shipped) and summary["steps_done"] == 1
    assert summary["init_training"]["command"] == original["training"]["command"]
    assert tuned["init_layers"] == original["init_layers"]
    assert tuned["draft_vocab_size"] == original["draft_vocab_size"]
    # the fine-tuned checkpoint loads back (the drafter it started from was packed for the CPU layers, whose
    # layer list once joined the state dict under a second name) and drafts with the trained weights
    back = load_drafter(tmp_path / "tuned", smol[0], smol[1])
    assert not any(k.startswith("cpu_layers") for k in back.state_dict())
    assert not torch.equal(back.layers[0].attention.wqkv.weight,
                           load_drafter(shipped, smol[0], smol[1]).layers[0].attention.wqkv.weight)


def test_draft_after_incremental_updates_equals_from_scratch():
    d = trainable_drafter().eval().requires_grad_(False)
    seq = [random.Random(1).randrange(TINY.vocab_size) for _ in range(60)]
    d.setup_cache(1, 256)
    d.draft_block(seq[:10])
    d.draft_block(seq[:30])
    d.draft_block(seq[:25] + [4, 5])          # rejection: roll back and append other tokens
    incremental = d.draft_block(seq[:40])
    d.setup_cache(1, 256)
    d.cached_tokens = []
    scratch = d.draft_block(seq[:40])
    assert torch.allclose(incremental, scratch, atol=1e-5)
    assert d.cached_tokens == seq[:40] and d.cache_len == 40


def test_drafting_fewer_slots_is_the_block_of_that_size():
    """draft_block(tokens, slots=s) is what a drafter with a block of s slots drafts (fewer masks fed),
    and leaves the cache holding the verified text only, as the whole block does."""
    import copy

    d = trainable_drafter(block_size=8).eval().requires_grad_(False)
    seq = [random.Random(2).randrange(TINY.vocab_size) for _ in range(30)]
    d.setup_cache(1, 256)
    whole = d.draft_block(seq[:20])
    few = d.draft_block(seq[:20], slots=3)
    assert few.shape == (3, whole.shape[1]) and d.cached_tokens == seq[:20] and d.cache_len == 20
    small = copy.deepcopy(d)
    small.cfg.block_size = 3
    small.setup_cache(1, 256)
    small.cached_tokens = []
    assert torch.allclose(small.draft_block(seq[:20]), few, atol=1e-5)
    assert torch.allclose(d.draft_block(seq[:20], slots=d.block_size), whole, atol=1e-5)
    with pytest.raises(D3DError, match="slots must be in 1..8"):
        d.draft_block(seq[:20], slots=9)


def test_mismatched_target_is_a_clear_error(tmp_path, smol):
    model, tok, _ = smol
    save_drafter(trainable_drafter(), tmp_path / "tiny")
    with pytest.raises(D3DError, match="trained for target 'tiny'"):
        load_drafter(tmp_path / "tiny", model, tok)
    r = subprocess.run([sys.executable, "-m", "d3d.cli", "generate", "hello", "--method", "d3d", "--drafter",
                        str(tmp_path / "tiny"), "--max-new-tokens", "4"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("d3d: error: drafter")


def test_d3d_greedy_is_identical_to_ar(smol, prompt_ids, ar_tokens):
    model, tok, model_dir = smol
    d = load_drafter(DEFAULT_DRAFTERS / model_dir.name, model, tok)
    proposer = D3DProposer(d, model.args.vocab_size)
    taus = []
    for ids in prompt_ids[:5]:
        sp = generate(model, tok, ids, max_new_tokens=64, proposer=proposer, block_size=d.block_size)
        assert sp.token_ids == ar_tokens(ids, 64)
        taus.append(sp.tau)
    assert max(taus) > 1.0  # the shipped drafter really drafts (accepted tokens exist)


def test_shipped_drafter_matches_its_target(smol):
    model, tok, model_dir = smol
    cfg = json.loads((DEFAULT_DRAFTERS / model_dir.name / "drafter.json").read_text())
    assert cfg["target"]["tokenizer"] == tokenizer_fingerprint(tok)
    assert (DEFAULT_DRAFTERS / model_dir.name / "drafter.safetensors").stat().st_size < 32 * 2**20


def test_no_benchmark_test_prompt_in_training_data():
    examples = load_dataset(ROOT / "data" / "distill")
    assert len(examples) > 100
    assert not {e.hash for e in examples} & benchmark_prompt_hashes()


def test_make_batch_targets_follow_the_layout():
    d = trainable_drafter()
    ex = tiny_examples(2)
    cfg = TrainConfig(blocks_per_seq=2)
    b = make_batch(ex, cfg, d.block_size, vocab_map_for(d), d.mask_id, random.Random(0))
    T = b.tokens.shape[1]
    for flat, tgt, k in zip(b.slot_index.tolist(), b.slot_target.tolist(), b.slot_k.tolist()):
        n, t = divmod(flat, T)
        seq = ex[n].prompt_ids + ex[n].response_ids
        assert b.tokens[n, t] == d.mask_id and seq[int(b.positions[n, t])] == tgt
    for flat, tgt in zip(b.ar_index.tolist(), b.ar_target.tolist()):
        n, t = divmod(flat, T)
        seq = ex[n].prompt_ids + ex[n].response_ids
        assert seq[t + 1] == tgt and t >= len(ex[n].prompt_ids) - 1


def test_distillation_reads_the_targets_law_at_the_position_before_each_target():
    """Every AR and slot target's source is the clean position whose next token it is, and the teacher's
    log-probabilities there equal the target's own forward, renormalised over the draft vocabulary."""
    torch.manual_seed(0)
    teacher = Transformer(TINY).eval()
    d = drafter_from_target(teacher, tiny_tokenizer(), "tiny", [0, 1], 4, torch.arange(2, TINY.vocab_size))
    ex = tiny_examples(3)
    b = make_batch(ex, TrainConfig(blocks_per_seq=3), d.block_size, vocab_map_for(d), d.mask_id, random.Random(0))
    L = int(b.ctx_len)
    clean = b.tokens[:, :L].reshape(-1)
    sources, targets = torch.cat([b.ar_source, b.slot_source]), torch.cat([b.ar_target, b.slot_target])
    assert len(sources) == len(b.ar_index) + len(b.slot_index)
    assert (d.draft_ids[targets] == clean[sources + 1]).all()
    soft = teacher_log_probs(teacher, d, b)
    with torch.no_grad():
        ref = torch.log_softmax(teacher(b.tokens[:, :L])[..., d.draft_ids], -1).reshape(len(clean), -1)
    assert torch.allclose(soft, ref, atol=1e-5)


def test_distillation_pulls_the_drafter_toward_the_teachers_law(tmp_path):
    torch.manual_seed(1)
    teacher = Transformer(TINY).eval().requires_grad_(False)
    d = trainable_drafter()
    ex = tiny_examples()
    cfg = TrainConfig(steps=40, batch_size=8, lr=1e-2, warmup=5, blocks_per_seq=4, checkpoint_every=100, distill=1.0)
    b = make_batch(ex[:8], cfg, d.block_size, vocab_map_for(d), d.mask_id, random.Random(5))

    def kl() -> float:
        with torch.no_grad():
            h, _ = d.hidden(b.tokens, mask=b.mask, positions=b.positions)
            q = torch.log_softmax(d.head(h.reshape(-1, h.shape[-1])[b.ar_index]), -1)
            p = teacher_log_probs(teacher, d, b)[b.ar_source]
            return float((p.exp() * (p - q)).sum(-1).mean())

    before = kl()
    train(d, ex, cfg, tmp_path / "run", log=lambda *_: None, teacher=teacher)
    assert kl() < 0.5 * before


def test_replayed_acceptance_matches_a_real_run(smol, prompt_ids):
    from d3d.training.estimate import replay_acceptance

    model, tok, model_dir = smol
    d = load_drafter(DEFAULT_DRAFTERS / model_dir.name, model, tok)
    proposer = D3DProposer(d, model.args.vocab_size)
    for ids in prompt_ids[:3]:
        real = generate(model, tok, ids, max_new_tokens=48, proposer=proposer, block_size=d.block_size)
        replay = replay_acceptance(d, ids, real.token_ids, 48)
        # the last round may accept drafts past an EOS that the stop rule then cuts; all others agree
        assert replay[:-1] == real.acceptance_lengths[:-1]
        assert len(replay) == real.rounds


def test_d3d_async_greedy_is_identical_to_ar_on_real_prompts(smol, prompt_ids, ar_tokens):
    from d3d.decoding.async_engine import generate_async

    model, tok, model_dir = smol
    d = load_drafter(DEFAULT_DRAFTERS / model_dir.name, model, tok)
    hits, lengths = 0, []
    for ids in prompt_ids[:3]:
        res = generate_async(model, tok, ids, max_new_tokens=48, drafter=d)
        assert res.token_ids == ar_tokens(ids, 48)
        assert res.stats["packed_hits"] + res.stats["fallbacks"] == drafted_rounds(res, 48) - 1
        hits, lengths = hits + res.stats["packed_hits"], lengths + res.acceptance_lengths
    assert hits > 0 and max(lengths) >= 2  # packed drafts were used and accepted


def test_d3d_async_overlaps_only_where_its_measured_round_is_faster(smol, prompt_ids, ar_tokens, monkeypatch):
    """The d3d-async runner times both schedules' rounds when it is built (round_costs) and packs the successors
    beside the verification only if that round is the faster; otherwise every round drafts synchronously, as
    `d3d` (here whole blocks: --draft-k 15). Either way the output is plain decoding's."""
    import d3d.methods.d3d_async as d3d_async
    from d3d.decoding.async_engine import round_costs
    from d3d.methods.catalog import make_runner

    model, tok, model_dir = smol
    d = load_drafter(DEFAULT_DRAFTERS / model_dir.name, model, tok)
    measured = round_costs(model, d, split_threads=True, context=64, repeats=1)
    assert set(measured) == {"sync", "overlap"} and all(0 < t < 60 for t in measured.values())
    ids = prompt_ids[0]
    for costs, schedule in (({"sync": 2.0, "overlap": 1.0}, "overlap"), ({"sync": 1.0, "overlap": 2.0}, "sync")):
        monkeypatch.setattr(d3d_async, "round_costs", lambda *a, costs=costs, **k: costs)
        runner = make_runner("d3d-async", model, tok, model_dir, draft_k=15)  # whole blocks: sized ones follow timings
        assert runner.settings["schedule"] == schedule and runner.settings["round_s"] == costs
        res = runner(ids, max_new_tokens=32)
        assert res.token_ids == ar_tokens(ids, 32) and max(res.acceptance_lengths) >= 2
        assert res.stats["packed_hits"] + res.stats["fallbacks"] == drafted_rounds(res, 32) - 1
        assert (res.stats["packed_hits"] > 0) == (schedule == "overlap")  # sync: every round drafts after the last


@pytest.mark.slow
def test_cli_trace_writes_chrome_trace_and_plot(tmp_path):
    trace = tmp_path / "trace.json"
    r = subprocess.run([sys.executable, "-m", "d3d.cli", "generate", "What is 12 * 7?", "--method", "d3d-async",
                        "--max-new-tokens", "24", "--trace", str(trace), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"verify", "prefill"} <= names and ("draft" in names or "sync draft" in names)
    assert trace.with_suffix(".png").stat().st_size > 1000
    out = json.loads(r.stdout)
    assert out["method"] == "d3d-async" and out["new_tokens"] > 0 and "hit_rate" in out
