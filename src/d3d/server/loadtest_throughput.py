"""`d3d loadtest --phases throughput`: what concurrent clients get from a server, d3d's and llama.cpp's.

For each server (d3d serve with each of `methods`, started with --no-learn so that no answer is drafted from an
earlier one, and --max-batch; then llama.cpp's own server on the same weights, where llama-cpp-python[server] is
installed) and each number of clients in `concurrency`, on a server started for that level (both servers reuse a
slot's cached prompt prefix, so a level must not follow another on one server), every client sends streamed
greedy chat requests, one after the other, from one shared list of distinct prompts (unseen benchmark questions:
code, chat, math) until the list is done. Reported per level: aggregate completion tokens per second (all tokens over the wall time of
the level), per-request decode tokens/s (tokens after the first over the time after the first), time to first
token p50 / p95, and the status codes. Every answer at more than one client is compared with the same server's
answer at one client (its solo answer): `identical_to_solo`. Then, on d3d's servers, `long_prompt_ttft`: short
requests sent while a prompt of `long_prompt_tokens` tokens is being prefilled, their time to first token.

With `repeat` N > 1 the whole sequence of servers runs N times, in turns (every other turn in reverse order, so no
server always runs first), and each figure is its median over the turns; the turns' own figures are kept
(`turns`), and `x_one_client_by_turn` gives each level's ratio to one client within each turn. On a shared machine
whose rates move 20-40% within minutes, one turn's level-to-level ratio is as noisy as the effects measured.
"""
from __future__ import annotations

import http.client
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import D3DError
from .loadtest_base import Endpoint, LoadTest, free_port, percentile, scan_log, wait_healthy

CONCURRENCY = (1, 2, 4, 8)
SHORT_PROMPTS = ["What is the capital of France? Answer briefly.", "List three primary colors.",
                 "What is 17 * 23?", "Name a planet.", "Say hello in Spanish.", "What is the opposite of cold?"]
WARM_UP = "Count from one to five."  # a server's first request, in no list of prompts


