"""`d3d loadtest`'s abuse phases against a tiny in-process server (no download, no big model): the cases
phase gets every expected answer (421, 400, 408, closed), the long-prompt phase sees the worker freed
soon after its client leaves, the connections phase holds many slow or idle connections while small
requests are answered; the log scan, the verdicts and the CLI checks on synthetic input.

The server is `create_app` + `server_config` (the limits `d3d serve` runs with) around a Generator of a
tiny random Transformer with a character tokenizer, its first layer sleeping during each prompt chunk
so that a long prompt takes a while; timeouts are scaled down (read timeout 1 s, request timeout 3 s).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from d3d.cli import main
from d3d.server.loadtest import plain_answer, streamed_answer
from d3d.server.loadtest_base import SMALL, Endpoint, scan_log
from d3d.server.loadtest_cases import run_cases
from d3d.server.loadtest_hold import connections_phase, long_prompt_phase, long_text
from d3d.server.loadtest_report import verdict_lines, verdicts
from helpers import tiny_args

V, EOS, CHUNK, CHUNK_S = 64, 1, 32, 0.05
CONTEXT = 2048
READ_TIMEOUT, REQUEST_TIMEOUT = 1.0, 3.0
KEY = "sk-loadtest"
SPECIAL = "<|im_start|>"


class CharTokenizer:
    """One token per character; a ChatML-like template with two special tokens."""
    eos_token_id = EOS
    chat_template = "chatml"
    all_special_tokens = [SPECIAL, "<|im_end|>"]

    def __len__(self):
        return V

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [2 + ord(c) % (V - 2) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("".join(f"{SPECIAL}{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
                           + f"{SPECIAL}assistant\n")

    def decode(self, ids, **kw) -> str:
        return "".join(chr(97 + i % 26) for i in ids if i != EOS)


@pytest.fixture(scope="module")
def served():
    import uvicorn

    from d3d.api import Generator
    from d3d.decoding.engine import generate
    from d3d.server.app import create_app, server_config
    from d3d.server.loadtest_base import free_port
    from d3d.runtime.target import Transformer

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(tiny_args(V, CONTEXT)).eval().requires_grad_(False)
    tok = CharTokenizer()
    model.layers[0].register_forward_pre_hook(lambda m, args: time.sleep(CHUNK_S) if args[0].shape[1] > 1 else None)

    def runner(prompt_ids, params=None, max_new_tokens=16, stop=None, on_round=None, logprobs=None):
        return generate(model, tok, prompt_ids, params, max_new_tokens, stop=stop, on_round=on_round,
                        logprobs=logprobs)

    gen = Generator(model, tok, Path("tiny"), "ar", runner, block_size=1)
    app = create_app(gen, max_queue=4, api_key=KEY, request_timeout=REQUEST_TIMEOUT, prefill_chunk=CHUNK,
                     read_timeout=READ_TIMEOUT)
    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, "warning", read_timeout=READ_TIMEOUT))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield Endpoint("127.0.0.1", port, KEY, os.getpid()), gen
    finally:
        server.should_exit = True
        thread.join(10)


def test_cases_phase_gets_every_expected_answer(served):
    ep, _ = served
    t0 = time.monotonic()
    rows = run_cases(ep, CONTEXT, SPECIAL, READ_TIMEOUT)
    assert all(r["held"] for r in rows), [r for r in rows if not r["held"]]
    got = {r["got"] for r in rows}
    assert {"421 host_not_allowed", "400 context_length_exceeded", "400 special_token", "408", "closed"} <= got
    assert sum(r["got"] == "421 host_not_allowed" for r in rows) == 6
    assert time.monotonic() - t0 < READ_TIMEOUT + 4  # the slow cases run side by side
    assert ep.idle()


def test_long_text_reaches_the_token_count():
    pieces = ["one two three", "four five", "six"]
    encode = str.split
    text, n = long_text(encode, 100, pieces)
    assert n == len(encode(text)) and 100 <= n < 103 and text.startswith("one two three\nfour five")


def test_long_prompt_phase_frees_the_worker(served):
    ep, gen = served
    text, n = long_text(lambda t: gen.encode(t, raw=True), 1200, ["The quick brown fox.", "Once upon a time,"])
    assert 1200 <= n < 1220  # ~38 chunks, ~1.9 s of prefill
    out = long_prompt_phase(ep, text, n, leave_after=0.5, request_timeout=REQUEST_TIMEOUT)
    assert out["held"] and out["bar_s"] == REQUEST_TIMEOUT + 2 and out["prompt_tokens"] == n
    for run in out["runs"]:
        assert run["busy_when_left"] and run["next_status"] == 200, run
        assert run["freed_after_leave_s"] < 0.6, run  # one chunk (0.05 s) plus polling, not the ~1.4 s left
        assert run["server_cancelled"] == 1, run
    assert [r["stream"] for r in out["runs"]] == [False, True]


def test_connections_phase_holds(served):
    ep, _ = served
    out = connections_phase(ep, 24, hold_s=2.6, held_bytes=32 << 10, every=0.2, pace=0.3)
    assert out["held"] == {"small_answered_in_time": True, "memory": True, "connections_ended_as_expected": True}, out
    assert out["open_during"]["median"] >= 20 and out["small_requests"] >= 5
    for kind, o in out["outcomes"].items():  # each kind ended (and was reopened) at least once
        assert o["got"].get(o["expect"], 0) >= 6, (kind, o)
    assert out["rss_mb"]["idle"] > 0 and out["rss_mb"]["peak_over_idle"] is not None
    assert ep.request("POST", "/v1/chat/completions", SMALL)[0] == 200


def test_scan_log_counts_5xx_and_tracebacks():
    log = "\n".join([
        'INFO:     127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:5001 - "GET /metrics HTTP/1.1" 421 Misdirected Request',
        'INFO:     127.0.0.1:5002 - "POST /v1/completions HTTP/1.1" 504 Gateway Timeout',
        "request body from 127.0.0.1 not received within 10 s: 408",
        "ERROR:d3d.server:unhandled error", "Traceback (most recent call last):", '  File "x.py", line 1'])
    out = scan_log(log)
    assert out["access_by_class"] == {"2xx": 1, "4xx": 1, "5xx": 1} and out["status_5xx"] == 1
    assert out["tracebacks"] == 1 and out["trouble_lines"] == 2 and out["lines"] == 7
    assert "504" in out["examples"][0]
    clean = scan_log('INFO: 127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK\nINFO: Shutting down')
    assert clean["status_5xx"] == 0 and clean["tracebacks"] == 0 and clean["examples"] == []


def test_verdicts_and_lines():
    conn = {"held": {"small_answered_in_time": True, "memory": False, "connections_ended_as_expected": True},
            "rss_mb": {"idle": 400.0, "peak": 520.0, "peak_over_idle": 120.0},
            "small_latency_s": {"p50": 0.4, "max": 1.1}, "small_requests": 30, "small_status": {"200": 30},
            "open_during": {"median": 199}, "outcomes": {"idle": {"expect": "closed", "got": {"closed": 50}}}}
    out = {"greedy_checked": 3, "greedy_all_equal_ar": True, "greedy_mismatches": [], "greedy_cut_by_deadline": 1,
           "server_5xx": 0, "cases": [{"case": "x", "expect": "421", "got": "421", "seconds": 0.1, "held": True}],
           "long_prompt": {"held": True, "prompt_tokens": 4001, "leave_after_s": 2, "bar_s": 12,
                           "runs": [{"stream": False, "freed_after_leave_s": 1.5, "next_status": 200,
                                     "next_answered_after_leave_s": 2.0}]},
           "connections": conn,
           "server_log": {"status_5xx": 0, "tracebacks": 0, "trouble_lines": 0, "lines": 10}}
    out["held"] = verdicts(out)
    assert out["held"]["connections_memory_within_100mb"] is False
    assert all(v for k, v in out["held"].items() if k != "connections_memory_within_100mb")
    lines = verdict_lines(out)
    assert len(lines) == len(out["held"])
    assert any(line.startswith("FAILED: connections_memory") and "+120.0 MB" in line for line in lines)
    assert any("worker free after 1.5 s" in line for line in lines)
    # a 5xx in any phase fails zero_5xx; no log (a server at --url): tracebacks not measured
    out["connections"]["small_status"] = {"200": 29, "503": 1}
    out.pop("server_log")
    held = verdicts(out)
    assert held["zero_5xx"] is False and held["zero_tracebacks"] is None


def test_answers_cut_by_the_deadline_are_recognised():
    plain = json.dumps({"choices": [{"message": {"content": "Paris"}}], "d3d": {"finish_reason": "timeout"}})
    assert plain_answer(plain.encode(), True) == ("Paris", "timeout")
    chunks = [{"choices": [{"text": "Par"}]}, {"choices": [{"text": "is"}]},
              {"choices": [{"text": ""}], "d3d": {"finish_reason": "length"}}]
    raw = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    assert streamed_answer(raw.encode(), False) == ("Paris", "length")


@pytest.mark.parametrize("args, contains", [
    (["--phases", "random,bogus"], "unknown bogus"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--connections", "0"], "--connections"),
    (["--throughput", "--repeat", "0"], "--repeat"),
])
def test_cli_options_checked_before_anything_starts(args, contains, capsys):
    t0 = time.monotonic()
    assert main(["loadtest", *args]) == 2
    err = capsys.readouterr().err
    assert contains in err and len(err.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 5


def level(clients: int, tok_s: float, ttft: float | None, same: int | None = None) -> dict:
    lv = {"clients": clients, "requests": 4, "aggregate_tokens_per_s": tok_s,
          "per_request_tokens_per_s_p50": tok_s / clients, "ttft_p50_s": ttft, "ttft_p95_s": ttft,
          "statuses": {"200": 4}}
    return lv if same is None else {**lv, "identical_to_solo": same}


def test_repeated_throughput_turns_alternate_and_report_medians(monkeypatch):
    """--repeat N runs all the servers N times, every other turn in reverse order, and reports each figure's median
    over the turns, the counts summed, each turn's ratios to one client, and the turns themselves."""
    import d3d.server.loadtest_throughput as lt
    from d3d.server.loadtest_base import LoadTest

    runs = iter([[10.0, 30.0], [20.0, 40.0], [12.0, 60.0], [8.0, 20.0], [11.0, 35.0], [16.0, 44.0]])
    calls = []

    def measure(cfg, name, prompts, levels, long, logs, max_batch):
        calls.append(name)
        logs.append(f"{name} log")
        one, eight = next(runs)
        out = {"levels": [level(1, one, 0.5), level(8, eight, None if name == "b" and len(calls) == 2 else 1.0, 4)],
               "rss_mb": 100.0 * len(calls)}
        if name == "a":
            out["long_prompt_ttft"] = {"prompt_tokens": 4000, "long_ttft_s": len(calls), "long_status": 200,
                                       "short_requests": 6, "short_ttft_p50_s": 0.1 * len(calls),
                                       "short_ttft_p95_s": 0.2 * len(calls), "shorts_during_prefill": 6,
                                       "short_statuses": ["200"]}
        return out

    monkeypatch.setattr(lt, "_measure", measure)
    out = lt.run_throughput(LoadTest(max_tokens=8), ["a", "b"], (1, 8), requests=4, llama_cpp=False, repeat=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    a, b = out["servers"]["a"], out["servers"]["b"]
    assert [lv["aggregate_tokens_per_s"] for lv in a["levels"]] == [10.0, 30.0]  # of 10/30, 8/20, 11/35
    assert [lv["aggregate_tokens_per_s"] for lv in b["levels"]] == [16.0, 44.0]  # of 20/40, 12/60, 16/44
    assert a["x_one_client_by_turn"] == [[1.0, 3.0], [1.0, 2.5], [1.0, round(35 / 11, 3)]]
    assert b["levels"][1]["ttft_p95_s"] == 1.0  # the turn in which no request got a token leaves it out
    assert a["levels"][1]["identical_to_solo"] == 12 and a["levels"][1]["requests"] == 12
    assert a["levels"][1]["statuses"] == {"200": 12} and len(a["turns"]) == 3
    assert a["long_prompt_ttft"]["short_ttft_p95_s"] == 0.8 and a["long_prompt_ttft"]["short_requests"] == 18
    assert "long_prompt_ttft" not in b and a["rss_mb"] == 500.0 and out["repeat"] == 3
    assert a["server_log"]["lines"] == 3


def test_a_failed_turn_is_reported_as_the_servers_error():
    from d3d.server.loadtest_throughput import medians

    good = {"levels": [level(1, 10.0, 0.5)]}
    out = medians([good, {"error": "D3DError: the server did not start"}])
    assert out["error"] == "D3DError: the server did not start" and len(out["turns"]) == 2
