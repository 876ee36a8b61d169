"""The replay model of asynchronous D3D: a run's rounds priced on another device.

At temperature 0 a run's rounds do not depend on the device: its verified text is the target's own, so the drafts,
the acceptance lengths (their mean: tau) and whether each round's accepted count was packed (the hit rate) come
out the same anywhere. Only what a round costs changes. Per round:

    d3d (sync)    draft + verify
    d3d-async     together(verify, packed) + pick + (1 - hit rate) * draft

verify: the target's forward over a block (the pending token and B - 1 drafts); draft: a synchronous drafter pass
(one new token and the block's B mask slots); packed: the packed pass (every acceptance count's successor block,
B + B*B tokens); pick: the drafter's LM head on the chosen candidate's slots. `together`, what verify and the
packed pass cost launched at once, is the device profile:

- measured: both at once on this machine, as d3d-async runs them (on a CPU, the worker thread and the loop with
  half of the threads each);
- cpu(N): each pass's time on c cores t(c) = serial + parallel / c, fitted from its time on one thread and on
  all of them; the target and the drafter on disjoint cores, the best split of N: min over c of
  max(verify(N - c), packed(c)). It ignores the memory bandwidth the two share, so it is a bound from below;
- latency-bound (a GPU, two streams): max(verify, packed), each pass leaving most of the chip idle, with the
  passes' times from `scripts/gpu_check.py --json` (its verify_ms, packed_draft_ms and, where it timed the
  levers, the synchronous draft).

Predicted decode tokens per second = tau / round seconds, and d3d-async's speed-up over d3d = sync round / async
round. scripts/async_replay.py measures the passes and runs both schedules here, to check the model against them.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..decoding.async_engine import round_passes
from ..errors import D3DError

PASSES = ("verify", "draft", "packed", "pick")


def fit_threads(t1: float, tn: float, n: int) -> tuple[float, float]:
    """(serial, parallel) seconds of t(c) = serial + parallel / c through t(1) = t1 and t(n) = tn (Amdahl), both
    kept >= 0: a pass that ran no faster on n threads is all serial, one more than n times faster all parallel."""
    if n < 2:
        raise D3DError(f"fitting a pass's thread scaling needs timings on 1 and n >= 2 threads (got n = {n})")
    parallel = min(t1, max(0.0, (t1 - tn) * n / (n - 1)))
    return t1 - parallel, parallel


def on_cores(costs: dict[str, dict[int, float]], name: str, cores: int) -> float:
    """Seconds of pass `name` on `cores` cores: as timed, or from fit_threads on its timings on one thread and
    on the most threads timed."""
    by_threads = costs[name]
    if cores in by_threads:
        return by_threads[cores]
    most = max(by_threads)
    if 1 not in by_threads or most < 2:
        raise D3DError(f"pass {name} needs timings on 1 and >= 2 threads to be priced on {cores} cores")
    serial, parallel = fit_threads(by_threads[1], by_threads[most], most)
    return serial + parallel / cores


def together_cpu(costs: dict[str, dict[int, float]], cores: int) -> tuple[float, int]:
    """(seconds, drafter cores) of verify and the packed pass at once on `cores` cores split between them, at
    the best split."""
    if cores < 2:
        raise D3DError(f"running the target and the drafter side by side needs >= 2 cores (got {cores})")
    return min((max(on_cores(costs, "verify", cores - c), on_cores(costs, "packed", c)), c) for c in range(1, cores))


def rounds(sync_s: dict[str, float], together_s: float, hit_rate: float,
           async_s: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds of a round of each schedule (see the module doc): `sync_s`, the passes' seconds (verify, draft)
    on all of the cores, as `d3d` runs them; `together_s`; `async_s`, pick and draft on the cores the
    asynchronous schedule leaves the loop (on one CPU half of them; default: as sync_s)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise D3DError(f"a hit rate is in [0, 1] (got {hit_rate})")
    loop = async_s or sync_s
    return {"sync": sync_s["draft"] + sync_s["verify"],
            "async": together_s + loop["pick"] + (1.0 - hit_rate) * loop["draft"]}


def predict(tau: float, hit_rate: float, sync_s: dict[str, float], together_s: float,
            async_s: dict[str, float] | None = None) -> dict[str, float]:
    """Decode tokens per second of `d3d` and `d3d-async` and the latter's speed-up, for a run of mean
    acceptance length `tau` and packed hit rate `hit_rate`, with the round costs of `rounds`."""
    r = rounds(sync_s, together_s, hit_rate, async_s)
    return {"d3d_tok_s": tau / r["sync"], "d3d_async_tok_s": tau / r["async"], "async_speedup": r["sync"] / r["async"],
            "sync_round_s": r["sync"], "async_round_s": r["async"]}


def cpu_prediction(costs: dict[str, dict[int, float]], cores: int, tau: float, hit_rate: float) -> dict:
    """predict on a CPU of `cores` cores (passes priced by on_cores): d3d on all of them; d3d-async with the
    target and the drafter on disjoint cores at the best split, the drafter's side picking and, on a miss,
    drafting."""
    together, c = together_cpu(costs, cores)
    sync_s = {name: on_cores(costs, name, cores) for name in PASSES}
    async_s = {name: on_cores(costs, name, c) for name in PASSES}
    return predict(tau, hit_rate, sync_s, together, async_s) | {"cores": cores, "drafter_cores": c}


def gpu_profile(path: str | Path) -> dict:
    """A latency-bound device's passes from `scripts/gpu_check.py --json` output: verify, packed, both (as
    measured there), draft (its levers' synchronous draft when timed, else the packed pass: a latency-bound
    pass costs about the same at any width) and pick (0: the LM head on one block, small beside the passes)."""
    try:
        rows = json.loads(Path(path).read_text())
        verify, packed = rows["verify_ms"] / 1000, rows["packed_draft_ms"] / 1000
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise D3DError(f"{path}: not a scripts/gpu_check.py --json file ({e})") from None
    levers = rows.get("levers_ms") or {}
    draft = next((v for k, v in levers.items() if k.startswith("sync draft")), None)
    return {"name": f"{rows.get('gpu') or rows.get('device')} ({rows.get('shape')})",
            "sync_s": {"verify": verify, "draft": (draft / 1000) if draft is not None else packed, "pick": 0.0},
            "together_s": max(verify, packed), "measured_both_s": rows.get("both_ms", 0) / 1000 or None}


@torch.no_grad()
def measure_passes(model, drafter, threads: list[int], context: int = 256, repeats: int = 5) -> tuple[dict, float]:
    """({pass: {threads: seconds}}, seconds of verify and the packed pass at once with half of the threads
    each): the fastest of `repeats`, passes and thread counts taking turns, every cache rolled back after."""
    passes = round_passes(model, drafter, context, drafter.block_size)
    slots = torch.zeros(drafter.block_size, drafter.args.dim, device=drafter.draft_ids.device,
                        dtype=drafter.output.weight.dtype)

    def pick() -> None:
        drafter.head(slots[1:])

    def timed(fn, *args) -> float:
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0

    costs = {name: {n: [] for n in threads} for name in PASSES}
    both: list[float] = []
    start = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(1) as pool:
            for turn in range(repeats + 1):  # the first turn warms up, untimed
                for n in threads:
                    torch.set_num_threads(n)
                    got = {"verify": timed(passes.verify), "draft": timed(passes.draft, turn),
                           "packed": timed(passes.packed), "pick": timed(pick)}
                    if turn:
                        for name, s in got.items():
                            costs[name][n].append(s)
                torch.set_num_threads(max(1, max(threads) // 2))
                t0 = time.perf_counter()
                fut = pool.submit(passes.packed)
                passes.verify()
                fut.result()
                if turn:
                    both.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(start)
    return {name: {n: min(v) for n, v in by.items()} for name, by in costs.items()}, min(both)
