"""Benchmark harness: offline loaders, the ShareGPT held-out slice, metric arithmetic, multi-turn prompts,
`d3d report`, and one quick end-to-end `d3d bench` run."""
from __future__ import annotations

import ast
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from d3d.decoding.async_engine import AsyncGenerationResult
from d3d.bench.harness import _prompt_row, _summary, run_bench, tau_histogram
from d3d.cli import main
from d3d.corpus.code_prompts import code_mix
from d3d.decoding.engine import GenerationResult
from d3d.errors import D3DError
from d3d.corpus.prompts import (BENCHMARKS, MultiTurn, SHAREGPT_HELDOUT_POOL, benchmark_prompt_hashes,
                                benchmark_prompts, chat_mix, prompt_hash, sharegpt_heldout, train_prompts,
                                training_mix)
from d3d.bench.report import markdown_table, write_report
from d3d.decoding.verify import SamplingParams
from helpers import ChatTokenizer

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mt-bench": 80, "sharegpt": 309}  # as in README


# ---------------------------------------------------------------- loaders

@pytest.mark.parametrize("name", BENCHMARKS)
def test_loader_returns_well_formed_prompts(name):
    items = benchmark_prompts(name)
    assert len(items) == SIZES[name]
    for item in items:
        if name == "mt-bench":
            assert isinstance(item, MultiTurn) and len(item.turns) == 2
            assert all(isinstance(t, str) and t.strip() for t in item.turns)
        else:
            assert isinstance(item, str) and item.strip()
    assert benchmark_prompts(name, limit=3) == items[:3]


def test_loader_formats():
    assert benchmark_prompts("gsm8k", 1)[0].startswith("Janet")  # the bare question
    he = benchmark_prompts("humaneval", 1)[0]
    assert he.startswith("Complete the following Python function.\n\n```python\n") and he.endswith("```")
    assert "def has_close_elements" in he
    assert benchmark_prompts("mtbench", 2) == benchmark_prompts("mt-bench", 2)  # alias
    with pytest.raises(D3DError, match="unknown benchmark"):
        benchmark_prompts("nope")


@pytest.mark.slow
def test_training_inputs_unchanged():
    """The committed distillation dataset was built from exactly these sets: they must not drift."""
    digest = hashlib.sha1("".join(sorted(benchmark_prompt_hashes())).encode()).hexdigest()
    assert digest == "41ababe5034678441ccc698119b7a68c47a846f2"
    assert hashlib.sha1(repr(training_mix()).encode()).hexdigest() == "1cef3536ace24b11c08a1af2809d804f29a32756"


@pytest.mark.slow
def test_code_prompts_are_disjoint_from_training_heldout_and_benchmarks():
    """`d3d data --prompts code` draws prompts nothing else uses; its stubs are valid Python in the
    HumanEval wording; its ShareGPT requests lie before the held-out pool, beyond training_mix's reach."""
    mix, code = training_mix(), code_mix()
    assert {src for src, _, _ in code} == {"sharegpt-code", "python-stdlib"}
    hashes = [prompt_hash(p) for _, _, p in code]
    assert len(set(hashes)) == len(hashes)
    assert not set(hashes) & ({prompt_hash(p) for _, _, p in mix} | benchmark_prompt_hashes()
                              | {prompt_hash(p) for _, p in sharegpt_heldout()})
    used = {i for src, i, _ in mix if src == "sharegpt"}
    order = list(range(len(train_prompts("sharegpt"))))
    random.Random(0).shuffle(order)
    position = {i: k for k, i in enumerate(order)}
    share = [(i, p) for src, i, p in code if src == "sharegpt-code"]
    assert share and not {i for i, _ in share} & used
    assert max(position[i] for i, _ in share) < len(order) - SHAREGPT_HELDOUT_POOL
    humaneval_head = benchmark_prompts("humaneval", 1)[0].split("```python")[0]
    stubs = [p for src, _, p in code if src == "python-stdlib"]
    for p in stubs:
        head, body = p.split("```python\n")
        assert head == humaneval_head and body.endswith("\n```")
        tree = ast.parse(body[:-3])  # a docstring is a whole body
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
        assert len(ast.get_docstring(fn)) >= 40
    assert code_mix() == code  # deterministic


