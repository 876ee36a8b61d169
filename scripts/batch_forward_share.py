"""How much of a batched run's wall time the batched target forward takes, per method.

`clients` generations on one Scheduler (d3d.scheduler), as `d3d serve --max-batch` runs them, take the load test's
unseen prompts (d3d.server.loadtest_throughput.throughput_prompts) one after the other; BatchedTarget.forward is
timed. Where the forward takes nearly all of the time, the lanes' Python work (proposing, verifying) is not what
bounds the batch: the rows are. Each forward's seconds are also fitted by least squares as a + b * rows over all
the run's forwards (`fit`): b is what one more row (a tree node, a prompt token) costs in the batch, to set beside
the width cost curve (one sequence, 256 cached tokens) with which the load-aware budget prices a tree's rows.
`draft_rows` counts the rows verified beyond each generation's pending token (the speculation the batch paid for).
`lane_cpu_s` is the CPU time of the generations' own threads (time.thread_time: proposing, verifying, committing;
the forward runs on the scheduler's thread), which in a batch delays every forward.

    python scripts/batch_forward_share.py --methods ar,lookup-tree --clients 8 --prompts 16 \
        --out results/batch_forward_share_smol_cpu.json
    python scripts/batch_forward_share.py --methods ar,lookup-tree --turns 4 --out results/batch_forward_fit_smol_avx512_cpu.json
    python scripts/batch_forward_share.py --target Qwen2.5-Coder-1.5B-Instruct --quantize int4 --methods ar,lookup-tree \
        --clients 8 --prompts 8 --turns 2 --out results/batch_forward_share_pair_int4_avx512_cpu.json
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
import torch

from d3d.atomic import atomic_write_json
from d3d.bench.harness import machine_info
from d3d.corpus.prompts import encode_prompt
from d3d.decoding.treecost import WidthCost, measured_curve
from d3d.decoding.verify import SamplingParams
from d3d.methods.catalog import make_runner
from d3d.runtime.loading import load_target
from d3d.scheduler import Scheduler
from d3d.server.loadtest_throughput import throughput_prompts


def run(model, tok, model_dir, method: str, prompts: list[list[int]], clients: int, max_new_tokens: int) -> dict:
    scheduler = Scheduler(model, clients)
    forward, in_forward, each, drafts = scheduler.batch.forward, [0.0], [], [0]

    def timed(segments):
        t0 = time.perf_counter()
        try:
            return forward(segments)
        finally:
            in_forward[0] += time.perf_counter() - t0
            each.append((sum(s.width for s in segments), time.perf_counter() - t0))
            drafts[0] += sum(s.width - 1 for s in segments if not s.keep)  # rows verified beyond the pending tokens

    scheduler.batch.forward = timed
    slots = [scheduler.acquire() for _ in range(clients)]
    runners = [make_runner(method, slot, tok, model_dir, learn=False) for slot in slots]
    todo, lock, tokens, lane_cpu = list(range(len(prompts))), threading.Lock(), [0], [0.0]

    def client(slot, runner) -> None:
        cpu0 = time.thread_time()
        while True:
            with lock:
                if not todo:
                    lane_cpu[0] += time.thread_time() - cpu0
                    return
                i = todo.pop(0)
            res = runner(prompts[i], params=SamplingParams(), max_new_tokens=max_new_tokens)
            scheduler.leave(slot.slot)
            with lock:
                tokens[0] += len(res.token_ids)

    forwards, rows, in_forward[0] = scheduler.forwards, scheduler.rows, 0.0
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=pair) for pair in zip(slots, runners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    scheduler.stop()
    n = scheduler.forwards - forwards
    return {"tokens_per_s": round(tokens[0] / wall, 2), "wall_s": round(wall, 2), "forwards": n,
            "rows_per_forward": round((scheduler.rows - rows) / max(1, n), 2),
            "forward_s": round(in_forward[0], 2), "forward_share": round(in_forward[0] / wall, 3),
            "ms_per_forward": round(1e3 * in_forward[0] / max(1, n), 1), "lane_cpu_s": round(lane_cpu[0], 2),
            "draft_rows": drafts[0],
            "fit": fit(each)}


def fit(forwards: list[tuple[int, float]]) -> dict:
    """Least squares seconds = a + b * rows over the forwards (rows, seconds), in ms, with the residuals' RMS."""
    rows, seconds = np.array(forwards, dtype=float).T
    X = np.stack([np.ones_like(rows), rows], 1)
    (a, b), *_ = np.linalg.lstsq(X, seconds, rcond=None)
    rms = float(np.sqrt(np.mean((X @ [a, b] - seconds) ** 2)))
    return {"ms": round(1e3 * float(a), 2), "ms_per_row": round(1e3 * float(b), 3), "rms_ms": round(1e3 * rms, 2),
            "forwards": len(forwards)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="a target name or path (default: the embedded SmolLM2)")
    ap.add_argument("--methods", default="ar,lookup-tree")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None)
    ap.add_argument("--turns", type=int, default=1,
                    help="run the methods this many times in turns, the order reversed every other turn (a method's "
                         "entry is then the list of its runs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(args.target, quantize=args.quantize)
    prompts = [encode_prompt(tok, p) for p in throughput_prompts(args.prompts)]
    cost = WidthCost(measured_curve(model))
    out = {"machine": machine_info("cpu"), "width_curve_ms": {w: round(1e3 * cost(w), 2) for w in (1, 8, 16, 32)},
           "command": "python scripts/batch_forward_share.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None), "methods": {}}
    methods = args.methods.split(",")
    for turn in range(args.turns):
        for method in methods if turn % 2 == 0 else methods[::-1]:
            result = run(model, tok, model_dir, method, prompts, args.clients, args.max_new_tokens)
            out["methods"].setdefault(method, []).append(result)
            print(method, result, flush=True)
    if args.turns == 1:
        out["methods"] = {m: runs[0] for m, runs in out["methods"].items()}
    atomic_write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
