"""Our Llama-family runtime on the real default target: logits match transformers', the KV cache rolls
back exactly, and explicit attention masks / positions behave like separate runs."""
from __future__ import annotations

import pytest
import torch

TOL_HF = 1e-4
TOL_SAME = 1e-5


@pytest.fixture(scope="module")
def hf_model(smol):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol[2], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sequences(prompt_ids) -> list[list[int]]:
    """Three real chat-templated prompts (GSM8K and chat) of different lengths."""
    return [prompt_ids[0], prompt_ids[1], prompt_ids[-1]]


def run(model, tokens: list[int], **kw) -> torch.Tensor:
    return model(torch.tensor([tokens]), **kw)[0]


def run_chunks(model, tokens: list[int], sizes: list[int]) -> torch.Tensor:
    """Feed `tokens` into a fresh cache in chunks of `sizes` (the rest in one last chunk); [T, V] logits."""
    model.setup_cache(1, len(tokens) + 8)
    out, pos = [], 0
    for size in sizes + [len(tokens)]:
        if pos < len(tokens):
            out.append(run(model, tokens[pos:pos + size]))
            pos += size
    assert model.cache_len == len(tokens)
    return torch.cat(out)


@torch.no_grad()
def test_logits_match_transformers_full_and_incremental(smol, hf_model, sequences):
    """Our fp32 logits are as close to the exact model (transformers in float64) as transformers' own
    fp32 logits are, within a factor of 4 (our prepacked oneDNN kernels sum in another order than
    transformers' F.linear: measured 1.6e-4 vs 0.9e-4 of logits up to ~30), and pick the same tokens."""
    import copy

    model = smol[0]
    exact = copy.deepcopy(hf_model).double()
    for tokens in sequences:
        ref = hf_model(torch.tensor([tokens])).logits[0]
        ref64 = exact(torch.tensor([tokens])).logits[0]
        tol = max(TOL_HF, 4 * (ref.double() - ref64).abs().max().item())
        model.setup_cache(1, len(tokens) + 8)
        full = run(model, tokens)
        assert full.shape == ref.shape
        assert (full.double() - ref64).abs().max() <= tol
        split = len(tokens) // 2
        incremental = run_chunks(model, tokens, [split, 1, 3, 1, 7])
        assert (incremental.double() - ref64).abs().max() <= tol
        assert torch.equal(incremental.argmax(-1), ref.argmax(-1))


@torch.no_grad()
def test_last_only_returns_the_last_row(smol, sequences):
    model, tokens = smol[0], sequences[1]
    model.setup_cache(1, len(tokens) + 8)
    full = run(model, tokens)
    model.setup_cache(1, len(tokens) + 8)
    last = run(model, tokens, last_only=True)
    assert last.shape == (1, full.shape[-1])
    assert (last[0] - full[-1]).abs().max() <= TOL_HF


@torch.no_grad()
def test_rollback_leaves_no_trace(smol, sequences):
    """Decode a draft, roll it back, decode different tokens: exactly the logits of a run that never saw the
    draft (same forward shapes, so no kernel differences are allowed either)."""
    model, prompt = smol[0], sequences[1]
    g = torch.Generator().manual_seed(0)
    rejected, new = (torch.randint(model.args.vocab_size, (n,), generator=g).tolist() for n in (7, 4))
    model.setup_cache(1, len(prompt) + 16)
    run(model, prompt)
    run(model, rejected)
    model.rollback(len(prompt))
    after_rollback = run(model, new)
    model.setup_cache(1, len(prompt) + 16)
    run(model, prompt)
    fresh = run(model, new)
    assert torch.equal(after_rollback, fresh), (after_rollback - fresh).abs().max()


@torch.no_grad()
def test_engine_style_rounds_match_fresh_run(smol, sequences):
    """Rounds as the engine runs them: feed the pending token + a draft, keep part of the draft, roll back,
    go on. The kept tokens' cache entries were computed next to rejected ones; a fresh run over the kept
    sequence must agree: bitwise on the CPU layers (d3d.runtime.kernels: every row as if alone), else up to
    PyTorch's kernel differences between chunkings, far below any real error."""
    model, prompt = smol[0], sequences[1]
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    model.setup_cache(1, len(prompt) + 64)
    run(model, prompt[:-1])
    kept = list(prompt[:-1])
    pending = prompt[-1]
    for keep in (0, 3, 5, 1):
        draft = torch.randint(vocab, (5,), generator=g).tolist()
        run(model, [pending] + draft)
        assert model.cache_len == len(kept) + 6
        model.rollback(len(kept) + 1 + keep)
        kept += [pending] + draft[:keep]
        pending = int(torch.randint(vocab, (1,), generator=g))
    assert model.cache_len == len(kept)
    new = torch.randint(vocab, (4,), generator=g).tolist()
    after_rollback = run(model, [pending] + new)

    model.setup_cache(1, len(kept) + 16)
    run(model, kept)
    chunked = run(model, [pending] + new)
    model.setup_cache(1, len(kept) + 16)
    whole = run(model, kept + [pending] + new)[len(kept):]
    for fresh in (chunked, whole):
        if model.cpu_layers is not None:
            assert torch.equal(after_rollback, fresh), (after_rollback - fresh).abs().max()
        assert (after_rollback - fresh).abs().max() <= TOL_HF
        assert torch.equal(after_rollback.argmax(-1), fresh.argmax(-1))


