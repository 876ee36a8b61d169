"""Baselines on equal terms: DFlash-style and small-AR drafters, and transformers' own generate."""
import pytest
import torch

from d3d.methods.ar_draft import ARDraftProposer
from d3d.training.batches import TrainConfig
from d3d.drafters.dflash import DFlashDrafter
from d3d.drafters.kinds import spread_layers
from d3d.methods.dflash import DFlashProposer
from d3d.drafters.convert import drafter_from_target
from d3d.drafters.files import load_drafter, save_drafter
from d3d.decoding.engine import generate
from d3d.methods.hf import HFRunner
from d3d.runtime.hf import load_hf_model
from d3d.training.losses import evaluate
from d3d.methods.catalog import BASELINE_SUFFIX, default_drafter
from d3d.runtime.target import Transformer
from d3d.training.train import train
from helpers import EOS, TINY, check_raising_after, sliced_prompt, tiny_examples, tiny_model, tiny_tokenizer
from sampling_law import MAX_NEW_TINY, PROMPT, TEMP, chi2_pvalue, exact_law, spec_draw


class RecordingDFlash(DFlashProposer):
    """Keeps every hidden-state chunk the engine hands over."""

    def reset(self, prompt_ids):
        super().reset(prompt_ids)
        self.seen = []

    def observe(self, taps):
        self.seen.append([t.clone() for t in taps])
        super().observe(taps)


def test_dflash_hidden_states_equal_a_separate_forward(smol, prompt_ids):
    model, tok, _ = smol
    layers = spread_layers(model.args.n_layers, 4)
    d = drafter_from_target(model, tok, "smol", [26, 27, 28, 29], 16, kind="dflash", target_layers=layers)
    proposer = RecordingDFlash(d.eval().requires_grad_(False), model.args.vocab_size)
    ids = prompt_ids[0]
    res = generate(model, tok, ids, max_new_tokens=40, proposer=proposer)
    verified = ids + res.token_ids[:-1]  # every position the target has processed
    got = [torch.cat([chunk[i] for chunk in proposer.seen], dim=1) for i in range(len(layers))]
    assert got[0].shape[1] == len(verified) and len(proposer.seen) == res.rounds + 1
    model.setup_cache(1, len(verified))
    _, ref = model.hidden(torch.tensor([verified]), hidden_layers=layers)
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, atol=2e-3), (g - r).abs().max()


@pytest.mark.parametrize("method", sorted(BASELINE_SUFFIX))
def test_shipped_baseline_greedy_is_identical_to_ar(smol, prompt_ids, ar_tokens, method):
    from d3d.methods.catalog import make_runner

    model, tok, model_dir = smol
    default_drafter(model_dir, BASELINE_SUFFIX[method])  # shipped
    run = make_runner(method, model, tok, model_dir)
    lengths = []
    for ids in prompt_ids[:3]:
        res = run(ids, max_new_tokens=48)
        assert res.token_ids == ar_tokens(ids, 48)
        lengths += res.acceptance_lengths
    assert max(lengths) >= 2  # the shipped drafter's drafts were accepted


def test_ar_draft_with_a_fixed_draft_length(smol, prompt_ids, ar_tokens):
    from d3d.methods.catalog import make_runner

    model, tok, model_dir = smol
    run = make_runner("ar-draft", model, tok, model_dir, ar_draft_k=2)
    assert run.settings["ar_draft_k"] == 2 and make_runner("ar-draft", model, tok, model_dir).settings["ar_draft_k"] is None
    res = run(prompt_ids[0], max_new_tokens=32)
    assert res.token_ids == ar_tokens(prompt_ids[0], 32) and max(res.acceptance_lengths) <= 3


def test_ar_draft_with_a_partial_copy_of_the_target(smol, prompt_ids, ar_tokens):
    """A drafter of the target's first 28 of 30 layers agrees often but not always: both accepted and
    rejected drafts occur, k adapts, and the output is still exactly plain decoding's."""
    model, tok, _ = smol
    d = drafter_from_target(model, tok, "smol", list(range(28)), 16, kind="ar").eval().requires_grad_(False)
    proposer = ARDraftProposer(d, model.args.vocab_size)
    for ids in prompt_ids[:2]:
        res = generate(model, tok, ids, max_new_tokens=40, proposer=proposer)
        assert res.token_ids == ar_tokens(ids, 40)
        assert max(res.acceptance_lengths) > 2 and min(res.acceptance_lengths) == 1


def tiny_dflash(target: Transformer, block_size: int = 4) -> DFlashDrafter:
    torch.manual_seed(3)
    return drafter_from_target(target, tiny_tokenizer(), "tiny", [0], block_size, kind="dflash",
                               target_layers=[0, 1]).eval().requires_grad_(False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "ar-draft"])
def test_baseline_sampling_has_the_law_of_plain_sampling(kind):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = tiny_model()
        torch.manual_seed(5)
        if kind == "dflash":
            d = drafter_from_target(target, tiny_tokenizer(8), "tiny", [0], 4, kind="dflash", target_layers=[0, 1])
            make = DFlashProposer
        else:
            d = drafter_from_target(tiny_model(noise=0.08), tiny_tokenizer(8), "tiny", [0, 1], 4, kind="ar")
            make = ARDraftProposer
        d = d.eval().requires_grad_(False)
        samples, rounds = spec_draw(target, TEMP, lambda seed: make(d, 8, max_len=64))
        assert rounds[1] > 100 and sum(v for k, v in rounds.items() if k > 1) > 50
        assert chi2_pvalue(samples, exact_law(target, PROMPT, TEMP, MAX_NEW_TINY, EOS)) > 1e-3
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["dflash", "ar"])
def test_baseline_checkpoints_round_trip(tmp_path, kind):
    torch.manual_seed(0)
    target = Transformer(TINY)
    d = drafter_from_target(target, tiny_tokenizer(), "tiny", [1], 4, draft_ids=torch.tensor([1, 3, 5, 7, 9]),
                            kind=kind, target_layers=[0, 1] if kind == "dflash" else None)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_drafter(d, tmp_path / "dr", dtype=torch.float32)
    back = load_drafter(tmp_path / "dr", target, tiny_tokenizer())
    assert type(back) is type(d) and back.cfg == d.cfg
    for k, v in d.state_dict().items():
        if k not in ("tok_embeddings.weight", "output.weight"):  # those come from the target
            assert torch.equal(v, back.state_dict()[k]), k


