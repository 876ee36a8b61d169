"""Prompts: the benchmark test sets and the distillation training prompts (their files: d3d.corpus.sources),
kept apart by prompt hashes, and the one encoding of a prompt or chat into token ids (encode_prompt).
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import lru_cache

from ..errors import D3DError
from .sources import data_file, read_jsonl, sharegpt_first_turns

BENCHMARKS = ("gsm8k", "math500", "humaneval", "mt-bench", "sharegpt")
# Workloads where history matters, run by name only (`d3d bench --benchmarks history`), not by default
WORKLOADS = ("history",)
ALIASES = {"mtbench": "mt-bench"}
# The code edits of the history workload: each restates the whole function answered in the turn before
CODE_EDITS = ("Add type hints to this function's parameters and return value. Show the whole function.",
              "Rename the variables in this function to more descriptive names. Show the whole function.",
              "Add a short comment above each step of this function. Show the whole function.")
TRAIN_SOURCES = ("gsm8k-train", "math-train", "sharegpt")
# The benchmarks whose prompts are banned from training (benchmark_prompt_hashes): fixed, because the
# committed distillation dataset was filtered with exactly this set (ShareGPT's held-out slice is kept
# apart by position instead, see sharegpt_heldout).
_BANNED_SOURCES = ("gsm8k", "math500", "humaneval", "mtbench")
SHAREGPT_HELDOUT_POOL = 400  # the last positions of training_mix's seeded ShareGPT shuffle
SHAREGPT_MAX_CHARS = 2000


@dataclass(frozen=True)
class MultiTurn:
    """A benchmark item of several user turns (MT-Bench). The harness measures every turn; turn k > 1 is
    asked in a chat that holds the earlier turns and the target's own greedy answers to them."""

    turns: tuple[str, ...]


BenchItem = str | MultiTurn


def first_turn(item: BenchItem) -> str:
    """The first user message of a benchmark item."""
    return item.turns[0] if isinstance(item, MultiTurn) else item


def encode_prompt(tokenizer, prompt: str | list[dict], raw: bool = False, sep: str = "\n\n") -> list[int]:
    """Token ids of a user message (a string) or a chat ({role, content} messages), through the
    tokenizer's chat template and ending with the generation prompt. Raw, or without a chat template:
    the plain text, a chat's contents joined by `sep` (the API and the server join with "\\n")."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(sep.join(m["content"] for m in messages), add_special_tokens=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def canonical_benchmark(name: str) -> str:
    """The benchmark's name (aliases resolved; a benchmark or a workload), or a clear error."""
    name = ALIASES.get(name, name)
    if name not in BENCHMARKS + WORKLOADS:
        raise D3DError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS + WORKLOADS)}")
    return name


def _single_turn_prompts(name: str) -> list[str]:
    """The user messages of one benchmark as banned from training (MT-Bench: its first turns only)."""
    key = "mtbench" if name in ("mtbench", "mt-bench") else name
    rows = read_jsonl(data_file(key))
    if name == "gsm8k":
        return [r["question"] for r in rows]
    if name == "math500":
        return [r["problem"] for r in rows]
    if name == "humaneval":
        return [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows]
    return [r["turns"][0] for r in rows]


def benchmark_prompts(name: str, limit: int | None = None) -> list[BenchItem]:
    """Test items of one benchmark, in order: user messages (str), or MultiTurn items for MT-Bench.

    gsm8k: the question; math500: the problem; humaneval: "Complete the following Python function."
    and the function stub in a ```python block; mt-bench: both turns of each question (MultiTurn);
    sharegpt: first human turns of the held-out slice (sharegpt_heldout); history: chats and code edits as
    one stream (history_items). `limit` counts items.
    """
    name = canonical_benchmark(name)
    if name == "history":
        items: list[BenchItem] = history_items()
    elif name == "mt-bench":
        items = [MultiTurn(tuple(r["turns"])) for r in read_jsonl(data_file("mtbench"))]
    elif name == "sharegpt":
        items = [p for _, p in sharegpt_heldout()]
    else:
        items = list(_single_turn_prompts(name))
    return items[:limit] if limit else items


