"""The trace of an asynchronous generation (generate_async(trace=...)): timed spans on two lanes, the
target's and the drafter's, as Chrome trace events (chrome://tracing, Perfetto; d3d.bench.plots draws them).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

VERIFY_TID, DRAFT_TID = 0, 1


def now_us() -> float:
    return time.perf_counter_ns() / 1000


def add_span(trace: list | None, name: str, tid: int, t0: float, t1: float, **args) -> None:
    """Record a span from t0 to t1 (microseconds) on lane `tid` in `trace` (None: record nothing)."""
    if trace is not None:
        trace.append({"name": name, "ph": "X", "ts": t0, "dur": t1 - t0, "pid": 0, "tid": tid, "args": args})


def write_chrome_trace(events: list[dict], path: str | Path) -> None:
    """Write spans collected by generate_async(trace=...) as a Chrome trace (chrome://tracing, Perfetto).
    Lanes are roles, not OS threads: tid 0 the target (prefill, verify), tid 1 the drafter (prefill,
    packed draft in the worker, and the serial sync draft / pick of the next block)."""
    names = {VERIFY_TID: "target: verify", DRAFT_TID: "drafter: packed draft"}
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
            for tid, name in names.items()]
    Path(path).write_text(json.dumps({"traceEvents": meta + list(events), "displayTimeUnit": "ms"}) + "\n")