def test_dflash_training_loss_decreases(tmp_path):
    torch.manual_seed(0)
    target = Transformer(TINY).requires_grad_(False)
    d = drafter_from_target(target, tiny_tokenizer(), "tiny", [0, 1], 4, kind="dflash", target_layers=[0, 1])
    cfg = TrainConfig(steps=40, batch_size=8, lr=1e-2, warmup=5, blocks_per_seq=4, ar_weight=0.0,
                      checkpoint_every=100)
    ex = tiny_examples()
    before = evaluate(d, ex, cfg, target=target)
    train(d, ex, cfg, tmp_path / "run", log=lambda *_: None, target=target)
    after = evaluate(d, ex, cfg, target=target)
    assert after["denoise"] < 0.5 * before["denoise"] and after["tau"] > before["tau"]


def test_ar_drafter_training_has_only_the_next_token_loss(tmp_path):
    torch.manual_seed(0)
    d = drafter_from_target(Transformer(TINY), tiny_tokenizer(), "tiny", [0, 1], 4, kind="ar")
    cfg = TrainConfig(steps=40, batch_size=8, lr=1e-2, warmup=5, blocks_per_seq=0, ar_weight=1.0,
                      checkpoint_every=100)
    hist = train(d, tiny_examples(), cfg, tmp_path / "run", log=lambda *_: None)
    assert "denoise" not in hist[0] and hist[-1]["ar"] < 0.5 * hist[0]["ar"]


def test_transformers_reference_equals_our_plain_decoding(smol, prompt_ids, ar_tokens):
    model, tok, model_dir = smol
    hf = load_hf_model(model_dir)
    ids = prompt_ids[0]
    for lookup in (False, True):
        res = HFRunner(hf, tok, prompt_lookup=lookup)(ids, max_new_tokens=48)
        assert res.token_ids == ar_tokens(ids, 48)
        assert sum(res.acceptance_lengths) == res.new_tokens - 1 and res.decode_s > 0
        assert (res.tau > 1) == lookup


def test_transformers_reference_prompt_in_checked_slices(smol, prompt_ids):
    """With prefill_check (d3d serve), hf runs the prompt in PREFILL_CHUNK-token slices with the check
    before each, then generate() goes on from that cache: the same answer, the same first-forward split of
    prefill and decode; a check that raises stops it, and the next call is whole again."""
    from d3d.decoding.engine import PREFILL_CHUNK

    model, tok, model_dir = smol
    runner = HFRunner(load_hf_model(model_dir), tok, prompt_lookup=False)
    ids = sliced_prompt(prompt_ids[0], PREFILL_CHUNK)
    plain = runner(ids, max_new_tokens=6)
    calls = []
    sliced = runner(ids, max_new_tokens=6, prefill_check=lambda: calls.append(1))
    assert len(calls) == 3 + 1 and sliced.token_ids == plain.token_ids
    assert sliced.acceptance_lengths == plain.acceptance_lengths and sliced.prefill_s > 0
    assert runner.starts[0] == len(ids) - 1  # generate() ran only the last prompt token
    with pytest.raises(TimeoutError):
        runner(ids, max_new_tokens=6, prefill_check=check_raising_after(1, []))
    assert runner(ids, max_new_tokens=6).token_ids == plain.token_ids


def test_precomputed_target_features_give_the_same_dflash_loss():
    import random

    from d3d.training.batches import make_batch, target_features, vocab_map_for
    from d3d.training.losses import losses

    torch.manual_seed(0)
    target = Transformer(TINY).requires_grad_(False)
    d = drafter_from_target(target, tiny_tokenizer(), "tiny", [0], 4, kind="dflash", target_layers=[0, 1])
    cfg = TrainConfig(blocks_per_seq=3, ar_weight=0.0)
    ex = tiny_examples(4)
    ex[1].response_ids[:] = ex[1].response_ids[:20]  # rows of different lengths: padding
    args = (ex, cfg, 4, vocab_map_for(d), d.mask_id)
    per_batch = losses(d, make_batch(*args, random.Random(0), clean_first_slot=True), cfg, target)
    feats = target_features(target, ex, cfg, [0, 1])
    cached = losses(d, make_batch(*args, random.Random(0), clean_first_slot=True, feats=feats), cfg, None)
    assert torch.allclose(per_batch["loss"], cached["loss"], atol=1e-2)


def test_a_drafter_of_another_kind_is_a_clear_error(smol):
    from d3d.errors import D3DError
    from d3d.methods.catalog import make_runner

    model, tok, model_dir = smol
    with pytest.raises(D3DError, match="kind 'ar'"):
        make_runner("d3d", model, tok, model_dir, drafter=str(default_drafter(model_dir, "-ar")))
    with pytest.raises(D3DError, match="is 'd3d'"):
        make_runner("dflash", model, tok, model_dir, drafter=str(default_drafter(model_dir)))
