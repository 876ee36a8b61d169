"""Plain greedy decoding: our runtime vs transformers' `generate` on the same prompts, one interleaved run.

    python scripts/runtime_vs_hf.py --prompts 5 --max-new-tokens 128 --out results/runtime_vs_hf.json
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from d3d.bench import machine_info
from d3d.data import atomic_write_json
from d3d.engine import generate
from d3d.prompts import benchmark_prompts
from d3d.target import encode_prompt, load_target


def hf_decode(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """transformers' greedy generate; decode time = total - the time of a 1-token generate (its prefill)."""
    x = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, do_sample=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0 - prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, model_dir = load_target(None)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    prompts = [encode_prompt(tok, p) for p in benchmark_prompts("gsm8k", args.prompts)]
    generate(model, tok, prompts[0], max_new_tokens=8)
    hf_decode(hf, prompts[0], 8)
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            ours = generate(model, tok, ids, max_new_tokens=args.max_new_tokens)
            hf_ids, hf_s = hf_decode(hf, ids, args.max_new_tokens)
            ours_tps = (ours.new_tokens - 1) / ours.decode_s
            hf_tps = (len(hf_ids) - 1) / hf_s
            rows.append({"prompt_index": i, "new_tokens": ours.new_tokens, "ours_tokens_per_s": round(ours_tps, 2),
                         "hf_tokens_per_s": round(hf_tps, 2), "ratio": round(ours_tps / hf_tps, 3),
                         "same_tokens": ours.token_ids == hf_ids})
            print(rows[-1], file=sys.stderr)
    report = {"machine": machine_info("cpu"), "command": "python " + shlex.join(sys.argv),
              "median_ratio_ours_over_hf": statistics.median(r["ratio"] for r in rows),
              "median_ours_tokens_per_s": statistics.median(r["ours_tokens_per_s"] for r in rows),
              "median_hf_tokens_per_s": statistics.median(r["hf_tokens_per_s"] for r in rows), "per_prompt": rows}
    atomic_write_json(args.out, report)
    print({k: v for k, v in report.items() if k.startswith("median")})


if __name__ == "__main__":
    main()