@torch.no_grad()
def test_rollback_to_zero_and_invalid_lengths(smol, sequences):
    model, tokens = smol[0], sequences[2]
    model.setup_cache(1, len(tokens) + 8)
    first = run(model, tokens)
    model.rollback(0)
    assert model.cache_len == 0
    again = run(model, tokens)
    assert torch.equal(first, again), (first - again).abs().max()
    for bad in (len(tokens) + 1, -1):
        with pytest.raises(ValueError):
            model.rollback(bad)
    assert model.cache_len == len(tokens)


def causal_mask(T: int, start: int) -> torch.Tensor:
    return torch.ones(T, start + T, dtype=torch.bool).tril(start)[None, None]


@torch.no_grad()
def test_explicit_causal_mask_equals_default(smol, sequences):
    model, tokens = smol[0], sequences[0]
    split = len(tokens) - 6
    model.setup_cache(1, len(tokens) + 8)
    default = torch.cat([run(model, tokens[:split]), run(model, tokens[split:])])
    model.setup_cache(1, len(tokens) + 8)
    explicit = torch.cat([run(model, tokens[:split], mask=causal_mask(split, 0)),
                          run(model, tokens[split:], mask=causal_mask(len(tokens) - split, split))])
    assert (default - explicit).abs().max() <= TOL_SAME


def block_causal_mask(lengths: list[int], start: int) -> torch.Tensor:
    """Segments packed side by side after a shared cached prefix of `start` tokens: each segment sees the
    prefix and itself causally, never another segment."""
    T = sum(lengths)
    mask = torch.zeros(T, start + T, dtype=torch.bool)
    mask[:, :start] = True
    pos = 0
    for n in lengths:
        mask[pos:pos + n, start + pos:start + pos + n] = torch.ones(n, n, dtype=torch.bool).tril()
        pos += n
    return mask[None, None]


@torch.no_grad()
def test_packed_sequences_do_not_see_each_other(smol, sequences):
    model = smol[0]
    a, b = sequences[1], sequences[2]
    model.setup_cache(1, len(a) + len(b) + 8)
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
    packed = run(model, a + b, mask=block_causal_mask([len(a), len(b)], 0), positions=positions)
    for seg, logits in ((a, packed[:len(a)]), (b, packed[len(a):])):
        model.setup_cache(1, len(seg) + 8)
        assert (logits - run(model, seg)).abs().max() <= TOL_HF


@torch.no_grad()
def test_packed_continuations_of_a_cached_prefix(smol, sequences):
    """Tree-verification style: several candidate continuations of the same cached context in one pass."""
    model, prefix = smol[0], sequences[0]
    g = torch.Generator().manual_seed(1)
    conts = [torch.randint(model.args.vocab_size, (n,), generator=g).tolist() for n in (4, 1, 6)]
    start = len(prefix)
    model.setup_cache(1, start + sum(map(len, conts)) + 8)
    run(model, prefix)
    positions = torch.cat([torch.arange(start, start + len(c)) for c in conts])
    packed = run(model, sum(conts, []), mask=block_causal_mask([len(c) for c in conts], start), positions=positions)
    pos = 0
    for c in conts:
        model.rollback(start)
        alone = run(model, c)
        assert (packed[pos:pos + len(c)] - alone).abs().max() <= TOL_HF
        pos += len(c)


