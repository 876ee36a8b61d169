"""`d3d serve` over real HTTP on loopback: answers equal the CLI's / engine's greedy output (plain and
streamed, chat and text completions), concurrent clients, 400s for bad input, 503 when the queue is
full, a disconnecting client frees its slot, /metrics and /health, logprobs, origin / content-type /
body-size checks, the Python API, and the web page in headless Chromium (typed prompt, streamed
answer, screenshot).

One server subprocess (`--method ngram --threads 1 --max-queue 3 --max-batch 1`: one generation at a time, so
that the queue tests know what runs) serves most tests; an in-process one with --max-batch 3 serves concurrent
requests in batched forwards (continuous batching, d3d.scheduler). Answers are
kept short (<= 16 tokens) because the machine is small. An in-process server with a scripted runner
(exact rounds) and an API key, an extra allowed origin and a request timeout covers authentication,
CORS, disconnects within one round, deadlines and a failing generation.
"""
from __future__ import annotations

import base64
import fcntl
import http.client
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

MAX = 16
MAX_QUEUE = 3
PROMPT_A = "What is the capital of France? Answer briefly."
PROMPT_B = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."
RAW_PROMPT = "The capital of France is"
SLOW_PROMPT = "Write a long story about a dragon who learns to bake bread."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int, key: str | None = None):
        self.port, self.key = port, key
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120,
                headers: dict | None = None, full: bool = False):
        """(status, parsed JSON or text) of one request; with `full`, the response headers too."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {k: v for k, v in (self.headers | (headers or {})).items() if v is not None}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            out = resp.status, json.loads(text)
        except ValueError:
            out = resp.status, text
        return out + (resp.headers,) if full else out

    def post(self, path: str, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def open_stream(self, path: str, body: dict, timeout: float = 120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=json.dumps(body | {"stream": True}).encode(), headers=self.headers)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        return conn, resp

    @staticmethod
    def events(resp):
        """Yield each `data:` payload (parsed JSON, or the string "[DONE]")."""
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                yield data if data == "[DONE]" else json.loads(data)

    def stream(self, path: str, body: dict) -> list:
        conn, resp = self.open_stream(path, body)
        try:
            return list(self.events(resp))
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Start the server and one CLI run (`d3d generate --json`, method ngram), compute the references
    in-process meanwhile (Python API, method ar), then wait for the server. Yields (server, references dict,
    CLI JSON output)."""
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "d3d.cli", "serve", "--method", "ngram", "--threads", "1",
                             "--port", str(port), "--max-queue", str(MAX_QUEUE), "--max-batch", "1"], stdout=log,
                            stderr=subprocess.STDOUT)
    cli = subprocess.Popen([sys.executable, "-m", "d3d.cli", "generate", PROMPT_A, "--method", "ngram",
                            "--max-new-tokens", str(MAX), "--json", "--threads", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import torch

    threads = torch.get_num_threads()  # restored afterwards: torch's thread count is process-wide
    try:
        from d3d import load

        gen = load(method="ar", threads=1)
        refs = {p: gen.generate(p, max_new_tokens=MAX, return_result=True) for p in (PROMPT_A, PROMPT_B)}
        refs["raw"] = gen.generate(RAW_PROMPT, max_new_tokens=MAX, raw=True, stop=["."], return_result=True)
        refs["gen"] = gen
        out, err = cli.communicate(timeout=300)
        assert cli.returncode == 0, err
        server = Server(port)
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()
            try:
                if server.request("GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)
        server.log = tmp / "server.log"
        yield server, refs, json.loads(out)
    finally:
        torch.set_num_threads(threads)
        for p in (cli, proc):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        log.close()


def chat(prompt: str, max_tokens: int = MAX, **kw) -> dict:
    return {"model": "anything", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens} | kw


def streamed_text(events: list, chat_mode: bool = True) -> tuple[str, list[int], str | None]:
    """(concatenated text, concatenated d3d token ids, finish_reason) of a stream; checks its framing."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    text, ids, finish = "", [], None
    for e in events[:-1]:
        assert "error" not in e, e
        for c in e["choices"]:
            text += (c["delta"].get("content") or "") if chat_mode else c["text"]
            finish = c["finish_reason"] or finish
        ids += e.get("d3d", {}).get("tokens", [])
    return text, ids, finish


class StopGeneration(Exception):
    pass


def _tiny_runs():
    """(target, prompt, {method: run(**kw)}) on tiny random models for ar, ngram, d3d and d3d-async."""
    from d3d.decoding.async_engine import generate_async
    from d3d.decoding.engine import generate
    from d3d.methods.ngram import NgramProposer
    from d3d.methods.d3d import D3DProposer
    from helpers import StubTokenizer, tiny_pair

    target, drafter = tiny_pair(64, 4, peaky=False)
    tok = StubTokenizer(64, eos=-1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    runs = {"ar": lambda **kw: generate(target, tok, prompt, **kw),
            "ngram": lambda **kw: generate(target, tok, prompt, proposer=NgramProposer(), block_size=4, **kw),
            "d3d": lambda **kw: generate(target, tok, prompt, proposer=D3DProposer(drafter, 64, 128), block_size=4,
                                         **kw),
            "d3d-async": lambda **kw: generate_async(target, tok, prompt, drafter=drafter, **kw)}
    return target, prompt, runs


def test_on_round_reports_every_round():
    """The engines' on_round(chunk, accepted) hook that streaming relies on: chunks concatenate to the
    output, accepted counts match the acceptance lengths, for every method (tiny random models)."""
    _, _, runs = _tiny_runs()
    for method, run in runs.items():
        rounds = []
        res = run(max_new_tokens=20, on_round=lambda chunk, accepted: rounds.append((list(chunk), accepted)))
        assert [t for chunk, _ in rounds for t in chunk] == res.token_ids, method
        assert rounds[0] == ([res.token_ids[0]], 0), method  # the prefill's token
        assert [a + 1 for _, a in rounds[1:]] == res.acceptance_lengths, method

        def stop_early(chunk, accepted):
            if len(rounds) == 2:
                raise StopGeneration
            rounds.append(chunk)

        rounds = []
        with pytest.raises(StopGeneration):
            run(max_new_tokens=20, on_round=stop_early)


def test_logprobs_recorded_for_every_method():
    """The engines' opt-in logprobs recorder: one entry per emitted token, equal to the log-softmax of the
    target's logits over the whole text (one full forward), greedy and sampled; off by default."""
    import torch

    from d3d.decoding.engine import LogprobRecorder
    from d3d.decoding.verify import SamplingParams

    target, prompt, runs = _tiny_runs()
    for method, run in runs.items():
        assert run(max_new_tokens=6).logprobs is None
        for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=1)):
            rec = LogprobRecorder(top=3)
            res = run(max_new_tokens=20, params=params, logprobs=rec)
            assert res.logprobs is rec.entries and [e.token for e in rec.entries] == res.token_ids, method
            target.setup_cache(1, 64)
            lp = torch.log_softmax(target(torch.tensor([prompt + res.token_ids]))[0, len(prompt) - 1:-1], -1)
            assert [e.logprob for e in rec.entries] == pytest.approx(
                lp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0].tolist(), abs=1e-4), method
            assert [v for e in rec.entries for _, v in e.top] == pytest.approx(
                lp.topk(3, -1).values.flatten().tolist(), abs=1e-4), method


