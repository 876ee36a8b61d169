"""Benchmark harness: every method on every prompt, timed against plain decoding.

Methods are interleaved per prompt (prompt 0 with every method, then prompt 1, ...) so that slow drift
of the machine (thermal, other jobs) hits all methods alike. Timing is decode only: the prefill, which
is identical for every method, is excluded. A method's time per output token (tpot) is its total
decode time over its total decoded tokens (each generation's first token comes from the prefill, so
a generation of n tokens counts n - 1); speedup_vs_ar = AR's tpot / the method's tpot.

A benchmark item is a user message (str) or a MultiTurn (MT-Bench): every turn of it is a measured
prompt, and turn k > 1 is asked in a chat holding the earlier turns and the target's greedy (AR) answers
to them (at temperature 0 that is the measured AR generation itself; when sampling, an extra unrecorded
greedy AR generation).

Methods that learn from earlier generations (lookup-tree, d3d-tree and suffix, unless learning is off)
learn from their own outputs only: each runner has its own store, and the harness never feeds it another
method's (nor `ar`'s) output. The warm-up runs on WARMUP_PROMPT, which no benchmark measures, and every runner
forgets what it learned at the start of each benchmark (forget_history), so a benchmark is one stream
in order, the same whichever benchmarks ran before it (the `history` workload reuses MT-Bench and
HumanEval prompts: without it, `--benchmarks history,humaneval` would measure HumanEval on answers the
methods had already learned).

A long run resumes: every finished generation is appended to a journal (one JSON line each, flushed),
and a rerun with the same settings replays the journal instead of generating again; a replayed
generation is also fed to its own runner's `learn`, so a resumed run learns what the interrupted one
had (suffix too: its runner puts the response in its cache's global tree).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from statistics import median
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..atomic import atomic_write_bytes
from ..decoding.engine import GenerationResult, validate_request
from ..errors import D3DError
from ..runtime.kernels import runtime_info
from ..corpus.prompts import BenchItem, MultiTurn, encode_prompt
from ..methods.registry import Runner
from ..decoding.verify import SamplingParams


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts of a JSONL file with one {"prompt": "..."} object per line (blank lines skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise D3DError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise D3DError(f"prompts file {path} is not UTF-8 text (byte {e.start})") from None
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


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) of the checkout d3d runs from; None if none."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None, None
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return commit, dirty


def machine_info(device: str, quantize: str | None = None) -> dict:
    """Where a result was measured: the CPU and the kernel path it ran on (d3d.runtime.kernels.runtime_info), the
    torch build, the threads and the commit."""
    commit, dirty = git_commit()
    info = {**runtime_info(quantize is not None), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": device, "python": platform.python_version(),
            "git_commit": commit, "git_dirty": dirty}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


_BASE_KEYS = frozenset(GenerationResult([]).to_json())


@dataclass
class RecordedResult(GenerationResult):
    """A generation replayed from a bench journal: the base fields plus the method's extra statistics."""
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return super().to_json() | self.extra

    @classmethod
    def from_json(cls, d: dict) -> RecordedResult:
        return cls([], d["token_ids"], d["acceptance_lengths"], d["prefill_s"], d["decode_s"], d["finish_reason"],
                   d["text"], extra={k: v for k, v in d.items() if k not in _BASE_KEYS})


MEASURED = ("tree_width_cost_s", "round_s")  # what a method measures when it loads (cost curves): never equal twice


def _settings_only(header: dict) -> dict:
    """`header` without the MEASURED values, at any depth: what makes two runs the same run."""
    return {k: _settings_only(v) if isinstance(v, dict) else v for k, v in header.items() if k not in MEASURED}


def open_journal(path: Path, header: dict) -> tuple[dict[str, RecordedResult], object]:
    """Read the finished generations of an interrupted run from `path` (a torn last line is dropped) and
    return them with the journal opened for appending. The journal must have been written with `header`, up to
    what the methods measured when they loaded (MEASURED: a resumed tree method measures its cost curve again,
    and the report records the one of the run that finished)."""
    done: dict[str, RecordedResult] = {}
    if path.exists():
        lines = path.read_text().splitlines()
        try:
            first = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            first = None
        if not isinstance(first, dict) or _settings_only(first.get("header") or {}) != _settings_only(header):
            raise D3DError(f"{path} holds an interrupted run with other settings or prompts; "
                           f"delete it or choose another --out")
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            done[row["key"]] = RecordedResult.from_json(row["result"])
        atomic_write_bytes(path, "".join(line + "\n" for line in lines[:1 + len(done)]).encode())
    else:
        atomic_write_bytes(path, (json.dumps({"header": header}) + "\n").encode())
    return done, path.open("a")


