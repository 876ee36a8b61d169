"""Do the runtimes keep the outputs? Teacher-forced on the committed plain-decoding answers.

For every first-turn prompt of results/bench_full_t0_cpu.json (plain decoding's greedy answers, 256
tokens, made by an earlier eager runtime), each runtime is fed the prompt and then the committed answer,
and its greedy choice at every position is compared with the committed next token, one token at a time
(the decoding step) and the whole answer in one forward (after two tokens). Runtimes: `pytorch` (the
layers as PyTorch modules, the runtime that made the answers), `cpu` (the default: one C++ call per
layer, d3d.runtime.kernels), `compiled` (`--compile`: two inductor graphs). Slow (about 5 minutes per runtime at
one thread), hence a script and not a test.

    python scripts/compiled_outputs_check.py --threads 1 --out results/compiled_outputs_cpu.json
    python scripts/compiled_outputs_check.py --runtimes pytorch,cpu --threads 2 --out results/cpu_layers_outputs_cpu.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from d3d.bench.harness import machine_info
from d3d.atomic import atomic_write_json
from d3d.runtime.loading import load_target
from d3d.corpus.prompts import MultiTurn, benchmark_prompts, encode_prompt

REPORT = Path(__file__).parents[1] / "results" / "bench_full_t0_cpu.json"


def committed_answers(tok) -> list[tuple[str, int, list[int], list[int]]]:
    """(benchmark, prompt index, prompt ids, committed answer ids) of every first-turn ar row."""
    report = json.loads(REPORT.read_text())
    rows = [r for r in report["per_prompt"] if r["method"] == "ar" and r.get("turn", 1) == 1]
    out = []
    for benchmark in report["settings"]["benchmarks"]:
        mine = [r for r in rows if r["benchmark"] == benchmark]
        items = benchmark_prompts(benchmark, max(r.get("item", r["prompt_index"]) for r in mine) + 1)
        for row in mine:
            item = items[row.get("item", row["prompt_index"])]
            text = item.turns[0] if isinstance(item, MultiTurn) else item
            out.append((benchmark, row["prompt_index"], encode_prompt(tok, text), row["token_ids"]))
    return out


@torch.no_grad()
def stepwise(model, prompt: list[int], answer: list[int]) -> list[int]:
    """Greedy choices after the prompt and after each answer token, fed one token at a time."""
    model.setup_cache(1, len(prompt) + len(answer) + 1)
    choices = [int(model(torch.tensor([prompt]), last_only=True)[0, -1].argmax())]
    for token in answer[:-1]:
        choices.append(int(model(torch.tensor([[token]]), last_only=True)[0, -1].argmax()))
    return choices


@torch.no_grad()
def whole(model, prompt: list[int], answer: list[int]) -> list[int]:
    """Greedy choices at the same positions from one forward over prompt + answer (after 2 tokens)."""
    seq = prompt + answer[:-1]
    model.setup_cache(1, len(seq) + 1)
    model(torch.tensor([seq[:2]]))
    return model(torch.tensor([seq[2:]]))[0, len(prompt) - 3:].argmax(-1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="check only the first N prompts")
    ap.add_argument("--runtimes", default="pytorch,compiled", help="comma-separated: pytorch, cpu, compiled")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runtimes, compile_s = {}, None
    for name in args.runtimes.split(","):
        t0 = time.perf_counter()
        runtimes[name], tok, _ = load_target(None, compile=name == "compiled")
        if name == "compiled":
            compile_s = round(time.perf_counter() - t0, 1)
        elif name == "pytorch":
            runtimes[name].drop_cpu_layers()
        elif name != "cpu":
            raise SystemExit(f"unknown runtime {name!r}")
    rows = []
    for benchmark, index, prompt, answer in committed_answers(tok)[:args.limit]:
        row = {"benchmark": benchmark, "prompt_index": index, "positions": len(answer)}
        for name, model in runtimes.items():
            for how, fn in (("stepwise", stepwise), ("whole", whole)):
                row[f"{name}_{how}_mismatches"] = sum(a != b for a, b in zip(fn(model, prompt, answer), answer))
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k.endswith("_mismatches")]
    summary = {k: sum(r[k] for r in rows) for k in keys}
    summary["positions"] = sum(r["positions"] for r in rows)
    summary["prompts"] = len(rows)
    command = f"python scripts/compiled_outputs_check.py --runtimes {args.runtimes} --threads {args.threads} --out {args.out}"
    atomic_write_json(Path(args.out), {"machine": machine_info("cpu"), "command": command, "compile_s": compile_s,
                                       "summary": summary, "per_prompt": rows})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
