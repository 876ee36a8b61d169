"""`d3d serve` over real HTTP on loopback: answers equal the CLI's / engine's greedy output (plain and
streamed, chat and text completions), concurrent clients, 400s for bad input, 503 when the queue is
full, a disconnecting client frees its slot, /metrics and /health, the Python API, and the web page in
headless Chromium (typed prompt, streamed answer, screenshot).

One server subprocess (`--method ngram --threads 1 --max-queue 3`) serves every test; answers are
kept short (<= 16 tokens) because the machine is small.
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
    def __init__(self, port: int):
        self.port = port

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120):
        """(status, parsed JSON or text) of one request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text

    def post(self, path: str, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def open_stream(self, path: str, body: dict, timeout: float = 120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=json.dumps(body | {"stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
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
    """Start the server and one CLI run, compute the references in-process meanwhile (Python API, method
    ar), then wait for the server. Yields (server, references dict, CLI JSON output)."""
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "d3d.cli", "serve", "--method", "ngram", "--threads", "1",
                             "--port", str(port), "--max-queue", str(MAX_QUEUE)], stdout=log, stderr=subprocess.STDOUT)
    cli = subprocess.Popen([sys.executable, "-m", "d3d.cli", "generate", PROMPT_A, "--max-new-tokens", str(MAX),
                            "--json", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def test_on_round_reports_every_round():
    """The engines' on_round(chunk, accepted) hook that streaming relies on: chunks concatenate to the
    output, accepted counts match the acceptance lengths, for every method (tiny random models)."""
    import torch

    from d3d.async_engine import generate_async
    from d3d.drafter import D3DProposer, drafter_from_target
    from d3d.engine import generate
    from d3d.ngram import NgramProposer
    from d3d.target import ModelArgs, Transformer

    class Tok:
        eos_token_id = -1

        def get_vocab(self):
            return {f"t{i}": i for i in range(64)}

        def decode(self, ids):
            return " ".join(f"t{i}" for i in ids)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        target = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                       intermediate_size=64, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128))
        target = target.eval().requires_grad_(False)
        drafter = drafter_from_target(target, Tok(), "tiny", [0, 1], 4).eval().requires_grad_(False)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    runs = {"ar": lambda **kw: generate(target, Tok(), prompt, **kw),
            "ngram": lambda **kw: generate(target, Tok(), prompt, proposer=NgramProposer(), block_size=4, **kw),
            "d3d": lambda **kw: generate(target, Tok(), prompt, proposer=D3DProposer(drafter, 64, 128), block_size=4,
                                         **kw),
            "d3d-async": lambda **kw: generate_async(target, Tok(), prompt, drafter=drafter, **kw)}
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


def test_health_and_models(env):
    server, _, _ = env
    status, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["method"] == "ngram"
    status, body = server.request("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_python_api_equals_cli(env):
    _, refs, cli = env
    assert refs[PROMPT_A].token_ids == cli["token_ids"]
    assert refs[PROMPT_A].text == cli["text"]
    assert refs["gen"].generate(PROMPT_A, max_new_tokens=4) == refs["gen"].tokenizer.decode(cli["token_ids"][:4])


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


def test_sampling_with_seed_is_reproducible(env):
    server, _, _ = env
    body = chat(PROMPT_A, max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    answers = [server.post("/v1/chat/completions", body) for _ in range(2)]
    assert [a[0] for a in answers] == [200, 200]
    assert answers[0][1]["choices"][0]["message"] == answers[1][1]["choices"][0]["message"]


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
    assert 'd3d_info{model="SmolLM2-135M-Instruct",method="ngram"} 1' in text


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


def test_web_page_in_headless_chromium(env, tmp_path):
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs the Debian package)")
    server, refs, _ = env
    browser = Chromium(binary, tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", {"url": f"http://127.0.0.1:{server.port}/"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def js(expr: str):
            r = browser.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)
            return r["result"].get("value")

        deadline = time.monotonic() + 60
        model_line = "document.getElementById('model').textContent"
        while js("document.readyState") != "complete" or "ngram" not in (js(model_line) or ""):
            assert time.monotonic() < deadline, "page did not load"
            time.sleep(0.2)
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
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"}, session)["data"])
    finally:
        browser.close()
    path = tmp_path / "page.png"
    path.write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    if os.environ.get("D3D_SCREENSHOT"):
        shutil.copy(path, os.environ["D3D_SCREENSHOT"])
