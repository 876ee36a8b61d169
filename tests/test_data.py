"""Distillation data (`d3d data`): the stored responses are the target's own greedy output, a killed or
extended run resumes without touching finished shards, and a folder keeps one prompt set."""
from __future__ import annotations

import pytest

from d3d.corpus.code_prompts import code_mix, python_version
from d3d.corpus.data import build_dataset, load_dataset
from d3d.decoding.engine import generate
from d3d.errors import D3DError
from d3d.corpus.prompts import chat_mix, encode_prompt, prompt_hash

MAX_NEW = 6


@pytest.mark.parametrize("prompt_set", ["code", "chat"])
def test_data_is_the_targets_greedy_output_and_resumes(tmp_path, smol, prompt_set):
    model, tok, _ = smol
    out = tmp_path / prompt_set

    def build(max_tokens: int, prompts: str = prompt_set) -> dict:
        return build_dataset(model, tok, out, "SmolLM2-135M-Instruct", max_tokens, MAX_NEW, batch_size=2,
                             shard_size=3, prompts=prompts)

    first = build(1)
    assert first["settings"]["prompts"] == prompt_set
    assert first["settings"].get("python") == (python_version() if prompt_set == "code" else None)
    mix = {"code": code_mix, "chat": chat_mix}[prompt_set]
    assert len(first["shards"]) == 1 and mix.__name__ in first["sources"]
    examples = load_dataset(out)
    first_prompts = {prompt_hash(p): p for _, _, p in mix()[:3]}
    assert sorted(e.hash for e in examples) == sorted(first_prompts)
    for e in examples:
        assert e.prompt_ids == encode_prompt(tok, first_prompts[e.hash])
        assert e.response_ids == generate(model, tok, e.prompt_ids, max_new_tokens=MAX_NEW).token_ids
    assert first["response_tokens"] == sum(len(e.response_ids) for e in examples) > 0

    second = build(first["response_tokens"] + 1)  # resumes at shard 1; shard 0 is left as it was
    assert len(second["shards"]) == 2 and load_dataset(out, 1) == examples
    with pytest.raises(D3DError, match="built with other settings"):
        build(10**6, prompts="mix")
    with pytest.raises(D3DError, match="built with other settings"):  # a folder keeps one precision too
        build_dataset(model, tok, out, "SmolLM2-135M-Instruct", 10**6, MAX_NEW, shard_size=3, prompts=prompt_set,
                      quantize="int4")
    with pytest.raises(D3DError, match="unknown prompt set 'prose'"):
        build_dataset(model, tok, tmp_path / "other", "SmolLM2-135M-Instruct", 1, prompts="prose")