@pytest.mark.slow
def test_chat_prompts_are_disjoint_from_every_other_set():
    """`d3d data --prompts chat` draws ShareGPT requests that neither training_mix, code_mix, the held-out
    slice nor any benchmark uses, none mentioning code, all before the held-out pool."""
    mix, code, chat = training_mix(), code_mix(), chat_mix()
    hashes = [prompt_hash(p) for _, _, p in chat]
    assert len(chat) > 1000 and len(set(hashes)) == len(hashes)
    assert {src for src, _, _ in chat} == {"sharegpt-chat"}
    assert not set(hashes) & ({prompt_hash(p) for _, _, p in mix + code} | benchmark_prompt_hashes()
                              | {prompt_hash(p) for _, p in sharegpt_heldout()})
    used = {i for src, i, _ in mix if src == "sharegpt"} | {i for src, i, _ in code if src == "sharegpt-code"}
    assert not {i for _, i, _ in chat} & used
    order = list(range(len(train_prompts("sharegpt"))))
    random.Random(0).shuffle(order)
    position = {i: k for k, i in enumerate(order)}
    assert max(position[i] for _, i, _ in chat) < len(order) - SHAREGPT_HELDOUT_POOL
    assert chat_mix() == chat  # deterministic


@pytest.mark.slow
def test_sharegpt_heldout_is_disjoint_from_training():
    mix = training_mix()
    heldout = sharegpt_heldout()
    assert [p for _, p in heldout] == benchmark_prompts("sharegpt")
    # by position: the held-out pool lies beyond every position of the seeded shuffle that training used
    order = list(range(len(train_prompts("sharegpt"))))
    random.Random(0).shuffle(order)
    position = {i: k for k, i in enumerate(order)}
    used = {i for src, i, _ in mix if src == "sharegpt"}
    assert min(position[i] for i, _ in heldout) >= len(order) - SHAREGPT_HELDOUT_POOL > max(position[i] for i in used)
    assert not {i for i, _ in heldout} & used
    # by content: no held-out prompt equals (after normalisation) any training prompt, nor another held-out one
    hashes = [prompt_hash(p) for _, p in heldout]
    assert len(set(hashes)) == len(hashes)
    assert not set(hashes) & {prompt_hash(p) for _, _, p in mix}
    # and none is in the distillation data actually generated
    if (ROOT / "data" / "distill" / "manifest.json").exists():
        from d3d.corpus.data import load_dataset

        assert not set(hashes) & {e.hash for e in load_dataset(ROOT / "data" / "distill")}


# ---------------------------------------------------------------- metrics

def _res(tokens: list[int], acc: list[int], decode_s: float, prefill_s: float = 0.0) -> GenerationResult:
    return GenerationResult(prompt_ids=[0], token_ids=tokens, acceptance_lengths=acc, decode_s=decode_s,
                            prefill_s=prefill_s)


def test_metric_arithmetic():
    a, b = list(range(10)), list(range(5))
    ar = [_res(a, [1] * 9, 0.9), _res(b, [1] * 4, 0.8)]
    spec = [_res(a, [4, 5], 0.3, 0.05), _res(b, [3, 1], 0.2, 0.03)]
    wrong = [_res(a, [9], 0.1), _res([7, 7, 7, 7, 7], [4], 0.1)]

    r = _summary("x", "ngram", spec, ar, greedy=True, block_size=6)
    # 9 + 4 decoded tokens (the first of each generation comes from the prefill)
    assert r["tpot_s"] == pytest.approx(0.5 / 13, abs=1e-6)
    assert r["tokens_per_s"] == pytest.approx(26.0, abs=1e-3)
    assert r["speedup_vs_ar"] == pytest.approx(1.7 / 0.5, abs=1e-4)
    assert r["tau"] == pytest.approx(13 / 4)
    assert r["tau_histogram"] == [1, 0, 1, 1, 1, 0]
    assert r["ttft_ms"] == pytest.approx(40.0)  # the mean prefill, kept apart from the decoding speed
    assert r["lossless"] is True and r["prompts"] == 2 and r["new_tokens"] == 15

    base = _summary("x", "ar", ar, ar, greedy=True)
    assert base["tau"] == 1.0 and base["speedup_vs_ar"] == 1.0 and base["tpot_s"] == pytest.approx(1.7 / 13, abs=1e-6)
    assert base["tau_histogram"] == [13] + [0] * 15
    assert _summary("x", "bad", wrong, ar, greedy=True)["lossless"] is False
    assert _summary("x", "bad", wrong, ar, greedy=False)["lossless"] is None
    assert tau_histogram([_res(a, [2, 18], 1.0)], 16) == [0, 1] + [0] * 15 + [1]  # longer than the block