def test_sliding_window_caps_the_context():
    from d3d.runtime.layers import ModelArgs

    base = dict(model_type="mistral", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=4, max_position_embeddings=32768)
    assert ModelArgs.from_hf_config(base | {"sliding_window": 4096}).max_seq_len == 4096
    assert ModelArgs.from_hf_config(base | {"sliding_window": None}).max_seq_len == 8192
    qwen2 = base | {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert ModelArgs.from_hf_config(qwen2).max_seq_len == 8192


@torch.no_grad()
def test_greedy_choices_equal_the_committed_bench_outputs(smol):
    """Runtime changes keep the outputs: fed the prompt and plain decoding's committed answer
    (results/bench_full_t0_cpu.json, 256 tokens, made by an earlier runtime), the model's greedy token
    at every position is the committed next token (first two prompts of each benchmark, first turn)."""
    import json
    from pathlib import Path

    from d3d.corpus.prompts import benchmark_prompts, encode_prompt, first_turn

    model, tok, _ = smol
    report = json.loads((Path(__file__).parents[1] / "results" / "bench_full_t0_cpu.json").read_text())
    rows = [r for r in report["per_prompt"] if r["method"] == "ar" and r.get("turn", 1) == 1]
    checked = 0
    for benchmark in report["settings"]["benchmarks"]:
        items = benchmark_prompts(benchmark, 2)
        for row in [r for r in rows if r["benchmark"] == benchmark][:2]:
            item = items[row.get("item", row["prompt_index"])]
            ids = encode_prompt(tok, first_turn(item))
            seq = ids + row["token_ids"]
            model.setup_cache(1, len(seq) + 1)
            greedy = model(torch.tensor([seq[:-1]]))[0, len(ids) - 1:].argmax(-1).tolist()
            assert greedy == row["token_ids"], (benchmark, row["prompt_index"])
            checked += 1
    assert checked == 10


@torch.no_grad()
def test_batched_generation_equals_plain_decoding(smol, sequences):
    """d3d.corpus.data's batched generation gives each prompt plain decoding's greedy answer, in cache slots on the
    C++ layers (what generate_batch runs greedy there) and padded on the PyTorch layers (left padding, masks,
    compaction of finished rows); sampled, the same seed gives the same answers."""
    from d3d.corpus.data import generate_batch, generate_in_slots, generate_padded
    from d3d.decoding.engine import generate

    model, tok, _ = smol
    eos = {tok.eos_token_id}
    solo = [generate(model, tok, s, max_new_tokens=16).token_ids for s in sequences]
    assert generate_in_slots(model, sequences, 16, eos, prefill_rows=8) == solo
    assert generate_padded(model, sequences, 16, eos) == solo
    assert generate_batch(model, sequences, 16, eos) == solo
    sampled = [generate_batch(model, sequences, 8, eos, 0.8, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert sampled[0] == sampled[1] and all(len(r) == 8 or r[-1] in eos for r in sampled[0])


def greedy_steps(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `prompt` into model's (empty) cache, then n one-token greedy steps; (tokens, each step's logits)."""
    token = int(run(model, prompt, last_only=True)[-1].argmax())
    tokens, logits = [token], []
    for _ in range(n):
        logits.append(run(model, [token], last_only=True)[-1])
        token = int(logits[-1].argmax())
        tokens.append(token)
    return tokens, logits


def test_compiled_decoding_equals_eager(smol, sequences):
    """compile_decode: the compiled one-token step gives eager's greedy tokens and logits (to fp32 summation
    order) at every position, also after the cache is asked to grow; the compiled multi-token graph gives
    eager's logits for a causal chunk and a token tree; batches and a replaced cache stay eager."""
    from d3d.errors import D3DError
    from d3d.runtime.fastpath import compile_decode
    from d3d.runtime.loading import load_runtime
    from d3d.decoding.tokentree import tree_mask, tree_positions

    def first_layers(n: int = 2):  # the real weights, fewer layers: compiling 4 layers took 27 s, 2 take 17 s
        model = load_runtime(smol[2])
        model.layers = model.layers[:n]
        return model

    eager, compiled = first_layers(), compile_decode(first_layers())
    calls = []
    step, layers = compiled.compiled_step, compiled.compiled_layers
    compiled.compiled_step = lambda *a: calls.append(("step", a[-1])) or step(*a)
    compiled.compiled_layers = lambda *a: calls.append(("layers", a[-1])) or layers(*a)
    for size, prompt in zip([1024, 2048, 2048], sequences):
        eager.setup_cache(1, size)
        compiled.setup_cache(1, size)
        want, want_logits = greedy_steps(eager, prompt, 12)
        got, got_logits = greedy_steps(compiled, prompt, 12)
        assert got == want
        assert max(float((a - b).abs().max()) for a, b in zip(want_logits, got_logits)) < TOL_HF
    assert calls == [("step", len(p) + i) for p in sequences for i in range(12)]  # every step ran compiled

    prompt, chunk = sequences[0][:-6], sequences[0][-6:]
    parents, depths = [-1, 0, 1, 0, 3, 1], [0, 1, 2, 1, 2, 2]
    for kw in ({}, {"mask": tree_mask(parents, len(prompt)), "positions": tree_positions(depths, len(prompt))}):
        out = []
        for model in (eager, compiled):
            model.setup_cache(1, 1024)
            run(model, prompt)
            out.append(run(model, chunk, **kw))
        assert float((out[0] - out[1]).abs().max()) < TOL_HF
    assert calls[-2:] == [("layers", len(prompt))] * 2

    compiled.setup_cache(2, 64)  # a new cache: the compiled graphs are bound to the old one, so eager again
    compiled(torch.tensor([sequences[0][:8]]))
    compiled(torch.tensor([[sequences[0][8]]]))
    assert len(calls) == 38
    with pytest.raises(D3DError, match="--compile"):
        compile_decode(torch.nn.Linear(2, 2))


@torch.no_grad()
def test_hf_fallback_rolls_back_and_speculates_losslessly(smol, sequences):
    """The transformers fallback (HFRuntime, for architectures without a native runtime): a rollback
    forgets exactly the dropped tokens, and n-gram speculation on it gives plain decoding's tokens."""
    from d3d.decoding.engine import generate
    from d3d.runtime.hf import HFRuntime
    from d3d.methods.ngram import NgramProposer

    model, tok = HFRuntime(smol[2]), smol[1]
    seq = sequences[0]
    model.setup_cache(1)
    full = model(torch.tensor([seq]))[0]
    model.rollback(len(seq) - 5)
    again = model(torch.tensor([seq[-5:]]))[0]
    assert float((again - full[-5:]).abs().max()) < TOL_SAME * 10
    plain = generate(model, tok, seq, max_new_tokens=24)
    spec = generate(model, tok, seq, max_new_tokens=24, proposer=NgramProposer())
    assert spec.token_ids == plain.token_ids and spec.rounds < plain.rounds
    from d3d.methods.catalog import make_runner

    fitted = make_runner("ngram", model, tok, smol[2])  # measures this runtime's cost curve to cut its copies
    assert fitted(seq, max_new_tokens=24).token_ids == plain.token_ids


def test_cache_lock_lets_one_process_fetch_or_convert_at_a_time(tmp_path, monkeypatch):
    """Two d3d processes started together (parallel test workers, two servers) fetch and convert the
    default target one after the other: the second waits on the lock, then finds the folder done."""
    import threading
    import time

    from d3d.runtime.checkpoints import cache_lock

    monkeypatch.setenv("D3D_CACHE", str(tmp_path))
    events = []

    def second():
        with cache_lock("model-x"):
            events.append("second in")

    with cache_lock("model-x"):
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)
        events.append("first out")
    waiter.join(10)
    assert events == ["first out", "second in"]
    with cache_lock("model-y"), cache_lock("model-z"):  # other names do not wait
        assert (tmp_path / "locks" / "model-y.lock").exists()


def test_packed_weights_move_into_one_huge_page_buffer_in_place():
    """into_huge_pages re-points each big tensor and every module buffer that shared its memory at one buffer
    (2 MB-aligned where the kernel offers huge pages), keeping the values; small tensors stay where they are."""
    from d3d.runtime.kernels import HUGE_PAGE, _madvise, into_huge_pages
    from d3d.runtime.quantize import Int4Linear

    torch.manual_seed(0)
    lin = Int4Linear.from_linear(torch.nn.Linear(1024, 4096, bias=False))  # scales 256 KB: both move
    small = torch.randn(16)
    params = [lin.q4.detach(), lin.scales.detach(), small]
    before = [t.clone() for t in params]
    small_ptr = small.data_ptr()
    into_huge_pages(params, list(lin.buffers()))
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert small.data_ptr() == small_ptr
    if _madvise() is None:
        pytest.skip("no transparent huge pages here: the tensors stay where they are")
    assert params[0].data_ptr() % HUGE_PAGE == 0
    assert lin.q4.data_ptr() == params[0].data_ptr()  # the module's own buffer moved with it
    assert params[1].untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr()  # one buffer
    x = torch.randn(3, 1024)
    assert torch.equal(lin(x), torch.ops.d3d.q4_linear(x, params[0], params[1], lin.factors, lin.shape, None))
    large = torch.randn(3 << 20)  # 12 MB: its whole 2 MB spans are collapsed where they are, nothing copied
    large_ptr, values = large.data_ptr(), large.clone()
    into_huge_pages([large], copy=False)
    assert large.data_ptr() == large_ptr and torch.equal(large, values)