@pytest.mark.slow
def test_health_and_models(env):
    server, _, _ = env
    status, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["method"] == "ngram"
    status, body = server.request("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_cli_json_has_every_field(env):
    cli = env[2]
    for key in ("method", "text", "token_ids", "new_tokens", "rounds", "acceptance_lengths", "tau", "decode_s",
                "tokens_per_s", "cpu", "kernels"):
        assert key in cli
    assert cli["method"] == "ngram"
    assert 0 < cli["new_tokens"] == len(cli["token_ids"]) <= MAX
    assert cli["rounds"] == len(cli["acceptance_lengths"])


@pytest.mark.slow
def test_python_api_equals_cli(env):
    """The CLI ran ngram: its tokens are plain decoding's."""
    _, refs, cli = env
    assert refs[PROMPT_A].token_ids == cli["token_ids"]
    assert refs[PROMPT_A].text == cli["text"]
    assert refs["gen"].generate(PROMPT_A, max_new_tokens=4) == refs["gen"].tokenizer.decode(cli["token_ids"][:4])


@pytest.mark.slow
def test_chat_plain_and_streamed_equal_cli(env):
    server, refs, cli = env
    ref = refs[PROMPT_A]
    status, body = server.post("/v1/chat/completions", chat(PROMPT_A))
    assert status == 200, body
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": cli["text"]}
    assert body["choices"][0]["finish_reason"] == ("length" if ref.finish_reason == "length" else "stop")
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_ids)
    assert body["usage"]["total_tokens"] == len(ref.prompt_ids) + len(ref.token_ids)

    events = server.stream("/v1/chat/completions", chat(PROMPT_A, stream_options={"include_usage": True}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text, ids, finish = streamed_text(events)
    assert text == cli["text"] and ids == cli["token_ids"]
    assert finish == body["choices"][0]["finish_reason"]
    assert events[-2]["usage"] == body["usage"] and events[-2]["choices"] == []


@pytest.mark.slow
def test_streamed_rounds_mark_drafts(env):
    """Prompt B copies its prompt, so n-gram drafts get accepted: the per-round d3d fields add up."""
    server, refs, _ = env
    ref = refs[PROMPT_B]
    events = server.stream("/v1/chat/completions", chat(PROMPT_B))
    text, ids, _ = streamed_text(events)
    assert text == ref.text and ids == ref.token_ids
    rounds = [e["d3d"] for e in events[:-1] if "d3d" in e and "accepted" in e["d3d"] and e["d3d"]["tokens"]]
    final = events[-2]["d3d"]
    assert len(rounds) == final["rounds"] + 1  # + the prefill's token
    assert sum(r["accepted"] for r in rounds) > 0
    assert final["tau"] == pytest.approx(sum(r["accepted"] + 1 for r in rounds[1:]) / final["rounds"], abs=1e-3)
    for e in events[:-1]:
        if "segments" in e.get("d3d", {}):
            assert e["choices"][0]["delta"]["content"] == "".join(s["text"] for s in e["d3d"]["segments"])


@pytest.mark.slow
def test_text_completions_plain_and_streamed(env):
    server, refs, _ = env
    ref = refs["raw"]
    body = {"prompt": RAW_PROMPT, "max_tokens": MAX, "stop": ".", "temperature": 0, "top_p": 1, "seed": 3}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == ref.text and "." not in ref.text
    assert out["usage"]["completion_tokens"] == len(ref.token_ids)
    text, ids, finish = streamed_text(server.stream("/v1/completions", body), chat_mode=False)
    assert text == ref.text and ids == ref.token_ids
    assert finish == out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_sampling_with_seed_is_reproducible(env):
    server, _, _ = env
    body = chat(PROMPT_A, max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    answers = [server.post("/v1/chat/completions", body) for _ in range(2)]
    assert [a[0] for a in answers] == [200, 200]
    assert answers[0][1]["choices"][0]["message"] == answers[1][1]["choices"][0]["message"]


@pytest.mark.slow
def test_four_concurrent_clients(env):
    server, refs, _ = env
    jobs = [(PROMPT_A, False), (PROMPT_B, True), (PROMPT_A, True), (PROMPT_B, False)]
    results: dict[int, str] = {}

    def client(i: int, prompt: str, stream: bool) -> None:
        if stream:
            results[i] = streamed_text(server.stream("/v1/chat/completions", chat(prompt)))[0]
        else:
            status, body = server.post("/v1/chat/completions", chat(prompt))
            results[i] = body["choices"][0]["message"]["content"] if status == 200 else f"HTTP {status}: {body}"

    threads = [threading.Thread(target=client, args=(i, p, s)) for i, (p, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == {i: refs[p].text for i, (p, _) in enumerate(jobs)}


BAD_CHAT = [
    (b"{not json", "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    ({"messages": "hello"}, "must be a list"),
    ({"messages": []}, "must not be empty"),
    ({"max_tokens": 8}, "'messages' is required"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty"),
    (chat("hi", max_tokens=0), "max_tokens"),
    (chat("hi", max_tokens=-5), "max_tokens"),
    (chat("hi", max_tokens="ten"), "max_tokens"),
    (chat("hi", temperature=-0.1), "temperature"),
    (chat("hi", temperature=2.5), "temperature"),
    (chat("hi", temperature="hot"), "temperature"),
    (chat("hi", top_p=0), "top_p"),
    (chat("hi", top_p=1.5), "top_p"),
    (chat("hi", stop=[1]), "stop"),
    (chat("hi", seed="x"), "seed"),
    (chat("hi", n=2), "n=1"),
    (chat("hi", stream="yes"), "stream"),
    (chat("hi", max_tokens=100_000), "context window"),
    (chat("lorem ipsum " * 5000, max_tokens=8), "prompt too long"),
]
BAD_COMPLETION = [
    ({"max_tokens": 8}, "'prompt' is required"),
    ({"prompt": 42}, "'prompt' must be"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": [10**9]}, "token ids"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": 9}, "temperature"),
]


@pytest.mark.slow
def test_bad_input_gets_400(env):
    server, _, _ = env
    before = server.metrics().get("d3d_generations_total", 0)
    for path, cases in (("/v1/chat/completions", BAD_CHAT), ("/v1/completions", BAD_COMPLETION)):
        for body, fragment in cases:
            for stream in (False, True):
                if isinstance(body, bytes):
                    if stream:
                        continue
                    status, out = server.post(path, raw=body)
                else:
                    status, out = server.post(path, ({"stream": True} if stream else {}) | body)
                assert status == 400, (body, status, out)
                err = out["error"]
                assert err["type"] == "invalid_request_error" and fragment in err["message"], (body, err)
    assert server.metrics().get("d3d_generations_total", 0) == before  # nothing reached the model
    status, out = server.request("GET", "/no/such/path")
    assert status == 404 and "error" in out


@pytest.mark.slow
def test_queue_full_503_and_disconnect_frees_slot(env):
    """A long streamed generation runs; MAX_QUEUE requests wait behind it; one more gets 503. Then the
    streaming client hangs up: its generation stops, the waiting requests run and get the right answers."""
    server, refs, _ = env
    before = server.metrics()
    conn, resp = server.open_stream("/v1/chat/completions", chat(SLOW_PROMPT, max_tokens=400))
    got = server.events(resp)
    while not next(got).get("d3d"):  # the first generated token: the slow request is running
        pass
    ref = refs[PROMPT_A]
    results: dict[int, tuple] = {}

    def waiter(i: int) -> None:
        results[i] = server.post("/v1/chat/completions", chat(PROMPT_A, max_tokens=4))

    def wait_queue(n: int) -> None:
        deadline = time.monotonic() + 30
        while server.metrics()["d3d_queue_waiting"] != n:
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.05)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(MAX_QUEUE - 1)]
    for t in threads:
        t.start()
    wait_queue(MAX_QUEUE - 1)
    quitter = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # waits, then hangs up
    quitter.request("POST", "/v1/chat/completions", body=json.dumps(chat(PROMPT_A)).encode(),
                    headers={"Content-Type": "application/json"})
    wait_queue(MAX_QUEUE)
    m = server.metrics()
    assert m["d3d_generation_running"] == 1 and m["d3d_queue_waiting"] == MAX_QUEUE

    for stream in (False, True):
        status, out = server.post("/v1/chat/completions", chat(PROMPT_A, stream=stream))
        assert status == 503, out
        assert out["error"]["code"] == "queue_full" and "retry" in out["error"]["message"]

    quitter.sock.shutdown(socket.SHUT_RDWR)  # a queued (non-streaming) client goes away: its slot frees
    quitter.close()
    wait_queue(MAX_QUEUE - 1)
    assert server.metrics()["d3d_generation_running"] == 1  # the slow generation still runs

    conn.sock.shutdown(socket.SHUT_RDWR)  # the streaming client goes away mid-stream
    conn.close()
    for t in threads:
        t.join(120)
    expected = refs["gen"].tokenizer.decode(ref.token_ids[:4], skip_special_tokens=True)
    assert [r[0] for r in results.values()] == [200] * (MAX_QUEUE - 1)
    assert [r[1]["choices"][0]["message"]["content"] for r in results.values()] == [expected] * (MAX_QUEUE - 1)
    after = server.metrics()
    assert after["d3d_requests_cancelled_total"] == before.get("d3d_requests_cancelled_total", 0) + 2
    # neither the slow generation nor the quitter's completed
    assert after["d3d_generations_total"] == before["d3d_generations_total"] + MAX_QUEUE - 1
    assert after['d3d_requests_total{endpoint="/v1/chat/completions",status="503"}'] >= 2
    assert after["d3d_queue_waiting"] == 0 and after["d3d_generation_running"] == 0


@pytest.mark.slow
def test_metrics_count_requests_and_tokens(env):
    server, refs, _ = env
    before = server.metrics()
    status, body = server.post("/v1/chat/completions", chat(PROMPT_B))
    assert status == 200
    status, text = server.request("GET", "/metrics")
    assert status == 200 and "# TYPE d3d_requests_total counter" in text and "# TYPE d3d_tau gauge" in text
    after = server.metrics()
    key = 'd3d_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    usage = body["usage"]
    assert after["d3d_generated_tokens_total"] - before["d3d_generated_tokens_total"] == usage["completion_tokens"]
    assert after["d3d_prompt_tokens_total"] - before["d3d_prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert after["d3d_last_tau"] == pytest.approx(body["d3d"]["tau"], abs=1e-3)
    assert after["d3d_tau"] >= 1 and after["d3d_tokens_per_second"] > 0 and after["d3d_last_tokens_per_second"] > 0
    assert after["d3d_prefill_seconds_total"] > before.get("d3d_prefill_seconds_total", 0)  # time to first token
    assert 'd3d_info{model="SmolLM2-135M-Instruct",method="ngram"} 1' in text


BAD_MORE = [  # (path, body, fragment of the message, param)
    ("/v1/chat/completions", chat("hi", seed=1 << 64), "seed", "seed"),
    ("/v1/chat/completions", chat("hi", seed=-(1 << 63) - 1), "seed", "seed"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "lone surrogate", "messages"),
    ("/v1/completions", b'{"prompt": "\\udfff"}', "lone surrogate", "prompt"),
    ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, "malformed JSON", None),
    ("/v1/chat/completions", b'{"max_tokens": 1' + b"0" * 5000 + b"}", "malformed JSON", None),
    ("/v1/chat/completions", chat("hi", stop="x" * 65), "at most 64 characters", "stop"),
    ("/v1/chat/completions", chat("hi", stop=[str(i) for i in range(17)]), "at most 16 stop", "stop"),
    ("/v1/chat/completions", chat("hi", top_logprobs=2), "needs 'logprobs'", "top_logprobs"),
    ("/v1/chat/completions", chat("hi", logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", chat("hi", logprobs="yes"), "boolean", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "integer", "logprobs"),
] + [("/v1/chat/completions", chat("hi", **{k: v}), "not supported", k) for k, v in (
    ("frequency_penalty", 0.5), ("presence_penalty", -1), ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"), ("logit_bias", {"5": 3}))
] + [("/v1/completions", {"prompt": "hi", k: v}, "not supported", k) for k, v in (("best_of", 2), ("echo", True))]


@pytest.mark.slow
def test_more_malformed_input_gets_400_naming_the_parameter(env):
    server, _, _ = env
    before = server.metrics().get("d3d_generations_total", 0)
    for path, body, fragment, param in BAD_MORE:
        status, out = server.post(path, raw=body) if isinstance(body, bytes) else server.post(path, body)
        assert status == 400, (body if isinstance(body, dict) else body[:60], status, out)
        err = out["error"]
        assert err["type"] == "invalid_request_error" and fragment in err["message"] and err["param"] == param, err
    for body in (chat("hi", max_tokens=2, frequency_penalty=0, presence_penalty=0.0, response_format={"type": "text"},
                      tools=[], tool_choice="none", logit_bias={}), {"prompt": "hi", "max_tokens": 2, "best_of": 1}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert server.post(path, body)[0] == 200  # the "not used" values of unsupported parameters are fine
    assert server.metrics().get("d3d_generations_total", 0) == before + 2


@pytest.mark.slow
def test_origin_and_content_type_checks(env):
    """Browsers send Origin: another site's page (or a DNS-rebound name) is refused; the server's own
    origin is not. A POST must be application/json (a cross-site HTML form cannot send that)."""
    server, _, _ = env
    body = json.dumps(chat(PROMPT_A, max_tokens=2)).encode()
    before = server.metrics()["d3d_generations_total"]
    for origin in ("http://evil.example", "null", f"http://evil.example:{server.port}", "https://127.0.0.1"):
        status, out = server.post("/v1/chat/completions", raw=body, headers={"Origin": origin})
        assert status == 403 and out["error"]["code"] == "origin_not_allowed", (origin, out)
    status, out, headers = server.request("OPTIONS", "/v1/chat/completions", full=True,
                                          headers={"Origin": "http://evil.example", "Access-Control-Request-Method":
                                                   "POST"})
    assert status == 403 and "access-control-allow-origin" not in headers
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        status, out = server.post("/v1/chat/completions", raw=body, headers={"Content-Type": kind})
        assert status == 415 and "application/json" in out["error"]["message"], (kind, out)
    assert server.metrics()["d3d_generations_total"] == before
    for origin in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}", None):
        status, out = server.post("/v1/chat/completions", raw=body, headers={"Origin": origin})
        assert status == 200, (origin, out)
    assert server.request("GET", "/v1/models", headers={"Origin": "http://evil.example"})[0] == 403


def _read_head_and_body(s: socket.socket) -> str:
    """A raw HTTP response (headers and a Content-Length body) read off a socket."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            data.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]):
        more = s.recv(65536)
        if not more:
            break
        data += more
    return data.decode()


@pytest.mark.slow
def test_oversized_body_413_without_reading_it(env):
    """A 64 MB Content-Length gets 413 after only its headers and 64 KB were sent; a chunked body (no
    Content-Length) gets 413 once 4 MB have arrived, long before its 64 MB would."""
    server, _, _ = env
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 67108864\r\n\r\n" + b" " * 65536)
        head = _read_head_and_body(s)
    assert head.startswith("HTTP/1.1 413") and "body_too_large" in head, head[:300]
    piece = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < 64 << 20 and not select.select([s], [], [], 0)[0]:
                s.sendall(piece)
                sent += 1 << 16
        except OSError:  # the server answered and closed while we were still sending
            pass
        head = _read_head_and_body(s)
    assert head.startswith("HTTP/1.1 413"), head[:300]
    assert sent < 16 << 20  # 4 MB read, plus what the loopback socket buffers held
    assert server.request("GET", "/health")[0] == 200


def _wait(cond, timeout: float = 30, step: float = 0.01) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(step)
    return time.monotonic() - t0


@pytest.mark.slow
def test_plain_request_disconnect_stops_generation(env):
    """A non-streaming client that hangs up mid-generation: the generation stops at once (a few rounds of
    the real model at most), it is counted as cancelled, not completed."""
    server, _, _ = env
    before = server.metrics()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    body = json.dumps(chat(SLOW_PROMPT, max_tokens=400)).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait(lambda: server.metrics()["d3d_generation_running"] == 1)
    time.sleep(0.3)
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    assert _wait(lambda: server.metrics()["d3d_generation_running"] == 0) < 1.5
    after = server.metrics()
    assert after["d3d_requests_cancelled_total"] == before["d3d_requests_cancelled_total"] + 1
    assert after["d3d_generations_total"] == before["d3d_generations_total"]


@pytest.mark.slow
def test_logprobs_are_the_targets_log_softmax(env):
    """Chat (logprobs + top_logprobs) and completions (logprobs: N), plain and streamed: each token's
    logprob and top list equal the log-softmax of the target's own logits (one full forward here)."""
    import torch

    server, refs, _ = env
    gen, ref = refs["gen"], refs[PROMPT_A]
    ids = ref.token_ids[:8]
    with gen._lock, torch.no_grad():
        gen.model.setup_cache(1, len(ref.prompt_ids) + len(ids) + 1)
        logits = gen.model(torch.tensor([ref.prompt_ids + ids]))[0, len(ref.prompt_ids) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1)
    want = [float(lp[i, t]) for i, t in enumerate(ids)]
    top = lp.topk(3, -1)
    eos = gen.tokenizer.eos_token_id
    n = len([t for t in ids if t != eos])

    status, out = server.post("/v1/chat/completions", chat(PROMPT_A, max_tokens=8, logprobs=True, top_logprobs=3))
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    events = server.stream("/v1/chat/completions", chat(PROMPT_A, max_tokens=8, logprobs=True, top_logprobs=3))
    streamed = [c for e in events[:-1] for ch in e["choices"] for c in (ch.get("logprobs") or {}).get("content", [])]
    assert streamed == content and len(content) == n
    for i, c in enumerate(content):
        assert c["token"] == gen.tokenizer.decode([ids[i]])
        assert c["logprob"] == pytest.approx(want[i], abs=2e-3)
        assert [t["token"] for t in c["top_logprobs"]] == [gen.tokenizer.decode([t]) for t in top.indices[i].tolist()]
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx(top.values[i].tolist(), abs=2e-3)
    plain = server.post("/v1/chat/completions", chat(PROMPT_A, max_tokens=8))[1]
    assert plain["choices"][0]["logprobs"] is None  # off unless asked for

    prompt = {"prompt": ref.prompt_ids, "max_tokens": 8, "logprobs": 2}
    status, out = server.post("/v1/completions", prompt)
    assert status == 200, out
    lps = out["choices"][0]["logprobs"]
    assert lps["token_logprobs"] == pytest.approx(want[:n], abs=2e-3)
    got = [v for d in lps["top_logprobs"] for v in d.values()]
    assert got == pytest.approx(top.values[:n, :2].flatten().tolist(), abs=2e-3)
    assert "".join(lps["tokens"]) == out["choices"][0]["text"] or eos in ids
    events = server.stream("/v1/completions", prompt)
    assert [x for e in events[:-1] for x in (e["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] \
        == lps["token_logprobs"]


@pytest.mark.slow
def test_max_queue_validated():
    proc = subprocess.run([sys.executable, "-m", "d3d.cli", "serve", "--max-queue", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--max-queue must be >= 1" in proc.stderr


# ---------------------------------------------------------------------------------------------
# An in-process server on loopback with a scripted runner (rounds of ROUND_S seconds, so rounds can be
# counted exactly), an API key, an allowed extra origin and a request timeout.

KEY = "sk-test-0123456789"
ALLOWED = "http://app.example:3000"
DEADLINE = 2.0
ROUND_S = 0.05
SLOW_ROUND = 7    # max_tokens that make the runner spend DEADLINE + 1 s in one round
FAILING = 13      # max_tokens that make the runner raise


class ScriptedRunner:
    """runner(prompt_ids, ...) that emits token 42 once per ROUND_S seconds; counts on_round calls that
    returned (so rounds run after a disconnect can be counted)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.rounds = tokenizer, 0

    def __call__(self, prompt_ids, params=None, max_new_tokens=16, stop=None, on_round=None, logprobs=None):
        from d3d.decoding.engine import GenerationResult

        if max_new_tokens == FAILING:
            raise RuntimeError("boom")
        res = GenerationResult(prompt_ids=list(prompt_ids))
        for i in range(max_new_tokens):
            time.sleep(DEADLINE + 1 if max_new_tokens == SLOW_ROUND else ROUND_S)
            res.token_ids.append(42)
            res.acceptance_lengths += [1] if i else []
            on_round([42], 0)
            self.rounds += 1
        res.text = self.tokenizer.decode(res.token_ids)
        return res


@contextmanager
def in_process(app):
    """`app` served by uvicorn in a thread on a free loopback port (yielded) until the block ends."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.slow
def test_batched_server_answers_are_the_solo_answers(env):
    """--max-batch 3: three streamed and three plain requests at once, on the lanes of one scheduler; every answer
    is the target's own, rounds were shared, and /metrics and /health show the batch."""
    from d3d.api import load
    from d3d.server import create_app

    refs = env[1]
    app = create_app(load(method="lookup-tree", learn=False), max_queue=8, max_batch=3)
    with in_process(app) as port:
        from d3d.server.loadtest_base import Endpoint
        from d3d.server.loadtest_throughput import run_level

        client, results = Server(port), {}

        def ask(i: int) -> None:
            prompt = (PROMPT_A, PROMPT_B)[i % 2]
            status, out = client.post("/v1/chat/completions", chat(prompt))
            results[i] = (status, prompt, out["choices"][0]["message"]["content"])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        prompts = [PROMPT_B, PROMPT_A, PROMPT_B]  # streamed, through d3d loadtest --throughput's client
        summary, records = run_level(Endpoint("127.0.0.1", port), prompts, 3, MAX)
        for t in threads:
            t.join()
        for status, prompt, text in results.values():
            assert status == 200 and text == refs[prompt].text
        for prompt, r in zip(prompts, records):
            assert r["status"] == 200 and r["text"] == refs[prompt].text and r["tokens"] == refs[prompt].new_tokens
        assert summary["completion_tokens"] == sum(r["tokens"] for r in records) and summary["ttft_p95_s"] > 0
        m = client.metrics()
        assert m["d3d_max_batch"] == 3 and m["d3d_generations_total"] == 6 and m["d3d_generation_running"] == 0
        assert 0 < m["d3d_batched_forwards_total"] < 6 * MAX  # forwards were shared
        assert client.request("GET", "/health")[1]["max_batch"] == 3
        status, again = client.post("/v1/chat/completions", chat(PROMPT_A))  # a lane that holds PROMPT_A's prefix
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert status == 200 and again["choices"][0]["message"]["content"] == refs[PROMPT_A].text
        assert 0 < cached < again["usage"]["prompt_tokens"]
        assert client.metrics()["d3d_prompt_tokens_reused_total"] >= cached


@pytest.fixture(scope="module")
def scripted(env):
    from d3d.api import Generator
    from d3d.server import create_app

    gen = env[1]["gen"]
    runner = ScriptedRunner(gen.tokenizer)
    app = create_app(Generator(gen.model, gen.tokenizer, gen.model_dir, "scripted", runner), max_queue=2,
                     api_key=KEY, allow_origins=[ALLOWED], request_timeout=DEADLINE)
    with in_process(app) as port:
        yield Server(port, KEY), runner


@pytest.mark.slow
def test_api_key_required(scripted):
    server, _ = scripted
    body = chat("hi", max_tokens=2)
    for auth in (None, "Bearer wrong", "Bearer", f"Basic {base64.b64encode(b'u:wrong').decode()}", KEY):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/")):
            status, out, headers = server.request(method, path, body if method == "POST" else None, full=True,
                                                  headers={"Authorization": auth})
            assert status == 401, (auth, path, status)
            assert out["error"]["type"] == "authentication_error" and out["error"]["code"] == "invalid_api_key"
            assert headers["www-authenticate"] == ('Basic realm="d3d"' if path == "/" else "Bearer")
    assert server.request("GET", "/health", headers={"Authorization": None})[0] == 200
    assert server.post("/v1/chat/completions", body)[0] == 200
    basic = f"Basic {base64.b64encode(f'anyone:{KEY}'.encode()).decode()}"  # what a browser sends for the page
    assert server.request("GET", "/", headers={"Authorization": basic})[0] == 200
    assert server.request("GET", "/v1/models", headers={"Authorization": basic})[0] == 200


@pytest.mark.slow
def test_allowed_origin_gets_cors(scripted):
    server, _ = scripted
    status, _, headers = server.request("OPTIONS", "/v1/chat/completions", full=True, headers={
        "Origin": ALLOWED, "Access-Control-Request-Method": "POST", "Authorization": None})
    assert status == 204 and headers["access-control-allow-origin"] == ALLOWED
    assert "Authorization" in headers["access-control-allow-headers"]
    status, out, headers = server.request("POST", "/v1/chat/completions", chat("hi", max_tokens=2), full=True,
                                          headers={"Origin": ALLOWED})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    assert server.post("/v1/chat/completions", chat("hi", max_tokens=2), headers={"Origin": ALLOWED[:-1]})[0] == 403


@pytest.mark.slow
def test_disconnect_frees_worker_within_one_round(scripted):
    server, runner = scripted
    for stream in (False, True):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        body = json.dumps(chat("hi", max_tokens=200, stream=stream)).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
        start = runner.rounds
        _wait(lambda: runner.rounds >= start + 3)
        s.shutdown(socket.SHUT_RDWR)
        s.close()
        at_close = runner.rounds
        _wait(lambda: server.request("GET", "/health")[1]["running"] == 0, timeout=5)
        assert runner.rounds - at_close <= 1, stream  # the round under way at most
        time.sleep(2 * ROUND_S)
        assert runner.rounds - at_close <= 1


@pytest.mark.slow
def test_deadline_cuts_a_running_request(scripted):
    server, runner = scripted
    t0 = time.monotonic()
    status, out = server.post("/v1/chat/completions", chat("hi", max_tokens=200))
    took = time.monotonic() - t0
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert out["d3d"]["finish_reason"] == "timeout"
    assert DEADLINE <= took < DEADLINE + 0.5 and 0 < out["usage"]["completion_tokens"] < 200
    events = server.stream("/v1/chat/completions", chat("hi", max_tokens=200))
    text, ids, finish = streamed_text(events)
    assert finish == "length" and 0 < len(ids) < 200


@pytest.mark.slow
def test_deadline_in_the_queue_gives_504(scripted):
    server, _ = scripted
    slow = {}
    thread = threading.Thread(target=lambda: slow.update(r=server.post("/v1/chat/completions",
                                                                        chat("hi", max_tokens=SLOW_ROUND))))
    thread.start()
    _wait(lambda: server.request("GET", "/health")[1]["running"] == 1)
    t0 = time.monotonic()
    status, out = server.post("/v1/chat/completions", chat("hi", max_tokens=2))
    assert status == 504 and out["error"]["code"] == "timeout", out
    assert DEADLINE - 0.1 <= time.monotonic() - t0 < DEADLINE + 0.5
    thread.join(30)
    assert slow["r"][0] == 200 and slow["r"][1]["d3d"]["finish_reason"] == "timeout"


@pytest.mark.slow
def test_worker_survives_a_failing_generation(scripted):
    server, _ = scripted
    status, out = server.post("/v1/chat/completions", chat("hi", max_tokens=FAILING))
    assert status == 500 and out["error"]["type"] == "server_error" and "RuntimeError: boom" in out["error"]["message"]
    status, health = server.request("GET", "/health")
    assert status == 200 and health["worker"] == "alive" and health["running"] == 0
    assert server.post("/v1/chat/completions", chat("hi", max_tokens=2))[0] == 200


@pytest.mark.slow
def test_text_streamer_equals_final_text(env):
    """The incremental TextStreamer: its deltas, for any split into rounds, concatenate to the engine's
    final text (EOS dropped, cut before the first stop), multi-byte characters and long stops included."""
    from d3d.decoding.engine import StopChecker
    from d3d.server import TextStreamer

    tok = env[1]["gen"].tokenizer
    text = "Caf\u00e9 \U0001f600 na\u00efve -- the end. " * 6 + "abcabcabd tail"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    for stop in ([], ["the end."], ["abcabcabd"], ["\U0001f600 na"], ["zzz", "tail"], ["x" * 64]):
        final = StopChecker(tok, {tok.eos_token_id}, len(ids), stop).final_text(ids)
        for size in (1, 2, 3, 7):
            streamer = TextStreamer(tok, stop)
            out = "".join(streamer.push(ids[i:i + size]) for i in range(0, len(ids), size))
            assert out + streamer.push([], final=True) == final, (stop, size)


# ---------------------------------------------------------------------------------------------
# The web page in headless Chromium, driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
# JSON messages separated by NUL bytes on file descriptors 3 and 4), so no websocket client is needed.


def _high_fd(fd: int) -> int:
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


class Chromium:
    def __init__(self, binary: str, profile: Path):
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()
        to_chrome_r, from_chrome_w = _high_fd(to_chrome_r), _high_fd(from_chrome_w)  # never 3 or 4 themselves
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1000,900", "about:blank"]
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(["bash", "-c", script, binary, *args], pass_fds=(to_chrome_r, from_chrome_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buf, self.next_id = b"", 0

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    assert "error" not in reply, (method, reply["error"])
                    return reply["result"]
            left = deadline - time.monotonic()
            assert left > 0, f"no reply to {method}"
            if select.select([self.from_chrome], [], [], left)[0]:
                data = os.read(self.from_chrome, 1 << 20)
                assert data, "chromium exited"
                self.buf += data

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_chrome)
        os.close(self.from_chrome)


@pytest.mark.slow
def test_web_page_in_headless_chromium(env, tmp_path):
    from helpers import system_tool

    binary = system_tool("chromium", "chromium-browser", package="chromium")
    server, refs, _ = env
    browser = Chromium(binary, tmp_path / "profile")
    try:
        before = server.metrics()["d3d_generations_total"]
        url = f"http://127.0.0.1:{server.port}/?prompt=Say+hi&autorun=1"  # as a link from another site would
        target = browser.send("Target.createTarget", {"url": url})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def js(expr: str):
            r = browser.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)
            return r["result"].get("value")

        deadline = time.monotonic() + 60
        model_line = "document.getElementById('model').textContent"
        while js("document.readyState") != "complete" or "ngram" not in (js(model_line) or ""):
            assert time.monotonic() < deadline, "page did not load"
            time.sleep(0.2)
        assert js("document.getElementById('prompt').value") == "Say hi"
        time.sleep(0.5)
        assert js("document.body.dataset.state") is None  # autorun=1 does not start a generation
        assert server.metrics()["d3d_generations_total"] == before and server.metrics()["d3d_generation_running"] == 0
        js(f"document.getElementById('max').value = '{MAX}'")
        js("const p = document.getElementById('prompt'); p.value = ''; p.focus(); 1")
        browser.send("Input.insertText", {"text": PROMPT_B}, session)  # typed, as a user would
        assert js("document.getElementById('prompt').value") == PROMPT_B
        js("document.getElementById('go').click(); 1")
        deadline = time.monotonic() + 120
        while js("document.body.dataset.state") not in ("done", "error"):
            assert time.monotonic() < deadline, "the answer did not finish"
            time.sleep(0.2)
        assert js("document.body.dataset.state") == "done", js("document.getElementById('status').textContent")
        answer = js("document.getElementById('answer').textContent")
        assert answer == refs[PROMPT_B].text
        assert js("document.querySelectorAll('#answer .target').length") >= 1
        assert js("document.querySelectorAll('#answer .draft').length") >= 1  # prompt B gets drafts accepted
        assert float(js("document.getElementById('tau').textContent")) > 1.0
        assert float(js("document.getElementById('tps').textContent")) > 0
        branches = ["d3d", "ngram", "alt", "datastore", "learned", "learned+ngram", "datastore+learned"]
        colours = js(json.dumps(branches) + ".map((b) => { const s = document.createElement('span'); "
                     "s.className = 'draft'; s.dataset.branch = b; document.getElementById('answer').appendChild(s); "
                     "const c = getComputedStyle(s).backgroundColor; s.remove(); return c; })")
        assert len(set(colours[:5])) == 5 and colours[4] == colours[5] == colours[6]  # each branch its own colour
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"}, session)["data"])
    finally:
        browser.close()
    path = tmp_path / "page.png"
    path.write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    if os.environ.get("D3D_SCREENSHOT"):
        shutil.copy(path, os.environ["D3D_SCREENSHOT"])
