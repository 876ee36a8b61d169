"""`d3d loadtest`'s holding phases: a long prompt whose client leaves, and many slow or idle connections.

long_prompt_phase: a prompt of ~4,000 tokens (real prompts repeated), sent plain and then streamed;
its client hangs up after 2 s (the prompt still being processed); measured: how long until the worker
is free (/health: nothing running or waiting) and a small request is answered. Bar: freed within
request_timeout + 2 s and the next request answered (200).

connections_phase: `n` connections in four kinds held open for a while (each one the server closes is
reopened): idle (nothing sent), slow headers (a header trickled), slow body (a small body trickled),
held body (1 MB of a declared ~4 MB body sent, then nothing). Meanwhile a small request every second
is timed, and the server's RSS sampled. Bars: every small request answered (200) within 2 s, RSS
within 100 MB of what it was just before, and each connection ended as it must (idle and slow
headers closed, slow and held bodies 408)."""
from __future__ import annotations

import json
import selectors
import socket
import statistics
import threading
import time
from collections import Counter

from .loadtest_base import SMALL, Endpoint, percentile, reply_status

HOLD_KINDS = {"idle": "closed", "slow headers": "closed", "slow body": "408", "held body": "408"}
DECLARED = 4_000_000  # a held body's Content-Length: under the 4 MB body limit, never completed
LATENCY_BAR_S, MEMORY_BAR_MB = 2.0, 100.0


def long_text(encode, n_tokens: int, pieces: list[str]) -> tuple[str, int]:
    """Real prompts repeated (one per line) to at least `n_tokens` tokens by `encode`, at most one prompt
    more: (text, its token count)."""
    parts = []
    while True:
        parts += pieces
        n = len(encode("\n".join(parts)))
        if n >= n_tokens:
            break
    while len(parts) > 1 and len(encode("\n".join(parts[:-1]))) >= n_tokens:
        parts.pop()
    text = "\n".join(parts)
    return text, len(encode(text))


def timed_small(ep: Endpoint) -> tuple[int, float]:
    """(status, seconds) of the small request."""
    t0 = time.monotonic()
    try:
        status = ep.request("POST", "/v1/chat/completions", SMALL, timeout=120)[0]
    except OSError:
        status = 0
    return status, round(time.monotonic() - t0, 3)


def leave_long_prompt(ep: Endpoint, text: str, stream: bool, leave_after: float, give_up: float) -> dict:
    """Send the long prompt, hang up after `leave_after` s; seconds from then until the worker is free and
    until a small request is answered."""
    cancelled = ep.metric("d3d_requests_cancelled_total") or 0
    body = json.dumps({"prompt": text, "max_tokens": 256, "stream": stream, "temperature": 0}).encode()
    s = ep.raw(ep.post_head("/v1/completions", len(body)) + body)
    time.sleep(leave_after)
    busy = ep.health().get("running") == 1
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    left = time.monotonic()
    freed = None
    while time.monotonic() - left < give_up:
        if ep.idle():
            freed = round(time.monotonic() - left, 3)
            break
        time.sleep(0.05)
    status, took = timed_small(ep)
    return {"stream": stream, "busy_when_left": busy, "freed_after_leave_s": freed, "next_status": status,
            "next_answered_after_leave_s": round(time.monotonic() - left, 3), "next_request_s": took,
            "server_cancelled": (ep.metric("d3d_requests_cancelled_total") or 0) - cancelled}


def long_prompt_phase(ep: Endpoint, text: str, tokens: int, leave_after: float, request_timeout: float) -> dict:
    bar = request_timeout + 2
    runs = [leave_long_prompt(ep, text, stream, leave_after, 3 * bar) for stream in (False, True)]
    held = all(r["freed_after_leave_s"] is not None and r["freed_after_leave_s"] <= bar and r["next_status"] == 200
               for r in runs)
    return {"prompt_tokens": tokens, "prompt_chars": len(text), "leave_after_s": leave_after, "bar_s": bar,
            "runs": runs, "held": held}