def _prompt_row(benchmark: str, method: str, index: int, r: GenerationResult, save_outputs: bool,
                item: int | None = None, turn: int | None = None) -> dict:
    row = {"benchmark": benchmark, "method": method, "prompt_index": index, "new_tokens": r.new_tokens,
           "rounds": r.rounds, "prefill_s": round(r.prefill_s, 5), "decode_s": round(r.decode_s, 5),
           "tau": round(r.tau, 4), "acceptance_lengths": r.acceptance_lengths, "finish_reason": r.finish_reason}
    if turn is not None:
        row["item"], row["turn"] = item, turn
    # method-specific stats (d3d-async: packed_hits, fallbacks, hit_rate, mean_*_ms) pass through
    row.update({k: v for k, v in r.to_json().items() if k not in _BASE_KEYS})
    if save_outputs:
        row["token_ids"] = r.token_ids
        row["text"] = r.text
    return row


WARMUP_PROMPT = "Warm-up: reply with one short greeting."  # not a benchmark prompt: nothing measured is seen


def forget_history(runner) -> bool:
    """Make a runner forget what it learned from earlier generations through its own `forget()` (lookup-tree,
    d3d-tree and suffix with learning on); False if it has none (nothing to forget)."""
    forget = getattr(runner, "forget", None)
    if callable(forget):
        forget()
        return True
    return False


def _tpot(results: list[GenerationResult]) -> float:
    decoded = sum(max(1, r.new_tokens - 1) for r in results)
    return sum(r.decode_s for r in results) / decoded


def tau_histogram(results: list[GenerationResult], block_size: int = 16) -> list[int]:
    """Counts of rounds by acceptance length: entry k - 1 counts rounds of length k, k = 1..B, where B is
    the block size (or the longest acceptance seen, if longer)."""
    lengths = [a for r in results for a in r.acceptance_lengths]
    hist = [0] * max([block_size, *lengths])
    for a in lengths:
        hist[a - 1] += 1
    return hist


def _summary(benchmark: str, method: str, results: list[GenerationResult], ar: list[GenerationResult],
             greedy: bool, block_size: int = 16) -> dict:
    rounds = sum(r.rounds for r in results)
    tpot, ar_tpot = _tpot(results), _tpot(ar)
    lossless = all(r.token_ids == a.token_ids for r, a in zip(results, ar)) if greedy else None
    row = {"benchmark": benchmark, "method": method, "prompts": len(results),
           "tau": round(sum(sum(r.acceptance_lengths) for r in results) / max(1, rounds), 4),
           "tokens_per_s": round(1 / tpot, 3) if tpot > 0 else 0.0, "tpot_s": round(tpot, 6),
           "ttft_ms": round(1e3 * sum(r.prefill_s for r in results) / max(1, len(results)), 2),
           "speedup_vs_ar": 1.0 if method == "ar" else round(ar_tpot / tpot, 4) if tpot > 0 else 0.0,
           "lossless": lossless, "new_tokens": sum(r.new_tokens for r in results),
           "tau_histogram": tau_histogram(results, block_size)}
    stats = [r.to_json() for r in results]
    if stats and all("packed_hits" in s for s in stats):
        hits, fallbacks = sum(s["packed_hits"] for s in stats), sum(s.get("fallbacks", 0) for s in stats)
        row.update(packed_hits=hits, fallbacks=fallbacks, packed_hit_rate=round(hits / max(1, hits + fallbacks), 4))
    return row


def _turns(item: BenchItem) -> list[str]:
    return list(item.turns) if isinstance(item, MultiTurn) else [item]


