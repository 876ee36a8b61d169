"""Layer pruning: bypass semantics, the report, resume after interruption."""
import json
import random

import pytest
import torch

from d3d.training.batches import TrainConfig
from d3d.drafters.convert import drafter_from_target
from d3d.bench.plots import plot_pruning
from d3d.training.prune import bypassed, calibration_tau, heal_config, healer, prune, pruning_report, remove_layers
from d3d.runtime.target import Transformer
from helpers import TINY, tiny_args, tiny_examples, tiny_tokenizer

THREE = tiny_args(TINY.vocab_size, TINY.max_seq_len, n_layers=3)


def drafter_with(layers: list[int], args=THREE):
    torch.manual_seed(0)
    target = Transformer(args)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return drafter_from_target(target, tiny_tokenizer(), "tiny", layers, 4).eval().requires_grad_(False)


def fresh_draft(d, tokens):
    d.setup_cache(1, 128)
    d.cached_tokens = []
    return d.draft_block(tokens)


def test_bypassed_layer_equals_a_model_built_without_it():
    seq = [random.Random(2).randrange(TINY.vocab_size) for _ in range(20)]
    full, without_middle = drafter_with([0, 1, 2]), drafter_with([0, 2])
    expected = fresh_draft(without_middle, seq)
    with bypassed(full, {1}):
        assert torch.allclose(fresh_draft(full, seq), expected, atol=1e-6)
    assert len(full.layers) == 3  # restored
    removed = remove_layers(full, {1})
    assert removed.cfg.init_layers == [0, 2] and removed.cfg.args["n_layers"] == 2
    assert torch.allclose(fresh_draft(removed, seq), expected, atol=1e-6)
    assert not torch.allclose(fresh_draft(full, seq), expected, atol=1e-3)  # the layer did matter
    full.cfg.from_target = [0, 2]  # a delta drafter: stack layers 0 and 2 are the target's own
    assert removed.cfg.from_target == [] and remove_layers(full, {1}).cfg.from_target == [0, 1]
    assert remove_layers(full, {0}).cfg.from_target == [1]


def test_a_bypass_runs_on_the_packed_cpu_layers_less_the_dropped_ones():
    """A pruning trial on a drafter packed for the C++ layers runs on them (not the slower PyTorch layers), with the
    same bits as the drafter built without the layer, and leaves the packing as it was."""
    from d3d.runtime.kernels import kernels_available

    if not kernels_available():
        pytest.skip("no C++ kernels here (no compiler)")
    seq = [random.Random(3).randrange(TINY.vocab_size) for _ in range(20)]
    wide = tiny_args(TINY.vocab_size, TINY.max_seq_len, n_layers=3, dim=64)  # the fp32 kernels take 64s of outputs
    full, without_middle = drafter_with([0, 1, 2], wide), drafter_with([0, 2], wide)
    for d in (full, without_middle):
        d.pack_cpu_layers()
    packed = full.cpu_params
    with bypassed(full, {1}):
        assert full._cpu_ready(1, None) and len(full.cpu_params) == len(without_middle.cpu_params)
        assert torch.equal(fresh_draft(full, seq), fresh_draft(without_middle, seq))
    assert full.cpu_params is packed and full.cpu_layers_of() is full.layers and full._cpu_ready(1, None)


def test_healing_continues_the_drafters_own_objective():
    d = drafter_with([0, 1])
    assert heal_config(d, 60, 2e-4) == TrainConfig(steps=60, lr=2e-4, warmup=0, checkpoint_every=10**9)
    d.cfg.training = {"config": {**TrainConfig(gamma=2.0, ar_weight=0.3, batch_size=4, layer_drop=0.2,
                                               steps=800, lr=1e-3).__dict__, "retired_field": 1}}
    cfg = heal_config(d, 60, 2e-4)
    assert (cfg.gamma, cfg.ar_weight, cfg.batch_size) == (2.0, 0.3, 4)
    assert (cfg.steps, cfg.lr, cfg.warmup, cfg.layer_drop) == (60, 2e-4, 0, 0.0)


def tiny_calibration():
    rng = random.Random(0)
    calib = {}
    for name in ("math", "chat"):
        prompts = [[rng.randrange(2, TINY.vocab_size) for _ in range(8)] for _ in range(2)]
        conts = [[(p[-1] + i) % TINY.vocab_size for i in range(1, 25)] for p in prompts]
        calib[name] = (prompts, conts)
    return calib


