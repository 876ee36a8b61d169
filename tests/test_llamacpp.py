"""The llama.cpp reference runs on the same weights as our runtime, and fails clearly when missing."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from d3d.errors import D3DError
from d3d.methods.llamacpp import LlamaCppRunner, gguf_whole, reference_gguf
from helpers import check_raising_after, needs_llama_cpp, sliced_prompt


@pytest.fixture(scope="module")
def f32_gguf(smol, tmp_path_factory):
    """The target's GGUF rewritten as F32, made in a fresh cache folder."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("D3D_CACHE", str(tmp_path_factory.mktemp("cache")))
        return reference_gguf(smol[2], "f32")


def test_f32_gguf_holds_exactly_our_fp32_weights(smol, f32_gguf):
    from gguf import GGUFReader

    model = smol[0]
    reader = GGUFReader(f32_gguf)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert all(t.tensor_type == 0 for t in reader.tensors)  # F32 everywhere
    assert np.array_equal(tensors["token_embd.weight"], model.tok_embeddings.weight.numpy())
    assert np.array_equal(tensors["blk.0.ffn_down.weight"], model.layers[0].feed_forward.w2.weight.numpy())
    assert np.array_equal(tensors["output_norm.weight"], model.norm.weight.numpy())


def test_a_damaged_reference_gguf_is_made_again(smol, f32_gguf, monkeypatch):
    """A truncated cached conversion does not read whole and is converted again at the next use."""
    monkeypatch.setenv("D3D_CACHE", str(f32_gguf.parent.parent))
    assert gguf_whole(f32_gguf) and reference_gguf(smol[2], "f32") == f32_gguf
    whole = f32_gguf.stat().st_size
    with open(f32_gguf, "r+b") as f:
        f.truncate(whole // 2)
    assert not gguf_whole(f32_gguf)
    assert reference_gguf(smol[2], "f32") == f32_gguf and f32_gguf.stat().st_size == whole
    assert gguf_whole(f32_gguf)


def test_unknown_weight_type_and_missing_package_are_clear_errors(smol, monkeypatch):
    with pytest.raises(D3DError, match="must be one of f32, q8_0"):
        reference_gguf(smol[2], "q2_k")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(D3DError, match=r"pip install -e \"\.\[llamacpp\]\""):
        LlamaCppRunner(smol[2] / "x.gguf", smol[1], threads=1)


@needs_llama_cpp
def test_llama_cpp_generates_with_our_result_fields(smol, f32_gguf, short_answer_ids):
    runner = LlamaCppRunner(f32_gguf, smol[1], threads=torch.get_num_threads())
    res = runner(short_answer_ids, max_new_tokens=8)
    assert 1 <= res.new_tokens <= 8 and res.rounds == res.new_tokens - 1 and res.tau == 1.0
    assert res.finish_reason in ("eos", "length") and res.text


@needs_llama_cpp
def test_llama_cpp_lookup_drafts_and_counts_its_rounds(smol, f32_gguf, prompt_ids):
    """`llama-cpp-lookup`: llama-cpp-python's prompt-lookup drafting on the same F32 file; its rounds are
    llama.cpp's forwards, several tokens in some. llama.cpp verifies drafts in batches whose sums are not its
    one-token forward's, so its greedy text can leave plain llama.cpp's on a near tie (the bench's lossless
    column shows where), so only the drafting is checked here."""
    from d3d.methods.llamacpp import LOOKUP_TOKENS

    threads = torch.get_num_threads()
    plain = LlamaCppRunner(f32_gguf, smol[1], threads=threads)(prompt_ids[0], max_new_tokens=48)
    lookup = LlamaCppRunner(f32_gguf, smol[1], threads=threads, lookup=LOOKUP_TOKENS)
    res = lookup(prompt_ids[0], max_new_tokens=48)
    assert set(plain.acceptance_lengths) == {1}
    assert sum(res.acceptance_lengths) == res.new_tokens - 1 and max(res.acceptance_lengths) >= 3
    assert res.rounds < plain.rounds
    long = (prompt_ids[0] * 8)[:600]  # past llama.cpp's 512-token batch: llama-cpp-python's logits array must hold it
    assert 1 <= lookup(long, max_new_tokens=8).new_tokens <= 8


@needs_llama_cpp
def test_llama_cpp_source_runs_the_gguf_file_the_target_came_from(smol, short_answer_ids):
    """`llama-cpp-source` loads the target's source GGUF as it is (no rewrite in the cache), and refuses
    --quantize like the other methods on a runtime of their own."""
    from d3d.methods.catalog import check_quantize, make_runner
    from d3d.methods.llamacpp import source_gguf

    runner = make_runner("llama-cpp-source", smol[0], smol[1], smol[2])
    assert runner.fn.gguf_path == source_gguf(smol[2])
    assert "AVX" in runner.settings["llama_cpp_build"] or "NEON" in runner.settings["llama_cpp_build"]  # what it was built for
    res = runner(short_answer_ids, max_new_tokens=4)
    assert 1 <= res.new_tokens <= 4 and res.tau == 1.0
    with pytest.raises(D3DError, match="^llama-cpp-source runs llama.cpp on the target's source GGUF"):
        check_quantize("int8", ["llama-cpp-source"])


@needs_llama_cpp
def test_llama_cpp_prompt_in_checked_slices(smol, f32_gguf, prompt_ids):
    """With prefill_check (d3d serve), llama.cpp evaluates the prompt in PREFILL_CHUNK-token slices with the
    check before each and generate() finds them cached: the same answer; a check that raises stops it and
    the next call starts clean."""
    from d3d.decoding.engine import PREFILL_CHUNK

    runner = LlamaCppRunner(f32_gguf, smol[1], threads=torch.get_num_threads())
    ids = sliced_prompt(prompt_ids[0], PREFILL_CHUNK)
    plain = runner(ids, max_new_tokens=6)
    calls, evals, inner = [], [], runner.llm.eval
    runner.llm.eval = lambda tokens: (evals.append(len(tokens)), inner(tokens))[1]
    sliced = runner(ids, max_new_tokens=6, prefill_check=lambda: calls.append(1))
    assert len(calls) == 3 + 1 and sliced.token_ids == plain.token_ids
    assert evals[:4] == [PREFILL_CHUNK, PREFILL_CHUNK, 9, 1]  # generate() evaluated only the last token
    with pytest.raises(TimeoutError):
        runner(ids, max_new_tokens=6, prefill_check=check_raising_after(1, []))
    assert runner(ids, max_new_tokens=6).token_ids == plain.token_ids