def throughput_prompts(n: int) -> list[str]:
    """n distinct user messages taken in turn from HumanEval, MT-Bench (first turns) and GSM8K, from the end of
    each set (the benchmark commands of README start at the front)."""
    from ..corpus.prompts import benchmark_prompts

    sets = [benchmark_prompts("humaneval")[::-1], [m.turns[0] for m in benchmark_prompts("mt-bench")][::-1],
            benchmark_prompts("gsm8k")[::-1]]
    return [sets[i % 3][i // 3] for i in range(n)]


def stream_chat(ep: Endpoint, prompt: str, max_tokens: int, timeout: float = 900) -> dict:
    """One streamed greedy chat completion: status, time to first token, total time, completion tokens (usage,
    else content chunks) and text."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {ep.key}"} if ep.key else {})
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=timeout)
    t0 = time.perf_counter()
    out = {"status": None, "ttft_s": None, "total_s": None, "tokens": 0, "text": ""}
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            resp.read()
            return out
        chunks, usage = 0, None
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    out["ttft_s"] = out["ttft_s"] or time.perf_counter() - t0
                    out["text"] += piece
                    chunks += 1
        out["total_s"] = time.perf_counter() - t0
        out["tokens"] = (usage or {}).get("completion_tokens") or chunks
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def run_level(ep: Endpoint, prompts: list[str], clients: int, max_tokens: int) -> tuple[dict, list[dict]]:
    """All `prompts` sent by `clients` concurrent clients: the level's summary and each request's record."""
    todo: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    records: list[dict | None] = [None] * len(prompts)

    def client():
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            records[i] = stream_chat(ep, p, max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in records if r["status"] == 200 and r["ttft_s"] is not None]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return level_summary(clients, len(prompts), wall, ok) | {"statuses": statuses}, records


def level_summary(clients: int, requests: int, wall: float, done: list[dict]) -> dict:
    """A level's figures from its answered requests (`tokens`, `ttft_s`, `total_s` each): aggregate completion
    tokens/s over the level's wall time, per-request decode tokens/s p50 (tokens after the first over the time
    after the first), time to first token p50 / p95 (also d3d.bench.batched's)."""
    decode = [(r["tokens"] - 1) / (r["total_s"] - r["ttft_s"]) for r in done
              if r["tokens"] > 1 and r["total_s"] > r["ttft_s"]]
    tokens = sum(r["tokens"] for r in done)
    return {"clients": clients, "requests": requests, "wall_s": round(wall, 2), "completion_tokens": tokens,
            "aggregate_tokens_per_s": round(tokens / wall, 2),
            "per_request_tokens_per_s_p50": percentile(decode, 0.5),
            "ttft_p50_s": percentile([r["ttft_s"] for r in done], 0.5),
            "ttft_p95_s": percentile([r["ttft_s"] for r in done], 0.95)}


def long_prompt_ttft(ep: Endpoint, text: str, prompt_tokens: int, shorts: int = 6) -> dict:
    """Short streamed requests (SHORT_PROMPTS, 8 tokens each) sent one after the other while `text` (a prompt of
    `prompt_tokens` tokens) is being prefilled (sent first, 0.3 s ahead): their time to first token, and the long
    request's own."""
    long = {}
    t = threading.Thread(target=lambda: long.update(stream_chat(ep, text, 8)))
    t.start()
    time.sleep(0.3)
    records = [stream_chat(ep, p, 8) for p in (SHORT_PROMPTS * shorts)[:shorts]]
    t.join()
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {"prompt_tokens": prompt_tokens, "long_ttft_s": long.get("ttft_s") and round(long["ttft_s"], 2),
            "long_status": long.get("status"), "short_requests": shorts,
            "short_ttft_p50_s": percentile(ttfts, 0.5), "short_ttft_p95_s": percentile(ttfts, 0.95),
            "shorts_during_prefill": sum(r["ttft_s"] is not None and r["total_s"] is not None for r in records),
            "short_statuses": sorted({str(r["status"]) for r in records})}


def d3d_server(cfg: LoadTest, method: str, max_batch: int, log) -> tuple[subprocess.Popen, int]:
    """`d3d serve` with `method`, --no-learn and --max-batch on a free loopback port, its output to `log`."""
    port = free_port()
    cmd = [sys.executable, "-m", "d3d.cli", "serve", "--method", method, "--threads", str(cfg.threads),
           "--port", str(port), "--max-queue", str(max(16, 2 * max_batch)), "--no-learn", "--max-batch",
           str(max_batch)] + (["--target", cfg.target] if cfg.target else []) + \
          (["--quantize", cfg.quantize] if cfg.quantize else [])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port


def llama_cpp_server(cfg: LoadTest, log) -> tuple[subprocess.Popen, int, str]:
    """llama-cpp-python's OpenAI server on the target's weights as a GGUF in the precision d3d serves (F32; with
    --quantize int8 Q8_0; with int4 the target's own 4-bit file where it comes from one, else Q4_0)."""
    from ..methods.llamacpp import reference_gguf
    from ..runtime.checkpoints import resolve_target
    from ..runtime.gguf_load import target_gguf

    source = target_gguf(cfg.target) if cfg.quantize == "int4" else None
    gguf = source[0] if source else reference_gguf(resolve_target(cfg.target),
                                                   {None: "f32", "int8": "q8_0", "int4": "q4_0"}[cfg.quantize])
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(cfg.threads),
           "--n_threads_batch", str(cfg.threads), "--n_ctx", "8192", "--host", "127.0.0.1", "--port", str(port),
           "--interrupt_requests", "False"]  # by default a new request cuts the running one short
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port, gguf.name


def measure_server(start, prompts: list[str], cfg: LoadTest, levels: tuple[int, ...],
                   long_prompt: tuple[str, int] | None, logs: list[str], health: str = "/health") -> dict:
    """Each level on a server of its own: `start(log)` -> (process, endpoint), stopped after the level, its output
    appended to `logs`. d3d's server and llama.cpp's keep a slot's last prompt and feed only what follows its
    common prefix with the next, so on one server a level would find the prompts of the levels before it cached.
    The long-prompt phase runs on the last level's server."""
    out, solo = {"levels": []}, None
    for i, clients in enumerate(levels):
        with tempfile.TemporaryFile() as log:
            proc, ep = start(log)
            try:
                wait_healthy(ep, proc, path=health)
                stream_chat(ep, WARM_UP, 8)  # kernels, caches, the first allocation; a prompt the level does not send
                summary, records = run_level(ep, prompts, clients, cfg.max_tokens)
                if solo is None:
                    solo = records
                else:
                    summary["identical_to_solo"] = sum(r["text"] == s["text"] and r["tokens"] == s["tokens"]
                                                       for r, s in zip(records, solo) if r["status"] == 200)
                out["levels"].append(summary)
                print(json.dumps(summary), file=sys.stderr, flush=True)
                if long_prompt and i == len(levels) - 1:
                    out["long_prompt_ttft"] = long_prompt_ttft(ep, *long_prompt)
                    print(json.dumps(out["long_prompt_ttft"]), file=sys.stderr, flush=True)
                out["rss_mb"] = max(out.get("rss_mb") or 0, ep.rss_mb() or 0) or None
            finally:
                proc.terminate()
                proc.wait(30)
                log.seek(0)
                logs.append(log.read().decode(errors="replace"))
    return out


def run_throughput(cfg: LoadTest, methods: list[str], levels: tuple[int, ...] = CONCURRENCY,
                   requests: int | None = None, llama_cpp: bool = True, max_batch: int | None = None,
                   repeat: int = 1) -> dict:
    """The throughput phase (see the module doc) for each of `methods` and, if installed, llama.cpp's server;
    `requests`: prompts per level (default: twice the most clients); max_batch: d3d's --max-batch (default: the
    most clients); repeat: turns over all the servers, figures reported as medians (see the module doc)."""
    from ..runtime.checkpoints import resolve_target
    from ..runtime.kernels import runtime_info
    from ..bench.harness import git_commit
    from ..runtime.loading import load_tokenizer
    from .loadtest_hold import long_text

    prompts = throughput_prompts(requests or 2 * max(levels))
    tok = load_tokenizer(resolve_target(cfg.target))
    long = long_text(lambda t: tok.encode(t), cfg.long_prompt_tokens, prompts)
    out = {"phase": "throughput", "target": cfg.target, "max_tokens": cfg.max_tokens, "threads": cfg.threads,
           "requests": len(prompts), "concurrency": list(levels), "max_batch": max_batch or max(levels),
           "quantize": cfg.quantize, "runtime": runtime_info(quantized=cfg.quantize is not None),
           **dict(zip(("git_commit", "git_dirty"), git_commit())), "repeat": repeat, "servers": {}}
    names = [*methods, *(["llama.cpp"] if llama_cpp else [])]
    if "llama.cpp" in names:
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError:
            out["servers"]["llama.cpp"] = {"skipped": "needs llama-cpp-python[server]: pip install "
                                                      "'llama-cpp-python[server]==0.3.36'"}
            names.remove("llama.cpp")
    turns: dict[str, list[dict]] = {name: [] for name in names}
    logs: dict[str, list[str]] = {name: [] for name in names}
    for turn in range(repeat):
        for name in names if turn % 2 == 0 else names[::-1]:
            turns[name].append(_measure(cfg, name, prompts, levels, long, logs[name], max_batch))
    for name in names:
        result = turns[name][0] if repeat == 1 else medians(turns[name])
        result["server_log"] = scan_log("\n".join(logs[name]))
        out["servers"][name] = result
    return out


def _measure(cfg: LoadTest, name: str, prompts: list[str], levels: tuple[int, ...], long: tuple[str, int],
             logs: list[str], max_batch: int | None) -> dict:
    """One turn of one server (d3d's with method `name`, or llama.cpp's) over the levels."""
    gguf = []

    def start(log):
        if name == "llama.cpp":
            proc, port, file = llama_cpp_server(cfg, log)
            gguf[:] = [file]
        else:
            proc, port = d3d_server(cfg, name, max_batch or max(levels), log)
        return proc, Endpoint("127.0.0.1", port, None, proc.pid)

    try:
        if name == "llama.cpp":
            result = measure_server(start, prompts, cfg, levels, None, logs, health="/v1/models")
            result["gguf"] = gguf[0]
        else:
            result = measure_server(start, prompts, cfg, levels, long, logs)
    except (D3DError, OSError) as e:  # one server that fails does not lose the others' figures
        result = {"error": f"{type(e).__name__}: {e}"}
    return result


MEDIAN_FIELDS = ("aggregate_tokens_per_s", "per_request_tokens_per_s_p50", "ttft_p50_s", "ttft_p95_s")
LONG_MEDIAN_FIELDS = ("long_ttft_s", "short_ttft_p50_s", "short_ttft_p95_s")


def median_of(values) -> float | None:
    """The median of the values that were measured (a time is None where no request got a token)."""
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 3) if got else None