def test_async_stats_pass_through():
    rs = []
    for hits, fallbacks in ((3, 1), (5, 1)):
        r = AsyncGenerationResult(prompt_ids=[0], token_ids=[1, 2, 3], acceptance_lengths=[1, 2], decode_s=0.1)
        r.stats.update(packed_hits=hits, fallbacks=fallbacks)
        rs.append(r)
    row = _summary("x", "d3d-async", rs, rs, greedy=True)
    assert (row["packed_hits"], row["fallbacks"], row["packed_hit_rate"]) == (8, 2, 0.8)
    per = _prompt_row("x", "d3d-async", 0, rs[0], save_outputs=False)
    assert per["hit_rate"] == 0.75 and per["packed_hits"] == 3 and "mean_verify_ms" in per
    assert "packed_hits" not in _summary("x", "ar", [_res([1], [], 0.1)], [_res([1], [], 0.1)], True)


def test_multi_turn_items(tmp_path):
    tok = ChatTokenizer()
    model = SimpleNamespace(args=SimpleNamespace(max_seq_len=4096))
    calls = []

    def runner(name):
        def run(ids, params, max_new_tokens):
            chat = tok.chats[ids[0]]
            calls.append((name, chat, params))
            r = _res([1, 2, 3, 4], [1, 1, 1] if name == "ar" else [2, 1], 0.3 if name == "ar" else 0.2)
            r.text = f"reply to {chat[-1]['content']}"
            return r
        return run

    runners = {"ar": runner("ar"), "ngram": runner("ngram")}
    prompts = {"chat": ["hello", MultiTurn(("first", "second"))]}
    out = run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False)
    measured = [c for c in calls[2:]]  # after the two warm-ups
    assert [(n, c[-1]["content"]) for n, c, _ in measured] == [
        ("ar", "hello"), ("ngram", "hello"), ("ar", "first"), ("ngram", "first"), ("ar", "second"),
        ("ngram", "second")]
    # turn 2 is asked after the target's own (greedy AR) first answer
    assert measured[-1][1] == [{"role": "user", "content": "first"},
                               {"role": "assistant", "content": "reply to first"},
                               {"role": "user", "content": "second"}]
    rows = [(r["method"], r["prompt_index"], r.get("item"), r.get("turn")) for r in out["per_prompt"]]
    assert rows == [("ar", 0, None, None), ("ngram", 0, None, None), ("ar", 1, 1, 1), ("ngram", 1, 1, 1),
                    ("ar", 2, 1, 2), ("ngram", 2, 1, 2)]
    res = {r["method"]: r for r in out["results"]}
    assert res["ngram"]["prompts"] == 3 and res["ngram"]["speedup_vs_ar"] == pytest.approx(1.5)

    # sampling: the answer that conditions turn 2 comes from an extra, unrecorded greedy AR generation
    calls.clear()
    out = run_bench(model, tok, runners, {"chat": [MultiTurn(("first", "second"))]},
                    SamplingParams(temperature=1.0, seed=5), 4, progress=False)
    names = [(n, c[-1]["content"], p.temperature, p.seed) for n, c, p in calls[2:]]
    assert names == [("ar", "first", 1.0, 5), ("ngram", "first", 1.0, 5), ("ar", "first", 0.0, None),
                     ("ar", "second", 1.0, 6), ("ngram", "second", 1.0, 6)]
    assert len(out["per_prompt"]) == 4


