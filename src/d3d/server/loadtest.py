"""`d3d loadtest`: N concurrent clients for a bounded time against `d3d serve`, valid and faulty requests.

Each client loops, picking at random: valid greedy requests (chat and text completions, plain and
streamed, some with stop strings or logprobs), sampled requests, malformed bodies, requests with no or
a wrong API key, a wrong Content-Type or a foreign Origin, oversized bodies (a 64 MB Content-Length),
and cancellations (a client that hangs up mid-generation, streaming or not). The summary counts the
requests served, p50/p99 latency of served requests, counts per status code, and whether every greedy
answer equalled plain decoding's (method `ar`, computed in-process first). Without a URL it starts
`d3d serve` itself (with a random API key) on a free port and stops it after.
"""
from __future__ import annotations

import http.client
import json
import random
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlparse

from ..errors import D3DError

CHAT_PROMPTS = [
    "What is the capital of France? Answer briefly.",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "List three primary colors.",
    "Write a haiku about the sea.",
    "What is 17 * 23? Think step by step.",
    "Explain in one sentence why the sky is blue.",
]
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
STOPS = [None, ".", "\n"]
MALFORMED = [
    b"{not json", b"[1, 2]", b'{"messages": []}', b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 9}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}',
    b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": "' + b"x" * 100 + b'"}',
    b"[" * 50_000,
]


@dataclass
class LoadTest:
    """What to run: against `url` (with `api_key`), or a server started here with method, target, threads
    and max_queue; `clients` start requests for `duration` seconds, greedy ones of max_tokens tokens."""
    url: str | None = None
    api_key: str | None = None
    clients: int = 4
    duration: float = 150
    max_tokens: int = 32
    method: str = "ngram"
    target: str | None = None
    threads: int = 1
    max_queue: int = 16
    seed: int = 0


KINDS = {"greedy": 45, "sampled": 8, "malformed": 12, "auth": 6, "origin": 4, "content_type": 4, "oversized": 4,
         "cancel": 12}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


class Client:
    """One simulated client: picks requests at random and records (kind, status, seconds, check)."""

    def __init__(self, host: str, port: int, key: str | None, refs: dict, max_tokens: int, rng: random.Random):
        self.host, self.port, self.key, self.refs, self.max_tokens, self.rng = host, port, key, refs, max_tokens, rng
        self.records: list[dict] = []

    def headers(self, **extra) -> dict:
        h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.key}"} if self.key else {})
        return {k: v for k, v in (h | extra).items() if v is not None}

    def send(self, path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def greedy(self) -> dict:
        chat = self.rng.random() < 0.6
        prompt = self.rng.choice(CHAT_PROMPTS if chat else RAW_PROMPTS)
        stop, stream, logprobs = self.rng.choice(STOPS), self.rng.random() < 0.5, self.rng.random() < 0.2
        body = {"max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        body |= {"stop": stop} if stop else {}
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
        status, raw = self.send("/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode(),
                                self.headers())
        out = {"status": status}
        if status == 200:
            text = streamed_text(raw, chat) if stream else plain_text(raw, chat)
            out["equal_ar"] = text == self.refs[(chat, prompt, stop)]
            out["case"] = f"{'chat' if chat else 'text'} {'stream' if stream else 'plain'} stop={stop!r} {prompt[:30]!r}"
        return out

    def sampled(self) -> dict:
        body = {"messages": [{"role": "user", "content": self.rng.choice(CHAT_PROMPTS)}], "max_tokens": self.max_tokens,
                "temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 32)}
        return {"status": self.send("/v1/chat/completions", json.dumps(body).encode(), self.headers())[0]}

    def malformed(self) -> dict:
        return {"status": self.send("/v1/chat/completions", self.rng.choice(MALFORMED), self.headers())[0]}

    def auth(self) -> dict:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        auth = self.rng.choice([None, "Bearer wrong-key", "Basic Zm9vOmJhcg=="])
        return {"status": self.send("/v1/chat/completions", body, self.headers(Authorization=auth))[0]}

    def origin(self) -> dict:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        return {"status": self.send("/v1/chat/completions", body, self.headers(Origin="http://evil.example"))[0]}

    def content_type(self) -> dict:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        return {"status": self.send("/v1/chat/completions", body, self.headers(**{"Content-Type": "text/plain"}))[0]}

    def _raw(self, body: bytes, length: int | None = None) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=600)
        auth = f"Authorization: Bearer {self.key}\r\n".encode() if self.key else b""
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                  b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), auth, length or len(body), body))
        return s

    def oversized(self) -> dict:
        with self._raw(b" " * 65536, 64 << 20) as s:
            head = s.recv(65536).split(b" ", 2)
        return {"status": int(head[1]) if len(head) > 1 else 0}

    def cancel(self) -> dict:
        """Start a long generation, then hang up after a moment (a streaming client after its first token)."""
        stream = self.rng.random() < 0.5
        body = json.dumps({"messages": [{"role": "user", "content": self.rng.choice(CHAT_PROMPTS)}],
                           "max_tokens": 4 * self.max_tokens, "stream": stream}).encode()
        s = self._raw(body)
        if stream:
            s.recv(4096)
        else:
            time.sleep(self.rng.uniform(0.1, 1.0))
        s.shutdown(socket.SHUT_RDWR)
        s.close()
        return {"status": "cancelled"}

    def run(self, until: float) -> None:
        kinds, weights = zip(*KINDS.items())
        while time.monotonic() < until:
            kind = self.rng.choices(kinds, weights)[0]
            t0 = time.monotonic()
            try:
                rec = getattr(self, kind)()
            except OSError as e:
                rec = {"status": f"error {type(e).__name__}"}
            self.records.append(rec | {"kind": kind, "seconds": time.monotonic() - t0})


