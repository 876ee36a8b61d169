"""`d3d loadtest`: N concurrent clients for a bounded time against `d3d serve`, valid and faulty
requests, then the abuse phases (loadtest_cases, loadtest_hold; shared parts: loadtest_base; bars: loadtest_report).

Phase "random": each client loops, picking at random: valid greedy requests (chat and text completions,
plain and streamed, some with stop strings or logprobs), sampled requests, malformed bodies, requests
with no or a wrong API key, a wrong Content-Type or a foreign Origin, oversized bodies (a 64 MB
Content-Length), and cancellations (a client that hangs up mid-generation, streaming or not). Its
summary counts the requests served, p50/p99 latency of served requests, counts per status code, and
whether every greedy answer equalled plain decoding's (method `ar`, computed in-process first; an
answer cut by the request deadline is counted, not compared). Then "cases" (each abuse once, with its
4xx), "long_prompt" (a ~4,000-token prompt whose client leaves after 2 s: the worker is freed) and
"connections" (200 slow or idle connections: small requests still answered quickly, memory bounded).
Without a URL it starts `d3d serve` itself (a random API key, --request-timeout) on a free port, its
log captured and scanned for tracebacks and 5xx answers, its RSS read from /proc. `held` gives each
bar's pass/fail; `all_held` all of them.
"""
from __future__ import annotations

import json
import random
import secrets
import socket
import tempfile
import threading
import time
from collections import Counter
from urllib.parse import urlparse

from .loadtest_base import PHASES, Endpoint, LoadTest, metrics_of, percentile, scan_log, start_server, wait_healthy
from .loadtest_cases import run_cases
from .loadtest_hold import connections_phase, long_prompt_phase, long_text
from .loadtest_report import verdict_lines, verdicts

__all__ = ["LoadTest", "PHASES", "run_load_test", "verdict_lines"]

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


KINDS = {"greedy": 45, "sampled": 8, "malformed": 12, "auth": 6, "origin": 4, "content_type": 4, "oversized": 4,
         "cancel": 12}


