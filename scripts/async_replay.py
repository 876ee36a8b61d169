"""Check the replay model of asynchronous D3D (d3d.bench.async_model) against runs on this machine, and price
the same rounds on other devices.

Times each pass of a round (verify, synchronous draft, packed pass, pick) on one thread and on --threads, and
verify with the packed pass at once (half of the threads each); runs `d3d` and `d3d-async` with the overlap
forced (the packed pass every round, as d3d-async does where it pays) on the same prompts, taking turns; then
compares each schedule's measured decode tokens/s with the model's, from the run's tau and hit rate, and prints
the model's d3d-async speed-up on CPUs of --cores cores and on each --gpu-check profile (scripts/gpu_check.py
--json output: passes latency-bound).

    python scripts/async_replay.py --benchmarks humaneval,mt-bench --limit 2 --out results/async_replay_smol_cpu.json
    python scripts/async_replay.py --target Qwen2.5-Coder-1.5B-Instruct --limit 1 --out results/async_replay_pair_cpu.json
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch

from d3d.atomic import atomic_write_json
from d3d.bench.async_model import cpu_prediction, gpu_profile, measure_passes, predict
from d3d.bench.harness import machine_info
from d3d.corpus.prompts import benchmark_prompts, encode_prompt, first_turn
from d3d.decoding.async_engine import generate_async
from d3d.decoding.engine import generate
from d3d.drafters.files import load_drafter
from d3d.methods.d3d import D3DProposer
from d3d.methods.registry import default_drafter
from d3d.runtime.loading import load_target


def pooled(results: list) -> dict:
    tokens = sum(r.new_tokens - 1 for r in results)
    decode_s = sum(r.decode_s for r in results)
    accepted = [a for r in results for a in r.acceptance_lengths]
    return {"decode_tok_s": tokens / decode_s, "tau": sum(accepted) / len(accepted), "rounds": len(accepted),
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--benchmarks", default="humaneval,mt-bench")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cores", default="2,4,8,16", help="CPUs to price the rounds on (cores, comma-separated)")
    ap.add_argument("--gpu-check", action="append", default=[], help="a scripts/gpu_check.py --json file")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(args.target)
    drafter = load_drafter(default_drafter(model_dir), model, tok)
    costs, both = measure_passes(model, drafter, sorted({1, args.threads}))
    print("passes (s by threads):", {k: {n: round(s, 4) for n, s in v.items()} for k, v in costs.items()},
          "both:", round(both, 4), flush=True)

    prompts = [encode_prompt(tok, first_turn(item)) for b in args.benchmarks.split(",")
               for item in benchmark_prompts(b, args.limit)]
    sync_runs, async_runs, hits, packed_rounds = [], [], 0, 0
    proposer = D3DProposer(drafter, model.args.vocab_size, max_len=model.args.max_seq_len)
    for i, ids in enumerate(prompts):
        s = generate(model, tok, ids, max_new_tokens=args.max_new_tokens, proposer=proposer,
                     block_size=drafter.block_size)
        torch.set_num_threads(max(1, args.threads // 2))  # as d3d-async runs the overlap on one CPU
        try:
            a = generate_async(model, tok, ids, max_new_tokens=args.max_new_tokens, drafter=drafter)
        finally:
            torch.set_num_threads(args.threads)
        if a.token_ids != s.token_ids:
            sys.exit(f"prompt {i}: d3d-async's tokens differ from d3d's (greedy): not lossless")
        sync_runs.append(s)
        async_runs.append(a)
        hits += a.stats["packed_hits"]
        packed_rounds += a.stats["packed_hits"] + a.stats["fallbacks"]
        print(f"prompt {i}: d3d {s.tokens_per_s:.2f} tok/s, d3d-async {a.tokens_per_s:.2f} tok/s, tau {s.tau:.2f}",
              flush=True)

    sync, overlap = pooled(sync_runs), pooled(async_runs)
    hit_rate = hits / max(1, packed_rounds)
    T, half = args.threads, max(1, args.threads // 2)
    here = predict(sync["tau"], hit_rate, {k: costs[k][T] for k in costs}, both, {k: costs[k][half] for k in costs})
    check = {"d3d": {"measured_tok_s": sync["decode_tok_s"], "model_tok_s": here["d3d_tok_s"]},
             "d3d-async": {"measured_tok_s": overlap["decode_tok_s"], "model_tok_s": here["d3d_async_tok_s"]}}
    for row in check.values():
        row["model_error"] = row["model_tok_s"] / row["measured_tok_s"] - 1
    devices = {f"cpu-{n}": cpu_prediction(costs, n, sync["tau"], hit_rate) for n in map(int, args.cores.split(","))}
    for path in args.gpu_check:
        g = gpu_profile(path)
        devices[g["name"]] = predict(sync["tau"], hit_rate, g["sync_s"], g["together_s"])
        if g["measured_both_s"]:
            devices[g["name"] + ", both as timed"] = predict(sync["tau"], hit_rate, g["sync_s"], g["measured_both_s"])

    print(f"\ntau {sync['tau']:.2f}, packed hit rate {hit_rate:.3f}, {sync['tokens']} tokens over {len(prompts)} prompts")
    print("| schedule | measured tok/s | model tok/s | model error |\n|---|---|---|---|")
    for name, row in check.items():
        print(f"| `{name}` | {row['measured_tok_s']:.2f} | {row['model_tok_s']:.2f} | {100 * row['model_error']:+.1f}% |")
    print(f"measured d3d-async / d3d: {overlap['decode_tok_s'] / sync['decode_tok_s']:.3f}; "
          f"model: {here['async_speedup']:.3f}")
    print("\n| device | d3d-async / d3d (model) | sync round ms | async round ms |\n|---|---|---|---|")
    for name, p in devices.items():
        print(f"| {name} | {p['async_speedup']:.3f} | {1000 * p['sync_round_s']:.1f} | {1000 * p['async_round_s']:.1f} |")
    if args.out:
        atomic_write_json(args.out, {
            "command": "python scripts/async_replay.py " + shlex.join(sys.argv[1:]), "machine": machine_info("cpu"),
            "target": args.target, "threads": T, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "passes_s": costs, "both_s": both, "tau": sync["tau"], "packed_hit_rate": hit_rate,
            "check": check, "model_here": here, "devices": devices})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