def ratio(level: dict, one_client: dict) -> float | None:
    """A level's aggregate tokens/s over the one-client level's (None where that level committed nothing)."""
    base = one_client["aggregate_tokens_per_s"]
    return round(level["aggregate_tokens_per_s"] / base, 3) if base else None


def medians(turns: list[dict]) -> dict:
    """One server's turns combined: per level the median of each rate and time, the counts (statuses, answers
    identical to solo, requests) summed; the long-prompt phase's times as medians; the turns themselves kept. A turn
    that failed is reported as the server's error."""
    failed = [t for t in turns if "levels" not in t]
    if failed:
        return {**failed[0], "turns": turns}
    levels = []
    for lvs in zip(*(t["levels"] for t in turns)):
        lv = {"clients": lvs[0]["clients"], "requests": sum(x["requests"] for x in lvs),
              **{k: median_of(x[k] for x in lvs) for k in MEDIAN_FIELDS}, "statuses": {}}
        for x in lvs:
            for code, n in x["statuses"].items():
                lv["statuses"][code] = lv["statuses"].get(code, 0) + n
        if "identical_to_solo" in lvs[0]:
            lv["identical_to_solo"] = sum(x["identical_to_solo"] for x in lvs)
        levels.append(lv)
    out = {"levels": levels, "x_one_client_by_turn": [[ratio(lv, t["levels"][0]) for lv in t["levels"]] for t in turns],
           "rss_mb": max((t.get("rss_mb") or 0 for t in turns), default=0) or None, "turns": turns}
    longs = [t["long_prompt_ttft"] for t in turns if "long_prompt_ttft" in t]
    if longs:
        out["long_prompt_ttft"] = {**longs[0], **{k: median_of(x[k] for x in longs) for k in LONG_MEDIAN_FIELDS},
                                   **{k: sum(x[k] for x in longs) for k in ("short_requests", "shorts_during_prefill")},
                                   "long_status": max((x["long_status"] or 0 for x in longs), default=0) or None,
                                   "short_statuses": sorted({c for x in longs for c in x["short_statuses"]})}
    if "gguf" in turns[0]:
        out["gguf"] = turns[0]["gguf"]
    return out