def plain_text(raw: bytes, chat: bool) -> str:
    choice = json.loads(raw)["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def streamed_text(raw: bytes, chat: bool) -> str:
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            for c in json.loads(line[5:]).get("choices", []):
                text += (c["delta"].get("content") or "") if chat else c["text"]
    return text


def references(max_tokens: int, threads: int, target: str | None) -> dict:
    """Plain decoding's (method ar) answer for every (chat?, prompt, stop) the clients may send."""
    from d3d import load

    gen = load(target, method="ar", threads=threads)
    refs = {}
    for chat, prompts in ((True, CHAT_PROMPTS), (False, RAW_PROMPTS)):
        for p in prompts:
            for stop in STOPS:
                refs[(chat, p, stop)] = gen.generate(p, max_new_tokens=max_tokens, raw=not chat, stop=stop)
    return refs


def start_server(cfg: LoadTest, key: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "d3d.cli", "serve", "--method", cfg.method, "--threads", str(cfg.threads),
           "--port", str(port), "--max-queue", str(cfg.max_queue), "--api-key", key]
    cmd += ["--target", cfg.target] if cfg.target else []
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def get(host: str, port: int, path: str, key: str | None) -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    resp = conn.getresponse()
    out = resp.status, resp.read().decode()
    conn.close()
    return out


def wait_healthy(host: str, port: int, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise D3DError("the server exited while starting")
        try:
            if get(host, port, "/health", None)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise D3DError("the server did not come up")
        time.sleep(0.5)


def summarize(records: list[dict], duration: float, metrics_text: str, health: dict) -> dict:
    statuses = Counter(str(r["status"]) for r in records)
    served = [r["seconds"] for r in records if r["status"] == 200]
    greedy = [r for r in records if "equal_ar" in r]
    metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line and not line.startswith("#")}
    return {
        "duration_s": round(duration, 1), "requests": len(records), "served": len(served),
        "latency_s": {"p50": percentile(served, 0.5), "p99": percentile(served, 0.99), "max": percentile(served, 1.0)},
        "status_counts": dict(sorted(statuses.items())),
        "by_kind": {k: dict(sorted(Counter(str(r["status"]) for r in records if r["kind"] == k).items()))
                    for k in KINDS},
        "server_5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "greedy_checked": len(greedy), "greedy_all_equal_ar": all(r["equal_ar"] for r in greedy),
        "greedy_mismatches": [r["case"] for r in greedy if not r["equal_ar"]],
        "server": {"health_after": health,
                   "cancelled_total": metrics.get("d3d_requests_cancelled_total"),
                   "generations_total": metrics.get("d3d_generations_total"),
                   "generated_tokens_total": metrics.get("d3d_generated_tokens_total"),
                   "tau": metrics.get("d3d_tau"), "tokens_per_second": metrics.get("d3d_tokens_per_second")},
    }


def run_load_test(cfg: LoadTest) -> dict:
    """Run the load test; the summary (see the module doc) with the settings it ran with."""
    proc, key = None, cfg.api_key
    if cfg.url:
        u = urlparse(cfg.url)
        host, port = u.hostname, u.port or 80
    else:
        key = secrets.token_hex(16)
        proc, port = start_server(cfg, key)
        host = "127.0.0.1"
    try:
        refs = references(cfg.max_tokens, cfg.threads, cfg.target)
        wait_healthy(host, port, proc)
        clients = [Client(host, port, key, refs, cfg.max_tokens, random.Random(cfg.seed + i))
                   for i in range(cfg.clients)]
        t0 = time.monotonic()
        threads = [threading.Thread(target=c.run, args=(t0 + cfg.duration,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        duration = time.monotonic() - t0
        time.sleep(1.0)  # let the last cancellations land in /metrics
        status, health = get(host, port, "/health", None)
        metrics = get(host, port, "/metrics", key)[1]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    out = {"method": cfg.method, "clients": cfg.clients, "max_tokens": cfg.max_tokens, "threads": cfg.threads}
    return out | summarize([r for c in clients for r in c.records], duration, metrics,
                           json.loads(health) | {"http": status})