class Holder:
    """Keeps `n` slow or idle connections open, the four HOLD_KINDS in turn, for `hold_s` seconds: one the
    server ends is recorded (its reply_status) and opened again; slow ones get one byte every `every` s."""

    def __init__(self, ep: Endpoint, n: int, hold_s: float, held_bytes: int = 1 << 20, every: float = 1.0):
        self.ep, self.n, self.hold_s, self.held_bytes, self.every = ep, n, hold_s, held_bytes, every
        self.sel = selectors.DefaultSelector()
        self.outcomes = {k: Counter() for k in HOLD_KINDS}
        self.open_counts: list[int] = []
        self.ready = threading.Event()

    def open(self, kind: str) -> None:
        ep, path = self.ep, "/v1/chat/completions"
        first = {"idle": b"", "slow headers": b"GET /health HTTP/1.1\r\nHost: %s\r\nX-Pad: " % ep.host.encode(),
                 "slow body": ep.post_head(path, 1000) + b"{",
                 "held body": ep.post_head(path, DECLARED) + b" " * self.held_bytes}[kind]
        try:
            s = ep.raw(first, timeout=30)
        except OSError as e:
            self.outcomes[kind][f"open failed: {type(e).__name__}"] += 1
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, kind)

    def end(self, s: socket.socket, kind: str, reopen: bool = True) -> None:
        self.sel.unregister(s)
        s.settimeout(1.0)
        self.outcomes[kind][reply_status(s)] += 1
        s.close()
        if reopen:
            self.open(kind)

    def trickle(self) -> None:
        for key in list(self.sel.get_map().values()):
            if key.data in ("slow headers", "slow body"):
                try:
                    key.fileobj.send(b"a" if key.data == "slow headers" else b" ")
                except OSError:
                    self.end(key.fileobj, key.data)

    def run(self) -> None:
        kinds = list(HOLD_KINDS)
        for i in range(self.n):
            self.open(kinds[i % len(kinds)])
        self.ready.set()
        until, next_trickle = time.monotonic() + self.hold_s, time.monotonic() + self.every
        while time.monotonic() < until:
            for key, _ in self.sel.select(timeout=0.2):
                self.end(key.fileobj, key.data)
            if time.monotonic() >= next_trickle:
                self.trickle()
                next_trickle += self.every
            self.open_counts.append(len(self.sel.get_map()))
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()


def connections_phase(ep: Endpoint, n: int, hold_s: float, held_bytes: int = 1 << 20, every: float = 1.0,
                      pace: float = 1.0) -> dict:
    """Hold `n` connections (Holder) while timing a small request every `pace` s and sampling the RSS."""
    time.sleep(1.0)
    rss_idle = ep.rss_mb()
    holder = Holder(ep, n, hold_s, held_bytes, every)
    thread = threading.Thread(target=holder.run, daemon=True)
    thread.start()
    holder.ready.wait()
    small, health, rss = [], [], []
    while thread.is_alive():
        t0 = time.monotonic()
        small.append(timed_small(ep))
        h0 = time.monotonic()
        health.append((ep.request("GET", "/health", timeout=120)[0], time.monotonic() - h0))
        rss.append(ep.rss_mb())
        time.sleep(max(0.0, pace - (time.monotonic() - t0)))
    thread.join()
    time.sleep(1.0)
    lat = [t for _, t in small]
    rss_known = [r for r in rss if r is not None]
    peak = max(rss_known) if rss_known else None
    over = None if peak is None or rss_idle is None else round(peak - rss_idle, 1)
    outcomes = {k: {"expect": e, "got": dict(holder.outcomes[k])} for k, e in HOLD_KINDS.items()}
    opened = holder.open_counts[len(holder.open_counts) // 10:] or [0]
    return {"connections": n, "hold_s": hold_s, "held_body_bytes": held_bytes, "trickle_every_s": every,
            "open_during": {"min": min(opened), "median": int(statistics.median(opened))},
            "outcomes": outcomes, "small_requests": len(small),
            "small_status": dict(Counter(str(s) for s, _ in small)),
            "small_latency_s": {"p50": percentile(lat, 0.5), "max": percentile(lat, 1.0)},
            "health_latency_s": {"p50": percentile([t for _, t in health], 0.5),
                                 "max": percentile([t for _, t in health], 1.0)},
            "rss_mb": {"idle": rss_idle, "peak": peak, "after": ep.rss_mb(), "peak_over_idle": over},
            "bars": {"small_within_s": LATENCY_BAR_S, "rss_over_idle_mb": MEMORY_BAR_MB},
            "held": {"small_answered_in_time": bool(small) and all(s == 200 and t <= LATENCY_BAR_S for s, t in small),
                     "memory": None if over is None else over <= MEMORY_BAR_MB,
                     "connections_ended_as_expected": all(set(o["got"]) <= {o["expect"]} for o in outcomes.values())}}