def test_an_interrupted_bench_resumes_from_its_journal(tmp_path):
    tok = ChatTokenizer()
    model = SimpleNamespace(args=SimpleNamespace(max_seq_len=4096))
    calls, fail_at = [], [None]

    def runner(name):
        def run(ids, params, max_new_tokens):
            chat = tok.chats[ids[0]]
            calls.append((name, chat[-1]["content"]))
            if len(calls) == fail_at[0]:
                raise KeyboardInterrupt
            r = AsyncGenerationResult([0], [1, 2, 3, len(chat)], [2, 2] if name == "d3d-async" else [1, 1, 1, 1],
                                      decode_s=0.25 if name == "ar" else 0.125)
            r.stats["packed_hits"] = 1
            r.text = f"reply to {chat[-1]['content']}"
            return r
        return run

    runners = {m: runner(m) for m in ("ar", "d3d-async")}
    prompts = {"chat": ["hello", MultiTurn(("first", "second"))], "math": ["1+1"]}
    clean = run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False)

    journal = tmp_path / "out.json.journal"
    header = {"methods": ["ar", "d3d-async"], "method_settings": {"lookup-tree": {"tree_width_cost_s": {"1": 0.02}}}}
    calls.clear()
    fail_at[0] = 2 + 5  # two warm-ups, then the 5th measured generation ("second" with ar) is killed
    with pytest.raises(KeyboardInterrupt):
        run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, journal=journal, header=header)
    with journal.open("a") as f:
        f.write('{"key": "chat/1/1/ar", "res')  # a line torn by the kill
    calls.clear()
    fail_at[0] = None
    remeasured = {**header, "method_settings": {"lookup-tree": {"tree_width_cost_s": {"1": 0.03}}}}
    resumed = run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, journal=journal,
                        header=remeasured)  # a cost curve measured again is still the same run
    assert resumed["resumed"] == 4
    assert calls[2:] == [("ar", "second"), ("d3d-async", "second"), ("ar", "1+1"), ("d3d-async", "1+1")]
    assert resumed["per_prompt"] == clean["per_prompt"] and resumed["results"] == clean["results"]
    assert all(r["packed_hits"] == r["prompts"] for r in resumed["results"])  # method stats survive the replay

    with pytest.raises(D3DError, match="other settings or prompts"):
        run_bench(model, tok, runners, prompts, SamplingParams(), 8, progress=False, journal=journal,
                  header={"methods": ["ar"]})
    with pytest.raises(D3DError, match="other settings or prompts"):
        run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, journal=journal,
                  header={**header, "method_settings": {"lookup-tree": {"tree_budget": 8}}})
    with pytest.raises(D3DError, match="other settings or prompts"):
        run_bench(model, tok, runners, {"chat": ["hello"]}, SamplingParams(), 4, progress=False, journal=journal,
                  header=header)