def history_items() -> list[MultiTurn]:
    """The `history` workload, one stream where earlier turns and earlier answers matter: MT-Bench chats
    (both turns, the second asked after the target's own first answer) alternating with code edits over
    HumanEval (complete the function, then two of CODE_EDITS in turn, each asked with the earlier answers in
    the chat, so the target restates code it wrote), then the remaining HumanEval edits; 80 + 164 items.
    The bench runs a benchmark's items in order, and methods that learn keep what they learned from one
    item to the next (and forget it at the next benchmark)."""
    chats = [MultiTurn(tuple(r["turns"])) for r in read_jsonl(data_file("mtbench"))]
    code = [MultiTurn((p, CODE_EDITS[i % len(CODE_EDITS)], CODE_EDITS[(i + 1) % len(CODE_EDITS)]))
            for i, p in enumerate(_single_turn_prompts("humaneval"))]
    mixed = [item for pair in zip(chats, code) for item in pair]
    return mixed + chats[len(code):] + code[len(chats):]


def train_prompts(name: str) -> list[str]:
    if name == "gsm8k-train":
        return [r["question"] for r in read_jsonl(data_file(name))]
    if name == "math-train":
        return [r["problem"] for r in read_jsonl(data_file(name))]
    if name == "sharegpt":
        return sharegpt_first_turns(data_file(name))
    raise D3DError(f"unknown training source {name!r}; choose from {', '.join(TRAIN_SOURCES)}")


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def prompt_hash(text: str) -> str:
    return hashlib.sha1(normalize(text).encode()).hexdigest()[:16]


def benchmark_prompt_hashes() -> set[str]:
    """Hashes of every benchmark test prompt (MATH's whole test split included, MATH-500 is drawn from it)."""
    hashes = {prompt_hash(p) for b in _BANNED_SOURCES for p in _single_turn_prompts(b)}
    hashes |= {prompt_hash(r["problem"]) for r in read_jsonl(data_file("math-test"))}
    return hashes


def training_mix(seed: int = 0, sharegpt_max: int = 12000) -> list[tuple[str, int, str]]:
    """(source, index in source, prompt) for distillation, interleaved so that every prefix is a mix.

    Prompts equal (after normalisation) to any benchmark test prompt, and duplicates, are dropped.
    """
    banned, seen = benchmark_prompt_hashes(), set()
    per_source = []
    for src in TRAIN_SOURCES:
        items = [(src, i, p) for i, p in enumerate(train_prompts(src))]
        random.Random(seed).shuffle(items)
        if src == "sharegpt":
            items = items[:sharegpt_max]
        per_source.append(items)
    mix = []
    for group in zip(*per_source):
        for src, i, p in group:
            h = prompt_hash(p)
            if h not in banned and h not in seen:
                seen.add(h)
                mix.append((src, i, p))
    return mix


def _sharegpt_shuffled(seed: int = 0) -> list[tuple[str, int, str]]:
    """ShareGPT's (source, index, prompt) in the seeded order training_mix draws its prefix from."""
    items = [("sharegpt", i, p) for i, p in enumerate(train_prompts("sharegpt"))]
    random.Random(seed).shuffle(items)
    return items


@lru_cache(maxsize=2)
def _sharegpt_heldout_cached(seed: int, pool: int, max_chars: int) -> tuple[tuple[int, str], ...]:
    mix = training_mix(seed)
    used_idx = {i for src, i, _ in mix if src == "sharegpt"}
    used_hashes = {prompt_hash(p) for _, _, p in mix}
    shuffled = _sharegpt_shuffled(seed)
    # training_mix zips its sources, so it reaches only the first min(len of each source, sharegpt_max)
    # positions of this order; the pool must lie entirely beyond every position it used.
    reach = max((k + 1 for k, (_, i, _) in enumerate(shuffled) if i in used_idx), default=0)
    start = len(shuffled) - pool
    if start < reach:
        raise D3DError(f"ShareGPT held-out pool ({pool}) overlaps the training positions (< {reach})")
    seen, out = set(), []
    for _, i, p in shuffled[start:]:
        h = prompt_hash(p)
        if 12 <= len(p) <= max_chars and i not in used_idx and h not in used_hashes and h not in seen:
            seen.add(h)
            out.append((i, p))
    return tuple(out)