class Client:
    """One simulated client: picks requests at random and records (kind, status, seconds, check)."""

    def __init__(self, ep: Endpoint, refs: dict, max_tokens: int, rng: random.Random):
        self.ep, self.refs, self.max_tokens, self.rng = ep, refs, max_tokens, rng
        self.records: list[dict] = []

    def send(self, path: str, body: bytes, **headers) -> int:
        return self.ep.request("POST", path, body, headers={"Content-Type": "application/json"} | headers)[0]

    def greedy(self) -> dict:
        chat = self.rng.random() < 0.6
        prompt = self.rng.choice(CHAT_PROMPTS if chat else RAW_PROMPTS)
        stop, stream, logprobs = self.rng.choice(STOPS), self.rng.random() < 0.5, self.rng.random() < 0.2
        body = {"max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        body |= {"stop": stop} if stop else {}
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
        status, raw = self.ep.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body)
        out = {"status": status}
        if status == 200:
            text, finish = streamed_answer(raw, chat) if stream else plain_answer(raw, chat)
            out["case"] = f"{'chat' if chat else 'text'} {'stream' if stream else 'plain'} stop={stop!r} {prompt[:30]!r}"
            out |= {"cut": True} if finish == "timeout" else {"equal_ar": text == self.refs[(chat, prompt, stop)]}
        return out

    def sampled(self) -> dict:
        body = {"messages": [{"role": "user", "content": self.rng.choice(CHAT_PROMPTS)}], "max_tokens": self.max_tokens,
                "temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 32)}
        return {"status": self.send("/v1/chat/completions", json.dumps(body).encode())}

    def malformed(self) -> dict:
        return {"status": self.send("/v1/chat/completions", self.rng.choice(MALFORMED))}

    def auth(self) -> dict:
        auth = self.rng.choice([None, "Bearer wrong-key", "Basic Zm9vOmJhcg=="])
        return {"status": self.send("/v1/chat/completions", HI, Authorization=auth)}

    def origin(self) -> dict:
        return {"status": self.send("/v1/chat/completions", HI, Origin="http://evil.example")}

    def content_type(self) -> dict:
        return {"status": self.send("/v1/chat/completions", HI, **{"Content-Type": "text/plain"})}

    def oversized(self) -> dict:
        with self.ep.raw(self.ep.post_head("/v1/chat/completions", 64 << 20) + b" " * 65536) as s:
            head = s.recv(65536).split(b" ", 2)
        return {"status": int(head[1]) if len(head) > 1 else 0}

    def cancel(self) -> dict:
        """Start a long generation, then hang up after a moment (a streaming client after its first token)."""
        stream = self.rng.random() < 0.5
        body = json.dumps({"messages": [{"role": "user", "content": self.rng.choice(CHAT_PROMPTS)}],
                           "max_tokens": 4 * self.max_tokens, "stream": stream}).encode()
        s = self.ep.raw(self.ep.post_head("/v1/chat/completions", len(body)) + body)
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


HI = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def plain_answer(raw: bytes, chat: bool) -> tuple[str, str | None]:
    """(text, d3d finish_reason) of a whole answer."""
    body = json.loads(raw)
    choice = body["choices"][0]
    return (choice["message"]["content"] if chat else choice["text"]), body.get("d3d", {}).get("finish_reason")


def streamed_answer(raw: bytes, chat: bool) -> tuple[str, str | None]:
    """(text, d3d finish_reason) of a streamed answer."""
    text, finish = "", None
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            chunk = json.loads(line[5:])
            finish = chunk.get("d3d", {}).get("finish_reason", finish)
            for c in chunk.get("choices", []):
                text += (c["delta"].get("content") or "") if chat else c["text"]
    return text, finish


def references(gen, max_tokens: int) -> dict:
    """Plain decoding's (method ar) answer for every (chat?, prompt, stop) the clients may send."""
    refs = {}
    for chat, prompts in ((True, CHAT_PROMPTS), (False, RAW_PROMPTS)):
        for p in prompts:
            for stop in STOPS:
                refs[(chat, p, stop)] = gen.generate(p, max_new_tokens=max_tokens, raw=not chat, stop=stop)
    return refs


def random_phase(ep: Endpoint, cfg: LoadTest, refs: dict) -> dict:
    """cfg.clients Clients for cfg.duration seconds: their summary."""
    clients = [Client(ep, refs, cfg.max_tokens, random.Random(cfg.seed + i)) for i in range(cfg.clients)]
    t0 = time.monotonic()
    threads = [threading.Thread(target=c.run, args=(t0 + cfg.duration,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.monotonic() - t0
    records = [r for c in clients for r in c.records]
    statuses = Counter(str(r["status"]) for r in records)
    served = [r["seconds"] for r in records if r["status"] == 200]
    greedy = [r for r in records if "equal_ar" in r]
    return {
        "duration_s": round(duration, 1), "requests": len(records), "served": len(served),
        "latency_s": {"p50": percentile(served, 0.5), "p99": percentile(served, 0.99), "max": percentile(served, 1.0)},
        "status_counts": dict(sorted(statuses.items())),
        "by_kind": {k: dict(sorted(Counter(str(r["status"]) for r in records if r["kind"] == k).items()))
                    for k in KINDS},
        "server_5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "greedy_checked": len(greedy), "greedy_all_equal_ar": all(r["equal_ar"] for r in greedy),
        "greedy_cut_by_deadline": sum("cut" in r for r in records),
        "greedy_mismatches": [r["case"] for r in greedy if not r["equal_ar"]],
    }


def abuse_phases(ep: Endpoint, cfg: LoadTest, gen) -> dict:
    """The cases, long_prompt and connections phases that cfg.phases names."""
    from .requests import special_tokens

    out = {}
    models = json.loads(ep.request("GET", "/v1/models", timeout=60)[1])
    context = models["data"][0]["context_window"]
    if "cases" in cfg.phases:
        names = sorted(special_tokens(gen.tokenizer), key=lambda n: ("im_start" not in n, "start" not in n))
        special = names[0] if names else None  # ChatML's <|im_start|> where there is one
        out["cases"] = run_cases(ep, context, special, cfg.read_timeout)
    if "long_prompt" in cfg.phases:
        text, n = long_text(lambda t: gen.encode(t, raw=True), cfg.long_prompt_tokens, CHAT_PROMPTS + RAW_PROMPTS)
        out["long_prompt"] = long_prompt_phase(ep, text, n, cfg.leave_after, cfg.request_timeout)
    if "connections" in cfg.phases:
        out["connections"] = connections_phase(ep, cfg.connections, cfg.hold_s)
    return out


def run_load_test(cfg: LoadTest) -> dict:
    """Run the load test; the summary (see the module doc) with the settings it ran with."""
    from d3d import load

    proc, log = None, None
    if cfg.url:
        u = urlparse(cfg.url)
        ep = Endpoint(u.hostname, u.port or 80, cfg.api_key)
    else:
        log = open(cfg.server_log, "w+b") if cfg.server_log else tempfile.TemporaryFile()
        key = secrets.token_hex(16)
        proc, port = start_server(cfg, key, log)
        ep = Endpoint("127.0.0.1", port, key, proc.pid)
    out = {"method": cfg.method, "clients": cfg.clients, "max_tokens": cfg.max_tokens, "threads": cfg.threads,
           "request_timeout_s": cfg.request_timeout, "phases": list(cfg.phases)}
    try:
        gen = load(cfg.target, method="ar", threads=cfg.threads)
        refs = references(gen, cfg.max_tokens) if "random" in cfg.phases else {}
        wait_healthy(ep, proc)
        out["rss_mb_started"] = ep.rss_mb()
        if "random" in cfg.phases:
            out |= random_phase(ep, cfg, refs)
        out |= abuse_phases(ep, cfg, gen)
        time.sleep(1.0)  # let the last cancellations land in /metrics
        m = metrics_of(ep.request("GET", "/metrics", timeout=60)[1].decode())
        metrics = {k: m.get(f"d3d_{k}") for k in ("requests_cancelled_total", "generations_total",
                                                  "generated_tokens_total", "tau", "tokens_per_second")}
        out["server"] = {"health_after": ep.health(), "rss_mb_end": ep.rss_mb()} | metrics
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if log is not None:
            log.seek(0)
            out["server_log"] = scan_log(log.read().decode(errors="replace"))
            log.close()
    out["held"] = verdicts(out)
    out["all_held"] = all(v is not False for v in out["held"].values())
    return out