def test_a_repeated_bench_reports_the_median_of_its_runs(tmp_path):
    """--repeat 3: the interleaved run made three times, each row's figures the median of the runs' (each run's
    speedup against its own ar), the per-prompt records tagged with their run, a killed run resumed."""
    from d3d.bench.report import pooled

    tok = ChatTokenizer()
    model = SimpleNamespace(args=SimpleNamespace(max_seq_len=4096))
    calls, kill_at, plan = [], [None], {}

    def runner(name):
        def run(ids, params, max_new_tokens):
            if len(calls) == kill_at[0]:
                raise KeyboardInterrupt
            calls.append(name)
            r = _res([1, 2, 3, 4], [1, 1, 1] if name == "ar" else [2, 1], plan[name].pop(0))  # decode seconds
            r.text = "reply"
            return r
        return run

    runners = {"ar": runner("ar"), "ngram": runner("ngram")}
    prompts = {"chat": ["hello", "again"]}
    plan.update(ar=[0.3] * 7, ngram=[0.1] + [0.1, 0.1, 0.3, 0.3, 0.15, 0.15])  # a warm-up, then 3 runs x 2 prompts
    out = run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, repeat=3)
    assert calls == ["ar", "ngram"] * 7  # one warm-up, then each run interleaved per prompt
    row = {r["method"]: r for r in out["results"]}["ngram"]
    assert row["runs"]["speedup_vs_ar"] == pytest.approx([3.0, 1.0, 2.0])
    assert row["speedup_vs_ar"] == pytest.approx(2.0)  # the median run, not the pooled 1.8 / 1.1
    assert row["tokens_per_s"] == pytest.approx(20.0) and row["new_tokens"] == 24 and row["lossless"] is True
    assert [p["run"] for p in out["per_prompt"]] == [0] * 4 + [1] * 4 + [2] * 4
    assert pooled(out)["ngram"]["speedup_vs_ar"] == pytest.approx(2.0)

    journal = tmp_path / "out.json.journal"
    calls.clear()
    kill_at[0] = 2 + 5  # after the warm-ups and 5 measured generations (run 0, then run 1's first ar)
    plan.update(ar=[0.3] * 7, ngram=[0.1] + [0.1, 0.1, 0.3, 0.3, 0.15, 0.15])
    with pytest.raises(KeyboardInterrupt):
        run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, journal=journal, repeat=3)
    calls.clear()
    kill_at[0] = None
    plan.update(ar=[0.3] * 4, ngram=[0.1] + [0.3, 0.3, 0.15, 0.15])  # what is still to run
    resumed = run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, journal=journal, repeat=3)
    assert resumed["resumed"] == 5 and resumed["results"] == out["results"]
    assert resumed["per_prompt"] == out["per_prompt"]
    with pytest.raises(D3DError, match="--repeat"):
        run_bench(model, tok, runners, prompts, SamplingParams(), 4, progress=False, repeat=0)


# ---------------------------------------------------------------- report

def _fixture_report() -> dict:
    def row(b, m, tau, tps, speedup, lossless=True, hist=None):
        r = {"benchmark": b, "method": m, "prompts": 2, "tau": tau, "tokens_per_s": tps, "tpot_s": 1 / tps,
             "speedup_vs_ar": speedup, "lossless": lossless, "new_tokens": 40}
        if hist is not None:
            r["tau_histogram"] = hist
        return r

    results = [row("gsm8k", "ar", 1.0, 8.0, 1.0, hist=[38, 0, 0, 0]),
               row("gsm8k", "ngram", 2.5, 16.0, 2.0, hist=[4, 2, 3, 4]),
               row("gsm8k", "d3d", 3.0, 20.0, 2.5, lossless=False, hist=[2, 2, 2, 4]),
               row("mt-bench", "ar", 1.0, 10.0, 1.0),
               row("mt-bench", "ngram", 1.5, 11.0, 1.1),
               row("mt-bench", "d3d", 2.0, 15.0, 1.5)]
    lengths = {"ar": [1] * 19, "ngram": [2] * 9 + [1], "d3d": [4] * 4 + [3]}  # 19 tokens after the prefill's
    seconds = {"ar": 2.0, "ngram": 1.0, "d3d": 0.5}
    per_prompt = [{"benchmark": b, "method": m, "prompt_index": i, "new_tokens": 20, "rounds": len(lengths[m]),
                   "decode_s": seconds[m] * (2 if b == "mt-bench" else 1), "acceptance_lengths": lengths[m],
                   "tau": 19 / len(lengths[m])}
                  for b in ("gsm8k", "mt-bench") for m in ("ar", "ngram", "d3d") for i in range(2)]
    return {"command": "d3d bench --quick --out x.json", "settings": {"temperature": 0.0, "max_new_tokens": 16,
                                                                      "block_size": 16},
            "machine": {"cpu": "Test CPU", "threads": 1, "device": "cpu", "torch": "2.x",
                        "git_commit": "0123456789abcdef", "git_dirty": False},
            "results": results, "per_prompt": per_prompt}


