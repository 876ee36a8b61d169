"""The replay model of asynchronous D3D (d3d.bench.async_model): its arithmetic, its device profiles and the
pass timings it is fed."""
from __future__ import annotations

import json

import pytest
import torch

from d3d.bench.async_model import (PASSES, cpu_prediction, fit_threads, gpu_profile, measure_passes, on_cores,
                                   predict, rounds, together_cpu)
from d3d.errors import D3DError
from helpers import tiny_drafter, tiny_model


def amdahl(serial: float, parallel: float, threads=(1, 2)) -> dict[int, float]:
    return {n: serial + parallel / n for n in threads}


def test_thread_scaling_is_fitted_through_one_and_n_threads_and_clamped():
    assert fit_threads(1.0, 0.6, 2) == pytest.approx((0.2, 0.8))
    assert fit_threads(1.0, 1.2, 2) == (1.0, 0.0)   # slower on more threads: all serial
    assert fit_threads(1.0, 0.1, 2) == (0.0, 1.0)   # faster than linear: all parallel
    costs = {"verify": amdahl(0.02, 0.4)}
    assert on_cores(costs, "verify", 2) == costs["verify"][2]
    assert on_cores(costs, "verify", 8) == pytest.approx(0.02 + 0.4 / 8)
    with pytest.raises(D3DError, match="1 and >= 2 threads"):
        on_cores({"verify": {2: 0.3}}, "verify", 4)
    with pytest.raises(D3DError, match="n >= 2"):
        fit_threads(1.0, 1.0, 1)


def test_cpu_split_takes_the_best_division_of_the_cores():
    costs = {"verify": amdahl(0.0, 0.6), "packed": amdahl(0.0, 0.2)}
    seconds, drafter_cores = together_cpu(costs, 4)
    assert (seconds, drafter_cores) == (pytest.approx(0.2), 1)  # verify on 3 cores 0.2 s, packed on 1 0.2 s
    with pytest.raises(D3DError, match=">= 2 cores"):
        together_cpu(costs, 1)


def test_round_costs_and_speedup_follow_the_schedules():
    sync_s = {"verify": 0.10, "draft": 0.02, "pick": 0.005}
    r = rounds(sync_s, together_s=0.11, hit_rate=1.0)
    assert r == pytest.approx({"sync": 0.12, "async": 0.115})
    assert rounds(sync_s, 0.11, 0.5)["async"] == pytest.approx(0.125)  # half the rounds also draft
    p = predict(3.0, 1.0, sync_s, 0.11)
    assert p["d3d_tok_s"] == pytest.approx(25.0) and p["async_speedup"] == pytest.approx(0.12 / 0.115)
    # latency-bound passes of equal length: the async round hides the draft entirely
    g = predict(3.0, 1.0, {"verify": 0.03, "draft": 0.03, "pick": 0.0}, together_s=0.03)
    assert g["async_speedup"] == pytest.approx(2.0)
    with pytest.raises(D3DError, match="hit rate"):
        rounds(sync_s, 0.1, 1.5)


def test_a_cpu_prediction_prices_both_schedules_on_its_cores():
    costs = {name: amdahl(0.001, s) for name, s in
             {"verify": 0.2, "draft": 0.03, "packed": 0.2, "pick": 0.004}.items()}
    two, many = cpu_prediction(costs, 2, 2.0, 1.0), cpu_prediction(costs, 16, 2.0, 1.0)
    assert two["drafter_cores"] == 1 and two["async_speedup"] < 1  # each side at half speed
    assert many["async_speedup"] > two["async_speedup"]
    assert many["sync_round_s"] == pytest.approx(on_cores(costs, "draft", 16) + on_cores(costs, "verify", 16))


def test_a_gpu_check_file_is_a_latency_bound_profile(tmp_path):
    path = tmp_path / "h100.json"
    path.write_text(json.dumps({"shape": "qwen3-8b", "device": "cuda:0", "gpu": "NVIDIA H100", "verify_ms": 20.0,
                                "packed_draft_ms": 12.0, "both_ms": 23.0,
                                "levers_ms": {"sync draft (2 new tokens + 16 masks)": 6.0}}))
    g = gpu_profile(path)
    assert g["together_s"] == pytest.approx(0.020) and g["sync_s"]["draft"] == pytest.approx(0.006)
    assert g["measured_both_s"] == pytest.approx(0.023) and "H100" in g["name"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(D3DError, match="not a scripts/gpu_check.py --json file"):
        gpu_profile(bad)


def test_the_passes_are_timed_on_each_thread_count_and_leave_the_caches_as_they_were():
    model = tiny_model()
    d = tiny_drafter(model)
    threads = torch.get_num_threads()
    costs, both = measure_passes(model, d, [1, 2], context=32, repeats=1)
    assert set(costs) == set(PASSES) and all(set(v) == {1, 2} and min(v.values()) > 0 for v in costs.values())
    assert both > 0 and torch.get_num_threads() == threads
    assert model.cache_len == 32 and len(d.cached_tokens) == 31
