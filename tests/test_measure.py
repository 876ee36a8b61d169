"""The measuring commands end to end: `d3d estimate` (replayed tau of several drafters, added to one report)
and `d3d loadtest` (a short run against a server it starts itself)."""
from __future__ import annotations

import json

import pytest

from d3d.cli import main
from d3d.methods.catalog import DEFAULT_DRAFTERS

SHIPPED = str(DEFAULT_DRAFTERS / "SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_estimate_adds_drafters_to_one_report(tmp_path, capsys):
    out, cache = tmp_path / "estimate.json", tmp_path / "continuations.json"
    common = ["--benchmarks", "gsm8k", "--limit", "1", "--max-new-tokens", "16", "--cache", str(cache),
              "--out", str(out), "--threads", "1"]
    assert main(["estimate", "--drafters", f"shipped={SHIPPED}", *common]) == 0
    assert main(["estimate", "--drafters", "whole=whole-target", "--save", str(tmp_path / "whole"), *common]) == 0
    report = json.loads(out.read_text())
    assert report["benchmarks"] == ["gsm8k"] and set(report["drafters"]) == {"shipped", "whole"}
    shipped, whole = report["drafters"]["shipped"], report["drafters"]["whole"]
    assert shipped["layers"] == 4 and shipped["weights"] and whole["weights"] is None
    for row in (shipped, whole):
        assert row["prompts"] == 1 and 1 <= row["tau"] <= 16 and row["per_benchmark"]["gsm8k"] == row["tau"]
        reach = row["reach"]
        assert len(reach) == 15 and reach == sorted(reach, reverse=True) and reach[0] == row["first_draft_accepted"]
        assert abs(1 + sum(reach) - row["tau"]) < 1e-3
    assert (tmp_path / "whole" / "drafter.json").exists()

    assert main(["estimate", "--drafters", f"shipped={SHIPPED}", *common[:-4], "--limit", "2", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.slow
def test_loadtest_short_run(tmp_path):
    out = tmp_path / "load.json"
    assert main(["loadtest", "--clients", "2", "--duration", "3", "--max-tokens", "6", "--phases", "random", "--threads", "1",
                 "--out", str(out)]) == 0  # the other phases: tests/test_loadtest.py, on a tiny model
    report = json.loads(out.read_text())
    assert report["command"].startswith("d3d loadtest") and report["requests"] > 0
    assert report["server_5xx"] == 0 and report["greedy_all_equal_ar"] is True
