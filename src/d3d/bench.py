"""Benchmark harness: every method on every prompt, timed against plain decoding.

Methods are interleaved per prompt (prompt 0 with every method, then prompt 1, ...) so that slow drift
of the machine (thermal, other jobs) hits all methods alike. Timing is decode only: the prefill, which
is identical for every method, is excluded. A method's time per output token (tpot) is its total
decode time over its total decoded tokens (each generation's first token comes from the prefill, so
a generation of n tokens counts n - 1); speedup_vs_ar = AR's tpot / the method's tpot.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from .engine import GenerationResult, validate_request
from .methods import Runner
from .target import D3DError, encode_prompt
from .verify import SamplingParams


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts of a JSONL file with one {"prompt": "..."} object per line (blank lines skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise D3DError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise D3DError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise D3DError(f'{path}:{i}: expected an object with a string "prompt"')
        if not row["prompt"].strip():
            raise D3DError(f"{path}:{i}: empty prompt")
        prompts.append(row["prompt"])
    if not prompts:
        raise D3DError(f"{path}: no prompts")
    return prompts


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict:
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": device, "python": platform.python_version()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _prompt_row(benchmark: str, method: str, index: int, r: GenerationResult, save_outputs: bool) -> dict:
    row = {"benchmark": benchmark, "method": method, "prompt_index": index, "new_tokens": r.new_tokens,
           "rounds": r.rounds, "decode_s": round(r.decode_s, 5), "tau": round(r.tau, 4),
           "acceptance_lengths": r.acceptance_lengths, "finish_reason": r.finish_reason}
    if save_outputs:
        row["token_ids"] = r.token_ids
        row["text"] = r.text
    return row


def _tpot(results: list[GenerationResult]) -> float:
    decoded = sum(max(1, r.new_tokens - 1) for r in results)
    return sum(r.decode_s for r in results) / decoded


def _summary(benchmark: str, method: str, results: list[GenerationResult], ar: list[GenerationResult],
             greedy: bool) -> dict:
    rounds = sum(r.rounds for r in results)
    tpot, ar_tpot = _tpot(results), _tpot(ar)
    lossless = all(r.token_ids == a.token_ids for r, a in zip(results, ar)) if greedy else None
    return {"benchmark": benchmark, "method": method, "prompts": len(results),
            "tau": round(sum(sum(r.acceptance_lengths) for r in results) / max(1, rounds), 4),
            "tokens_per_s": round(1 / tpot, 3) if tpot > 0 else 0.0, "tpot_s": round(tpot, 6),
            "speedup_vs_ar": 1.0 if method == "ar" else round(ar_tpot / tpot, 4) if tpot > 0 else 0.0,
            "lossless": lossless, "new_tokens": sum(r.new_tokens for r in results)}


def run_bench(model, tokenizer, runners: dict[str, Runner], prompts: dict[str, list[str]],
              params: SamplingParams, max_new_tokens: int, raw: bool = False, save_outputs: bool = False,
              block_size: int = 16, progress: bool = True) -> dict:
    """Run every runner on every prompt of every benchmark; returns {"results": [...], "per_prompt": [...]}.

    `runners` must contain "ar" (the reference). With a seed, prompt i of a benchmark is sampled with
    seed + i for every method, so methods see the same random streams per prompt.
    """
    if "ar" not in runners:
        raise D3DError("the benchmark needs the 'ar' method as its reference")
    methods = ["ar"] + [m for m in runners if m != "ar"]
    encoded = {b: [encode_prompt(tokenizer, p, raw) for p in ps] for b, ps in prompts.items()}
    for ids_list in encoded.values():
        for ids in ids_list:
            validate_request(model, ids, max_new_tokens, block_size)

    first = next(ids for ids_list in encoded.values() for ids in ids_list)
    for m in methods:  # warm-up (allocations, lazy init), not recorded
        runners[m](first, params=params, max_new_tokens=min(max_new_tokens, 8))

    total = sum(len(v) for v in encoded.values()) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not progress)
    results, per_prompt = [], []
    for benchmark, ids_list in encoded.items():
        outs: dict[str, list[GenerationResult]] = {m: [] for m in methods}
        for i, ids in enumerate(ids_list):
            seed = None if params.seed is None else params.seed + i
            p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
            for m in methods:
                r = runners[m](ids, params=p, max_new_tokens=max_new_tokens)
                outs[m].append(r)
                per_prompt.append(_prompt_row(benchmark, m, i, r, save_outputs))
                bar.set_postfix_str(f"{benchmark} {m} tau={r.tau:.2f}")
                bar.update()
        results += [_summary(benchmark, m, outs[m], outs["ar"], params.greedy) for m in methods]
    bar.close()
    return {"results": results, "per_prompt": per_prompt}


def format_table(results: list[dict]) -> str:
    cols = [("benchmark", "{}"), ("method", "{}"), ("prompts", "{}"), ("tau", "{:.2f}"),
            ("tokens_per_s", "{:.1f}"), ("speedup_vs_ar", "{:.2f}x"), ("lossless", "{}")]
    rows = [[c for c, _ in cols]] + [[fmt.format(r[c]) for c, fmt in cols] for r in results]
    widths = [max(len(row[j]) for row in rows) for j in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)