def throughput_table(out: dict) -> str:
    """A markdown table of a throughput run: per server and level, aggregate tokens/s and its ratio to the same
    server at one client, per-request tokens/s, time to first token, answers identical to solo, non-200s."""
    rows = ["| server | clients | aggregate tok/s | x 1 client | per-request tok/s (p50) | TTFT p50 / p95 s "
            "| identical to solo | non-200 |", "|---|---|---|---|---|---|---|---|"]
    if out.get("repeat", 1) > 1:
        rows.insert(0, f"(medians of {out['repeat']} turns; answers and statuses counted over all of them)")
    for name, result in out["servers"].items():
        if "levels" not in result:
            rows.append(f"| {name} | {result.get('skipped') or result.get('error')} | | | | | | |")
            continue
        base = result["levels"][0]["aggregate_tokens_per_s"] or None
        for lv in result["levels"]:
            bad = sum(n for code, n in lv["statuses"].items() if code != "200")
            same = lv.get("identical_to_solo")
            rows.append(f"| {name} | {lv['clients']} | {lv['aggregate_tokens_per_s']} | "
                        f"{lv['aggregate_tokens_per_s'] / base if base else 0:.2f} | {lv['per_request_tokens_per_s_p50']} | "
                        f"{lv['ttft_p50_s']} / {lv['ttft_p95_s']} | "
                        f"{'(solo)' if same is None else str(same) + '/' + str(lv['requests'])} | {bad} |")
        lp = result.get("long_prompt_ttft")
        if lp:
            rows.append(f"| {name}: short requests during a {lp['prompt_tokens']}-token prefill | | | | | "
                        f"{lp['short_ttft_p50_s']} / {lp['short_ttft_p95_s']} | | |")
    return "\n".join(rows)


def throughput_plot(out: dict, path) -> None:
    """Aggregate tokens/s and time to first token (p95) against clients, one line per server, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, result in out["servers"].items():
        if "levels" not in result:
            continue
        clients = [lv["clients"] for lv in result["levels"]]
        left.plot(clients, [lv["aggregate_tokens_per_s"] for lv in result["levels"]], marker="o", label=name)
        right.plot(clients, [lv["ttft_p95_s"] for lv in result["levels"]], marker="o", label=name)
    for ax, title in ((left, "aggregate completion tokens/s"), (right, "time to first token, p95 (s)")):
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    cpu = out.get("runtime", {}).get("cpu", "")
    fig.suptitle(f"{out.get('target') or 'SmolLM2-135M-Instruct'}: {out['max_tokens']} new tokens, greedy, "
                 f"{out['threads']} threads, {cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
