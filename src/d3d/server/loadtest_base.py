"""What every phase of `d3d loadtest` shares: its settings (LoadTest), the server under test (Endpoint:
plain and raw HTTP, /health, the server process's RSS), starting `d3d serve` with its log captured,
and reading that log for tracebacks and 5xx answers."""
from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from ..errors import D3DError

PHASES = ("random", "cases", "long_prompt", "connections")
# a small request: what must still be answered quickly while the server is abused
SMALL = {"messages": [{"role": "user", "content": "What is the capital of France? Answer briefly."}],
         "max_tokens": 4, "temperature": 0}


@dataclass
class LoadTest:
    """What to run: against `url` (with `api_key`), or a server started here with method, target, threads,
    max_queue and request_timeout; `clients` start random requests for `duration` seconds (greedy ones
    of max_tokens tokens), then the abuse phases: cases (each answered with its 4xx), long_prompt (a
    prompt of long_prompt_tokens tokens whose client leaves after leave_after s), connections
    (`connections` slow or idle connections held for hold_s seconds). server_log: keep the started
    server's log there (default: a temporary file)."""
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
    request_timeout: float = 10.0
    phases: tuple = PHASES
    long_prompt_tokens: int = 4000
    quantize: str | None = None  # --throughput: the d3d servers' --quantize (llama.cpp then runs the like weights)
    leave_after: float = 2.0
    connections: int = 200
    hold_s: float = 30.0
    server_log: str | None = None
    read_timeout: float = 10.0  # the started server's --read-timeout (d3d serve's default)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


@dataclass
class Endpoint:
    """The server under test: address, API key, and (when started here or in-process) its process id."""
    host: str
    port: int
    key: str | None = None
    pid: int | None = None

    def request(self, method: str, path: str, body: dict | bytes | None = None, headers: dict | None = None,
                timeout: float = 600) -> tuple[int, bytes]:
        """(status, body) of one request on a fresh connection; JSON bodies and the API key by default,
        a header given as None is left out."""
        h = ({"Content-Type": "application/json"} if body is not None else {}) \
            | ({"Authorization": f"Bearer {self.key}"} if self.key else {}) | (headers or {})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body).encode() if isinstance(body, dict) else body,
                         headers={k: v for k, v in h.items() if v is not None})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post_head(self, path: str, length: int, extra: bytes = b"") -> bytes:
        """The head of a POST of `length` body bytes (valid Host, key and Content-Type)."""
        auth = f"Authorization: Bearer {self.key}\r\n".encode() if self.key else b""
        return (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s%sContent-Length: %d\r\n\r\n"
                % (path.encode(), self.host.encode(), auth, extra, length))

    def raw(self, data: bytes = b"", timeout: float = 600) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=timeout)
        if data:
            s.sendall(data)
        return s

    def health(self) -> dict:
        status, raw = self.request("GET", "/health", timeout=30)
        return json.loads(raw) | {"http": status}

    def idle(self) -> bool:
        h = self.health()
        return h.get("running") == 0 and h.get("waiting") == 0

    def metric(self, name: str) -> float | None:
        text = self.request("GET", "/metrics", timeout=30)[1].decode()
        return metrics_of(text).get(name)

    def rss_mb(self) -> float | None:
        """The server process's resident memory (VmRSS), MB; None when not known (a server at --url)."""
        if self.pid is None:
            return None
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return round(int(line.split()[1]) / 1024, 1)
        except OSError:
            return None
        return None


def metrics_of(text: str) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def reply_status(s: socket.socket) -> str:
    """What a raw connection got back: its status code ("408"), "closed" (closed with no answer) or
    "timeout" (nothing within the socket's timeout)."""
    try:
        head = s.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    except (socket.timeout, TimeoutError):
        return "timeout"
    parts = head.split(b" ", 2)
    return "closed" if not head else parts[1].decode() if len(parts) > 1 else "garbled"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cfg: LoadTest, key: str, log) -> tuple[subprocess.Popen, int]:
    """`d3d serve` on a free loopback port with cfg's settings and --request-timeout, stdout and stderr to `log`."""
    port = free_port()
    cmd = [sys.executable, "-m", "d3d.cli", "serve", "--method", cfg.method, "--threads", str(cfg.threads),
           "--port", str(port), "--max-queue", str(cfg.max_queue), "--api-key", key,
           "--request-timeout", f"{cfg.request_timeout:g}", "--read-timeout", f"{cfg.read_timeout:g}"]
    cmd += ["--target", cfg.target] if cfg.target else []
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port


def wait_healthy(ep: Endpoint, proc: subprocess.Popen | None, timeout: float = 600, path: str = "/health") -> None:
    """Until GET `path` answers 200 (llama.cpp's server has no /health: /v1/models there)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise D3DError("the server exited while starting")
        try:
            if ep.request("GET", path, timeout=30)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise D3DError("the server did not come up")
        time.sleep(0.5)


ACCESS = re.compile(r'"[A-Z]+ \S+ HTTP/[\d.]+" (\d{3})')
TROUBLE = ("Traceback", "unhandled error", "Exception in ASGI application")


def scan_log(text: str) -> dict:
    """The server log's access lines by status class, its 5xx answers and tracebacks (first few of each)."""
    statuses, bad_5xx, trouble = {}, [], []
    for line in text.splitlines():
        m = ACCESS.search(line)
        if m:
            cls = m.group(1)[0] + "xx"
            statuses[cls] = statuses.get(cls, 0) + 1
            if cls == "5xx":
                bad_5xx.append(line.strip())
        if any(t in line for t in TROUBLE):
            trouble.append(line.strip())
    return {"lines": len(text.splitlines()), "access_by_class": dict(sorted(statuses.items())),
            "status_5xx": len(bad_5xx), "tracebacks": sum("Traceback" in t for t in trouble),
            "trouble_lines": len(trouble), "examples": (bad_5xx + trouble)[:6]}