def test_report_rendering(tmp_path, capsys):
    report = _fixture_report()
    table = markdown_table(report).splitlines()
    assert table[0] == "| benchmark | ar tok/s | ngram tau | ngram speedup | d3d tau | d3d speedup |"
    assert table[2] == "| gsm8k | 8.0 | 2.50 | 2.00x | 3.00 | 2.50x † |"
    assert table[3] == "| mt-bench | 10.0 | 1.50 | 1.10x | 2.00 | 1.50x |"
    # pooled over the 4 generations of each method: 76 decoded tokens in 12 / 6 / 3 s, 76 over 76 / 40 / 20 rounds
    assert table[4] == "| **all** | **6.3** | **1.90** | **2.00x** | **3.80** | **4.00x** |"
    without_prompts = {k: v for k, v in report.items() if k != "per_prompt"}  # arithmetic means over benchmarks
    assert markdown_table(without_prompts).splitlines()[4] == \
        "| **all** | **9.0** | **2.00** | **1.55x** | **2.50** | **2.00x** |"
    assert "not lossless" in table[-1]

    src = tmp_path / "run.json"
    src.write_text(json.dumps(report))
    out_dir = tmp_path / "rep"
    assert main(["report", str(src), "--out-dir", str(out_dir)]) == 0
    md = (out_dir / "REPORT.md").read_text()
    assert md == capsys.readouterr().out
    assert "| gsm8k | 8.0 | 2.50 | 2.00x | 3.00 | 2.50x † |" in md
    assert "Command: `d3d bench --quick --out x.json`" in md and "d3d commit 0123456789" in md
    for name in ("speedup", "tau_hist", "tps_vs_tau"):
        png = out_dir / f"run_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"![{name}](run_{name}.png)" in md

    # two files: one section each, plots kept apart
    md, files = write_report([src, src], out_dir)
    assert md.count("## run.json") == 2 and (out_dir / "run_2_speedup.png") in files


def test_report_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"results": []}')
    assert main(["report", str(bad)]) == 2
    assert "not a d3d bench result" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
