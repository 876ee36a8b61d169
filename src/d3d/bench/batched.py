"""`d3d bench --clients 1,2,4,8`: many generations at once in this process, as `d3d serve --max-batch` runs them.

For each number of clients and each method in turn (methods interleaved level by level, so that a busy spell
of a shared machine slows them alike), `clients` threads take distinct prompts from one list, one after the
other, each a generation on a slot of one Scheduler (d3d.scheduler: continuous batching, load-aware
speculation), until the list is done. Nothing is learned from earlier answers (the tree methods and suffix run
as with --no-learn), so a prompt is not faster for having been answered before. Reported per method and level,
with the same names as `d3d loadtest --throughput`: aggregate tokens per second (all completion tokens over the
level's wall time), per-request decode tokens/s p50 (tokens after the first over the time after the first), time
to first token p50 / p95, and `identical_to_solo`: how many answers are token for token the method's answer at
one client. Without the HTTP server and its clients in the way this isolates the runtime and the scheduler;
`d3d loadtest --throughput` measures the server.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

from ..decoding.engine import GenerationResult
from ..decoding.verify import SamplingParams
from ..errors import D3DError
from ..server.loadtest_throughput import level_summary

LaneBuilder = Callable[[object], Callable[..., GenerationResult]]  # batch slot -> a runner on it


def parse_clients(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise D3DError(f"--clients takes comma-separated counts, e.g. 1,2,4,8 (got {text!r})") from None
    if not levels or min(levels) < 1:
        raise D3DError(f"--clients takes counts >= 1 (got {text!r})")
    return sorted(set(levels))


def run_level(model, build: LaneBuilder, prompts: list[list[int]], clients: int, max_batch: int,
              params: SamplingParams, max_new_tokens: int) -> tuple[dict, list[list[int]]]:
    """All `prompts` by `clients` concurrent generations on a fresh Scheduler of `max_batch` slots: the level's
    summary and each prompt's output tokens."""
    from ..scheduler import Scheduler

    scheduler = Scheduler(model, max_batch)
    try:
        slots = [scheduler.acquire() for _ in range(clients)]
        runners = [build(slot) for slot in slots]
        runners[0](prompts[0][:16], params=params, max_new_tokens=4)  # warm-up: allocations, lazy init
        scheduler.leave(slots[0].slot)
        forwards, rows = scheduler.forwards, scheduler.rows
        todo, lock = list(range(len(prompts))), threading.Lock()
        records: list[dict | None] = [None] * len(prompts)
        outputs: list[list[int] | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def client(slot, runner) -> None:
            while True:
                with lock:
                    if not todo or errors:
                        return
                    i = todo.pop(0)
                t0, first = time.perf_counter(), []
                try:
                    res = runner(prompts[i], params=params, max_new_tokens=max_new_tokens,
                                 on_round=lambda chunk, accepted: first or first.append(time.perf_counter()))
                except BaseException as e:  # reported after the level: a failed generation fails the bench
                    errors.append(e)
                    return
                finally:
                    scheduler.leave(slot.slot)
                outputs[i] = res.token_ids
                records[i] = {"tokens": len(res.token_ids), "ttft_s": first[0] - t0,
                              "total_s": time.perf_counter() - t0}

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=pair, daemon=True) for pair in zip(slots, runners)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        scheduler.stop()
    if errors:
        raise errors[0]
    summary = level_summary(clients, len(prompts), wall, records) | {
        "forwards": scheduler.forwards - forwards,
        "rows_per_forward": round((scheduler.rows - rows) / max(1, scheduler.forwards - forwards), 2)}
    return summary, outputs


def run_batched(model, builders: dict[str, LaneBuilder], prompts: list[list[int]], levels: list[int],
                params: SamplingParams, max_new_tokens: int, repeat: int = 1, progress: bool = True) -> dict:
    """Every method at every level, methods taking turns within a level (`repeat` times: each figure is then
    the median of the runs). Returns {method: {"levels": [...]}}; a level's `x_one_client` is its aggregate rate
    over the method's own at one client, `x_ar` the median over the runs of its rate over `ar`'s in the same
    turn (where `ar` runs)."""
    if not prompts:
        raise D3DError("the batched benchmark needs at least one prompt")
    out: dict[str, dict] = {m: {"levels": []} for m in builders}
    solo: dict[str, list[list[int]]] = {}
    for clients in levels:
        runs: dict[str, list[dict]] = {m: [] for m in builders}
        for r in range(repeat):
            for m, build in builders.items():
                summary, outputs = run_level(model, build, prompts, clients, max(levels), params, max_new_tokens)
                solo.setdefault(m, outputs)
                summary["identical_to_solo"] = sum(a == b for a, b in zip(outputs, solo[m]))
                runs[m].append(summary)
                if progress:
                    print(f"{m} at {clients} client(s), run {r + 1}/{repeat}: "
                          f"{summary['aggregate_tokens_per_s']:.2f} tok/s, ttft p95 {summary['ttft_p95_s']} s, "
                          f"{summary['identical_to_solo']}/{len(prompts)} identical to solo", flush=True)
        for m, rows in runs.items():
            row = dict(rows[0]) if repeat == 1 else _median_row(rows)
            if repeat > 1:
                row["aggregate_tokens_per_s_runs"] = [x["aggregate_tokens_per_s"] for x in rows]
            if "ar" in runs:
                row["x_ar"] = round(statistics.median(x["aggregate_tokens_per_s"] / a["aggregate_tokens_per_s"]
                                                      for x, a in zip(rows, runs["ar"])), 3)
            out[m]["levels"].append(row)
    for m, result in out.items():
        one = result["levels"][0]["aggregate_tokens_per_s"] if levels[0] == 1 else None
        for row in result["levels"]:
            if one:
                row["x_one_client"] = round(row["aggregate_tokens_per_s"] / one, 3)
    return out


def _median_row(rows: list[dict]) -> dict:
    row = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and key not in ("clients", "requests"):
            row[key] = round(statistics.median(r[key] for r in rows), 3)
    row["identical_to_solo"] = min(r["identical_to_solo"] for r in rows)
    return row


def format_levels(result: dict) -> str:
    lines = ["| method | clients | aggregate tok/s | x 1 client | x `ar` | per-request tok/s p50 | TTFT p50 / p95 s | "
             "identical to solo |", "|---|---|---|---|---|---|---|---|"]
    for m, r in result.items():
        for row in r["levels"]:
            lines.append(f"| `{m}` | {row['clients']} | {row['aggregate_tokens_per_s']:.2f} | "
                         f"{row.get('x_one_client', '')} | {row.get('x_ar', '')} | "
                         f"{row['per_request_tokens_per_s_p50']} | "
                         f"{row['ttft_p50_s']} / {row['ttft_p95_s']} | "
                         f"{row['identical_to_solo']}/{row['requests']} |")
    return "\n".join(lines)