def sharegpt_heldout(seed: int = 0, pool: int = SHAREGPT_HELDOUT_POOL,
                     max_chars: int = SHAREGPT_MAX_CHARS) -> list[tuple[int, str]]:
    """(index in ShareGPT, first human turn) of the held-out benchmark slice: the last `pool` positions
    of the seeded shuffle that training_mix(seed) takes its ShareGPT prefix from, keeping prompts of 12 to
    `max_chars` characters, none equal (after normalisation) to any training prompt or to each other.
    Raises if the pool reaches into positions training used."""
    return list(_sharegpt_heldout_cached(seed, pool, max_chars))


def chat_mix(seed: int = 0) -> list[tuple[str, int, str]]:
    """(source, index in ShareGPT, prompt) for `d3d data --prompts chat`: ShareGPT first turns that no
    other prompt set uses. They come from the positions of training_mix's seeded shuffle that it never
    reaches (it zips its sources and stops at the shortest) and before the held-out pool, and do not
    mention code (code_mix takes those); prompts equal (after normalisation) to a benchmark, training_mix
    or held-out prompt, or to an earlier one, are dropped. Chat is where the drafter is weakest, and the
    main mix gives it only a third of its examples."""
    train = training_mix(seed)
    seen, out = taken_prompt_hashes(train, seed), []
    for i, p in unused_sharegpt(train, seed):
        h = prompt_hash(p)
        if not _CODE_HINT.search(p) and h not in seen:
            seen.add(h)
            out.append(("sharegpt-chat", i, p))
    return out


def unused_sharegpt(mix: list[tuple[str, int, str]], seed: int = 0) -> list[tuple[int, str]]:
    """(index in ShareGPT, first human turn) of 12 to SHAREGPT_MAX_CHARS characters at the positions of the
    seeded shuffle that `mix` (training_mix(seed)) never uses, before the held-out pool: what the extra
    prompt sets (code_mix, chat_mix) draw from."""
    used_idx = {i for src, i, _ in mix if src == "sharegpt"}
    shuffled = _sharegpt_shuffled(seed)
    return [(i, p) for _, i, p in shuffled[:len(shuffled) - SHAREGPT_HELDOUT_POOL]
            if i not in used_idx and 12 <= len(p) <= SHAREGPT_MAX_CHARS]


def taken_prompt_hashes(mix: list[tuple[str, int, str]], seed: int = 0) -> set[str]:
    """Hashes an extra prompt set must avoid: every benchmark prompt, every prompt of `mix`
    (training_mix(seed)) and of the ShareGPT held-out slice (ShareGPT repeats prompts at other positions)."""
    return benchmark_prompt_hashes() | {prompt_hash(p) for _, _, p in mix} \
        | {prompt_hash(p) for _, p in sharegpt_heldout(seed)}


CALIBRATION_SETS = ("math", "code", "chat")
_CODE_HINT = re.compile(r"\b(python|javascript|typescript|java|c\+\+|sql|html|css|code|function|script|regex|"
                        r"class|api|bash|react|golang|rust|program|application|app)\b|c#|```|def |#include",
                        re.IGNORECASE)


def calibration_prompts(kind: str, n: int) -> list[str]:
    """Prompts for measuring a drafter (layer pruning) that are neither benchmark test prompts nor training
    data: taken from the *end* of training_mix, which `d3d data` consumes from the front (even a 5M-token
    dataset uses fewer than a third of its 22k prompts). math: GSM8K/MATH train questions, alternating;
    code: ShareGPT requests that mention code; chat: the other ShareGPT requests."""
    if kind not in CALIBRATION_SETS:
        raise D3DError(f"unknown calibration set {kind!r}; choose from {', '.join(CALIBRATION_SETS)}")
    out = []
    for src, _, p in reversed(training_mix()):
        if len(out) == n:
            break
        if not 12 <= len(p) <= SHAREGPT_MAX_CHARS:
            continue
        if kind == "math" and src in ("gsm8k-train", "math-train"):
            out.append(p)
        elif kind != "math" and src == "sharegpt" and bool(_CODE_HINT.search(p)) == (kind == "code"):
            out.append(p)
    return out