def test_quick_bench_end_to_end(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, "-m", "d3d.cli", "bench", "--quick", "--benchmarks", "gsm8k,mt-bench",
                           "--methods", "ar,ngram", "--threads", "1", "--save-outputs", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "speedup_vs_ar" in proc.stdout  # the printed table
    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "command", "settings", "results", "per_prompt"}
    assert set(report["machine"]) >= {"cpu", "kernels", "cores", "torch", "threads", "device"}
    assert report["command"].startswith("d3d bench --quick ")
    assert report["settings"]["quick"] is True and report["settings"]["max_new_tokens"] == 16
    assert report["resumed"] == 0 and not (tmp_path / "quick.json.journal").exists()
    assert report["settings"]["benchmarks"] == ["gsm8k", "mt-bench"]
    assert "git_commit" in report["machine"] and report["machine"]["threads"] == 1
    rows = {(r["benchmark"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(b, m) for b in ("gsm8k", "mt-bench") for m in ("ar", "ngram")}
    assert rows[("gsm8k", "ar")]["prompts"] == 1 and rows[("mt-bench", "ar")]["prompts"] == 2  # both turns
    for r in rows.values():
        assert set(r) >= {"benchmark", "method", "prompts", "tau", "tokens_per_s", "tpot_s", "speedup_vs_ar",
                          "lossless"}
        assert r["lossless"] is True and r["tokens_per_s"] > 0 and r["tau"] >= 1.0
        assert r["new_tokens"] <= 16 * r["prompts"]
    assert rows[("gsm8k", "ar")]["speedup_vs_ar"] == 1.0 and rows[("gsm8k", "ar")]["tau"] == 1.0
    assert len(report["per_prompt"]) == 6
    for r in report["per_prompt"]:
        assert set(r) >= {"benchmark", "method", "prompt_index", "new_tokens", "rounds", "decode_s", "tau",
                          "token_ids", "text"}
        assert len(r["token_ids"]) == r["new_tokens"]
    per = [p for p in report["per_prompt"] if p["benchmark"] == "mt-bench"]
    assert sorted((p["method"], p["turn"]) for p in per) == [("ar", 1), ("ar", 2), ("ngram", 1), ("ngram", 2)]
    for (b, m), r in rows.items():
        prompt_rows = [p for p in report["per_prompt"] if (p["benchmark"], p["method"]) == (b, m)]
        assert sum(r["tau_histogram"]) == sum(p["rounds"] for p in prompt_rows)


@pytest.mark.slow
def test_bench_runs_each_method_once_per_named_drafter_and_datastore(tmp_path):
    """--drafters NAME=PATH: d3d runs once per drafter (rows d3d@NAME); --datastores NAME=PATH: lookup-tree and
    d3d-tree run once per datastore (rows METHOD@NAME, and METHOD@DRAFTER@DATASTORE with --drafters), each with
    its own; ngram runs once, and all of them interleaved in one run."""
    from d3d.corpus.datastore import SHIPPED
    from d3d.methods.catalog import DEFAULT_DRAFTERS

    shipped = str(DEFAULT_DRAFTERS / "SmolLM2-135M-Instruct")
    store = str(SHIPPED / "SmolLM2-135M-Instruct.npz")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Count from 1 to 5."}\n')
    out = tmp_path / "runs.json"
    assert main(["bench", "--prompts", str(prompts), "--methods", "lookup-tree,ngram,d3d-tree,d3d", "--datastores",
                 f"s={store}", "off=none", "--drafters", f"a={shipped}", f"b={shipped}", "--max-new-tokens", "8",
                 "--draft-k", "15", "--threads", "1", "--out", str(out)]) == 0  # sized d3d follows each build's timings
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["ar", "lookup-tree@s", "lookup-tree@off", "ngram", "d3d-tree@a@s", "d3d-tree@a@off",
                          "d3d-tree@b@s", "d3d-tree@b@off", "d3d@a", "d3d@b"]
    assert all(r["lossless"] for r in rows.values()) and rows["d3d@a"]["tau"] == rows["d3d@b"]["tau"]
    assert report["settings"]["drafters"] == {"a": shipped, "b": shipped}
    assert report["settings"]["drafter_weights"]["d3d@a"] == report["settings"]["drafter_weights"]["d3d@b"]
    used = {name: s.get("datastore") for name, s in report["settings"]["method_settings"].items()}
    assert used["lookup-tree@s"] == used["d3d-tree@a@s"] == used["d3d-tree@b@s"] == store
    assert used["lookup-tree@off"] is None and used["d3d-tree@a@off"] is None
    assert report["settings"]["datastores"] == {"s": store, "off": "none"}


@pytest.mark.slow
def test_batched_bench_end_to_end(tmp_path):
    """d3d bench --clients: each method at 1 and 2 concurrent generations on one batched target, every answer
    token for token its solo answer, the figures `d3d loadtest --throughput` reports, a plot."""
    out = tmp_path / "batched.json"
    main(["bench", "--clients", "2,1", "--benchmarks", "gsm8k,humaneval", "--limit", "1", "--methods", "lookup-tree",
          "--max-new-tokens", "12", "--threads", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["clients"] == [1, 2] and report["requests"] == 2 and report["learn"] is False
    assert set(report["machine"]) >= {"cpu", "kernels", "threads"} and report["runtime"]["kernels"]
    assert set(report["servers"]) == {"ar", "lookup-tree"}
    for method, result in report["servers"].items():
        one, two = result["levels"]
        assert (one["clients"], two["clients"]) == (1, 2)
        for level in (one, two):
            assert level["identical_to_solo"] == 2 and 0 < level["completion_tokens"] <= 2 * 12
            assert level["aggregate_tokens_per_s"] > 0 and level["ttft_p50_s"] <= level["ttft_p95_s"]
            assert level["forwards"] > 0 and "x_ar" in level
        assert one["x_one_client"] == 1.0
        assert two["completion_tokens"] == one["completion_tokens"]
    assert (tmp_path / "batched.png").stat().st_size > 0