def run_bench(model, tokenizer, runners: dict[str, Runner], prompts: dict[str, list[BenchItem]],
              params: SamplingParams, max_new_tokens: int, raw: bool = False, save_outputs: bool = False,
              block_size: int = 16, progress: bool = True, journal: Path | None = None,
              header: dict | None = None, repeat: int = 1) -> dict:
    """Run every runner on every prompt of every benchmark; returns {"results": [...], "per_prompt": [...],
    "resumed": number of generations replayed from `journal`}.

    `runners` must contain "ar" (the reference). Items are user messages or MultiTurn chats (each turn
    a measured prompt, see the module doc). With a seed, measured prompt i of a benchmark is sampled
    with seed + i for every method, so methods see the same random streams per prompt. With `journal`,
    finished generations are recorded there and replayed on a rerun whose `header` (settings) matches.
    With repeat = N the whole interleaved run is made N times in a row, and each result row holds the
    median of the N runs' figures (median_of_runs): one run on a shared machine can be 10% off.
    """
    if "ar" not in runners:
        raise D3DError("the benchmark needs the 'ar' method as its reference")
    if repeat < 1:
        raise D3DError(f"--repeat must be >= 1 (got {repeat})")
    methods = ["ar"] + [m for m in runners if m != "ar"]
    # every prompt must fit before anything runs; a later turn is checked with room for the earlier answers
    for items in prompts.values():
        for item in items:
            turns = _turns(item)
            for t in range(len(turns)):
                chat = [m for u in turns[:t] for m in ({"role": "user", "content": u},
                                                       {"role": "assistant", "content": ""})]
                ids = encode_prompt(tokenizer, chat + [{"role": "user", "content": turns[t]}], raw)
                validate_request(model, ids, max_new_tokens + t * (max_new_tokens + 8), block_size)

    done, log = open_journal(journal, {**(header or {}), "prompts": _fingerprint(prompts)}) \
        if journal is not None else ({}, None)
    warmup = encode_prompt(tokenizer, WARMUP_PROMPT, raw)
    for m in methods:  # warm-up (allocations, lazy init), not recorded, on a prompt no benchmark measures
        runners[m](warmup, params=params, max_new_tokens=min(max_new_tokens, 8))

    total = sum(len(_turns(item)) for items in prompts.values() for item in items) * len(methods) * repeat
    bar = tqdm(total=total, initial=len(done), desc="bench", unit="gen", disable=not progress)

    def one_benchmark(benchmark: str, items: list[BenchItem], run: int | None) -> dict[str, list[GenerationResult]]:
        """One benchmark of one run, interleaved per prompt; each generation is journalled, or replayed from
        `done`, and recorded in `per_prompt` (with its run's index when the bench repeats)."""
        for m in methods:  # a benchmark is one stream: nothing learned from the warm-up or earlier benchmarks
            forget_history(runners[m])
        outs: dict[str, list[GenerationResult]] = {m: [] for m in methods}
        i = 0  # measured prompt index within the benchmark
        for item_index, item in enumerate(items):
            turns, chat = _turns(item), []
            for t, user in enumerate(turns):
                chat.append({"role": "user", "content": user})
                ids = encode_prompt(tokenizer, chat, raw)
                validate_request(model, ids, max_new_tokens, block_size)
                seed = None if params.seed is None else params.seed + i
                p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
                multi = (item_index, t + 1) if isinstance(item, MultiTurn) else (None, None)
                for m in methods:
                    key = f"{benchmark}/{item_index}/{t}/{m}" + (f"/run{run}" if run else "")
                    r = done.get(key)
                    if r is None:
                        r = runners[m](ids, params=p, max_new_tokens=max_new_tokens)
                        if log is not None:
                            log.write(json.dumps({"key": key, "result": r.to_json()}) + "\n")
                            log.flush()
                        bar.update()
                    elif callable(getattr(runners[m], "learn", None)):  # replayed: learn it as if generated
                        runners[m].learn(ids, r.token_ids)
                    outs[m].append(r)
                    row = _prompt_row(benchmark, m, i, r, save_outputs, *multi)
                    per_prompt.append(row if run is None else row | {"run": run})
                    bar.set_postfix_str(f"{benchmark} {m} tau={r.tau:.2f}")
                if t + 1 < len(turns):  # the next turn sees the target's own greedy answer
                    answer = outs["ar"][-1] if params.greedy else \
                        runners["ar"](ids, params=SamplingParams(), max_new_tokens=max_new_tokens)
                    chat.append({"role": "assistant", "content": answer.text})
                i += 1
        return outs

    runs, per_prompt = [], []
    for run in range(repeat):
        rows = []
        for benchmark, items in prompts.items():
            outs = one_benchmark(benchmark, items, run if repeat > 1 else None)
            rows += [_summary(benchmark, m, outs[m], outs["ar"], params.greedy, block_size) for m in methods]
        runs.append(rows)
    bar.close()
    if log is not None:
        log.close()
    results = runs[0] if repeat == 1 else [median_of_runs(rows) for rows in zip(*runs)]
    return {"results": results, "per_prompt": per_prompt, "resumed": len(done)}


MEDIAN_KEYS = ("tau", "tokens_per_s", "tpot_s", "ttft_ms", "speedup_vs_ar")


def median_of_runs(rows: tuple[dict, ...]) -> dict:
    """One benchmark x method row of a repeated bench: the median of each run's tau, tokens/s, time per
    token, time to first token and speedup (each run's speedup is against that run's own `ar`), the runs'
    values listed under "runs"; lossless only if every run was; new tokens and the tau histogram add up."""
    row = dict(rows[0])
    row.update({k: round(median([r[k] for r in rows]), 6) for k in MEDIAN_KEYS})
    row["runs"] = {k: [r[k] for r in rows] for k in MEDIAN_KEYS}
    lossless = [r["lossless"] for r in rows]
    row["lossless"] = None if None in lossless else all(lossless)
    row["new_tokens"] = sum(r["new_tokens"] for r in rows)
    hists = [r["tau_histogram"] for r in rows]
    row["tau_histogram"] = [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists)))]
    return row


def _fingerprint(prompts: dict[str, list[BenchItem]]) -> dict[str, str]:
    """A short hash of each benchmark's prompt list, so a journal is replayed only for the same prompts."""
    import hashlib

    return {b: hashlib.sha256(json.dumps([_turns(item) for item in items]).encode()).hexdigest()[:16]
            for b, items in prompts.items()}


def format_table(results: list[dict]) -> str:
    cols = [("benchmark", "{}"), ("method", "{}"), ("prompts", "{}"), ("tau", "{:.2f}"),
            ("tokens_per_s", "{:.1f}"), ("speedup_vs_ar", "{:.2f}x"), ("ttft_ms", "{:.1f}"), ("lossless", "{}")]
    rows = [[c for c, _ in cols]] + [[fmt.format(r[c]) for c, fmt in cols] for r in results]
    widths = [max(len(row[j]) for row in rows) for j in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)