def test_prune_report_schema(tmp_path):
    d = drafter_with([0, 1, 2])
    pruned, state = prune(d, tiny_calibration(), 24, tmp_path / "run", keep_ratio=0.01, min_layers=1,
                          log=lambda *_: None)
    assert len(pruned.layers) == 1 and state["stopped"].startswith("layer budget")
    report = pruning_report(state, {"keep_ratio": 0.01})
    for key in ("layers_before", "layers_after", "tau_before", "tau_after", "removal_order", "steps", "kept"):
        assert key in report
    assert (report["layers_before"], report["layers_after"]) == (3, 1)
    assert set(s["removed"] for s in report["removal_order"]) < {0, 1, 2}
    for s in report["steps"]:
        assert s["tau"]["mean"] == max(s["candidates"].values()) and s["packed_ms"] > 0 and s["draft_ms"] > 0
    assert report["tau_after"]["mean"] == pytest.approx(calibration_tau(pruned, tiny_calibration(), 24)["mean"],
                                                         abs=1e-3)
    plot_pruning(report, tmp_path / "prune.png")
    assert (tmp_path / "prune.png").stat().st_size > 1000


def test_prune_on_a_quantized_twin_removes_from_the_fp32_drafter(tmp_path):
    """`d3d prune --quantize int4`: the trials run on an int4 copy, the removals and the result stay fp32."""
    from d3d.runtime.quantize import Int4Linear
    from d3d.training.prune import quantized_twin

    twins = []

    def twin(d):
        twins.append(quantized_twin(d, "int4", tiny_tokenizer()))
        return twins[-1]

    calib = tiny_calibration()
    pruned, state = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01, min_layers=2,
                          twin=twin, log=lambda *_: None)
    assert len(pruned.layers) == 2 and len(state["steps"]) == 1
    assert isinstance(twins[0].layers[0].feed_forward.w13, Int4Linear)
    assert isinstance(pruned.layers[0].feed_forward.w13, torch.nn.Linear)  # the original's weights, not the twin's
    step = state["steps"][0]
    assert step["tau"]["mean"] == max(step["candidates"].values())
    # the kept drafter, quantized again, scores what its trial did: the same int4 sums without the removed layer
    assert calibration_tau(quantized_twin(pruned, "int4", tiny_tokenizer()), calib, 24)["mean"] == \
        pytest.approx(step["tau"]["mean"], abs=1e-3)


def test_prune_resumes_after_interruption(tmp_path):
    calib = tiny_calibration()
    ref, ref_state = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "ref", keep_ratio=0.01,
                           log=lambda *_: None)
    calls = []

    def killed_on_second_step(d):
        calls.append(len(d.layers))
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01, heal=killed_on_second_step,
              log=lambda *_: None)
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert len(state["steps"]) == 1 and state["stopped"] is None
    resumed, resumed_state = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01,
                                   log=lambda *_: None)
    assert [s["removed"] for s in resumed_state["steps"]] == [s["removed"] for s in ref_state["steps"]]
    assert resumed.cfg.init_layers == ref.cfg.init_layers
    seq = list(range(2, 14))
    assert torch.allclose(fresh_draft(resumed, seq), fresh_draft(ref, seq), atol=1e-2)  # fp16 round trip


def test_prune_resumes_within_a_step(tmp_path, monkeypatch):
    """Each layer tried is saved as it is measured: a run killed in the middle of a step measures only the layers
    it had not tried, and removes what an uninterrupted run removes."""
    import d3d.training.prune as pruning

    calib = tiny_calibration()
    ref, ref_state = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "ref", keep_ratio=0.01,
                           log=lambda *_: None)
    real, calls = pruning.calibration_tau, []

    def measured(*args):
        calls.append(1)
        if len(calls) == 3:  # the starting tau, then the first layer tried; killed trying the second
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(pruning, "calibration_tau", measured)
    with pytest.raises(KeyboardInterrupt):
        prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01, log=lambda *_: None)
    assert list(json.loads((tmp_path / "run" / "state.json").read_text())["trials"]) == ["0"]
    calls.clear()
    monkeypatch.setattr(pruning, "calibration_tau", lambda *args: calls.append(1) or real(*args))
    _, state = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01, log=lambda *_: None)
    assert [s["removed"] for s in state["steps"]] == [s["removed"] for s in ref_state["steps"]]
    assert [s["candidates"] for s in state["steps"]] == [s["candidates"] for s in ref_state["steps"]]
    assert len(calls) == 2 + 2  # step 1: layers 1 and 2 only; step 2: both layers left (then one: the budget)
    assert "trials" not in state


def test_calibration_prompts_are_neither_training_data_nor_benchmark_prompts():
    from pathlib import Path

    from d3d.corpus.data import load_dataset
    from d3d.corpus.prompts import CALIBRATION_SETS, benchmark_prompt_hashes, calibration_prompts, prompt_hash

    trained = {ex.hash for ex in load_dataset(Path(__file__).resolve().parents[1] / "data" / "distill")}
    banned = benchmark_prompt_hashes()
    seen = set()
    for kind in CALIBRATION_SETS:
        prompts = calibration_prompts(kind, 6)
        assert len(prompts) == 6
        hashes = {prompt_hash(p) for p in prompts}
        assert not hashes & trained and not hashes & banned and not hashes & seen
        seen |= hashes


def test_bypassing_layers_in_turn_keeps_every_cache_usable():
    """A bypassed layer misses the cache growth of its trial; the next trial must still find room."""
    d = drafter_with([0, 1, 2])
    seq = list(range(2, 30))
    d.setup_cache(1, 20)
    with bypassed(d, {0}):
        d.setup_cache(1, 40)       # grows layers 1 and 2 only
    with bypassed(d, {1}):
        d.setup_cache(1, 30)       # layer 0 still holds 20 positions
        d.cached_tokens = []
        got = d.draft_block(seq[:24])  # 24 + 4 slots
        assert torch.allclose(got, fresh_draft(d, seq[:24]), atol=1e-6)


def test_a_stopped_run_continues_under_a_looser_rule(tmp_path):
    calib = tiny_calibration()
    _, first = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01, min_layers=2,
                     log=lambda *_: None)
    assert len(first["steps"]) == 1 and first["stopped"].startswith("layer budget")
    pruned, again = prune(drafter_with([0, 1, 2]), calib, 24, tmp_path / "run", keep_ratio=0.01, min_layers=1,
                          log=lambda *_: None)
    assert len(again["steps"]) == 2 and len(pruned.layers) == 1


def test_with_healing_the_stopping_rule_judges_the_healed_drafter(tmp_path, monkeypatch):
    """tau here is a stand-in that grows with depth and with healing: removals that only healing makes
    acceptable go through, and the first removal that healing cannot rescue is undone."""
    import d3d.training.prune as prune_module

    def fake_tau(d, calib, max_new_tokens):
        mean = 1.0 + 0.1 * len(d.layers) + (0.5 if getattr(d, "healed", False) else 0.0)
        return {"math": mean, "mean": mean}

    def heal_above_one_layer(d):
        d.healed = len(d.layers) > 1

    monkeypatch.setattr(prune_module, "calibration_tau", fake_tau)
    _, unhealed = prune(drafter_with([0, 1, 2]), tiny_calibration(), 24, tmp_path / "plain", keep_ratio=0.99, log=lambda *_: None)
    assert unhealed["steps"] == [] and "best 1.2 <" in unhealed["stopped"]
    pruned, state = prune(drafter_with([0, 1, 2]), tiny_calibration(), 24, tmp_path / "healed", keep_ratio=0.99,
                          heal=heal_above_one_layer, log=lambda *_: None)
    assert len(pruned.layers) == 2 and len(state["steps"]) == 1
    assert state["steps"][0]["tau"]["mean"] == 1.7 and state["steps"][0]["tau_unhealed"]["mean"] == 1.2
    assert "best 1.1 after healing" in state["stopped"]


def test_healer_fine_tunes_and_leaves_the_drafter_frozen(tmp_path):
    d = drafter_with([0, 1])
    before = d.layers[1].feed_forward.w2.weight.clone()
    healer(tiny_examples(16), 2, 1e-3, tmp_path)(d)
    assert not torch.equal(d.layers[1].feed_forward.w2.weight, before)
    assert not any(p.requires_grad for p in d.parameters()) and not d.training

