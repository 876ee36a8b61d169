"""draft-model: classic speculative decoding with a whole pretrained model of the target's tokenizer.

The tiny target and a noisy copy of it (helpers.tiny_model) make a draft model that agrees with the
target only part of the time, so that both accepted and rejected drafts occur; the real default target
drafting for itself checks the method end to end (loading, the CLI's errors, int8)."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import EOS, V, StubTokenizer, tiny_model
from sampling_law import MAX_NEW_TINY, NOISE, PROMPT, TEMP, chi2_pvalue, exact_law, spec_draw

from d3d.cli import main
from d3d.methods.draftmodel import DraftModel, DraftModelProposer
from d3d.decoding.engine import generate
from d3d.errors import D3DError
from d3d.runtime.loading import load_tokenizer
from d3d.methods.catalog import make_runner
from d3d.methods.registry import REGISTRY
from d3d.decoding.verify import SamplingParams

PROMPTS = [[1, 2, 3], [4, 0, 6, 5], [2, 2, 5, 1, 3]]


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny forwards: threading only adds overhead
    yield
    torch.set_num_threads(threads)


def test_greedy_output_is_plain_decoding_with_drafts_accepted(one_thread):
    target, proposer = tiny_model(), DraftModelProposer(DraftModel(tiny_model(noise=NOISE)), V, max_len=64)
    lengths = []
    for prompt in PROMPTS:
        ar = generate(target, StubTokenizer(), prompt, max_new_tokens=40, block_size=8)
        res = generate(target, StubTokenizer(), prompt, max_new_tokens=40, block_size=8, proposer=proposer)
        assert res.token_ids == ar.token_ids
        lengths += res.acceptance_lengths
    assert sum(n > 1 for n in lengths) >= 5 and 1 in lengths  # drafts accepted, and rejected


class Recording(DraftModelProposer):
    """Keeps, after every round's drafting, the verified text it was shown, its draft, and the draft
    model's cached token ids and KV cache."""

    def reset(self, prompt_ids):
        super().reset(prompt_ids)
        self.rounds = []

    def propose(self, tokens, k):
        draft, q = super().propose(tokens, k)
        m = self.drafter.model
        self.rounds.append((list(tokens), draft, list(self.drafter.cached_tokens), m.cache_len,
                            m.kv_cache[..., :len(tokens), :].clone()))
        return draft, q


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)],
                         ids=["greedy", "sampled"])
def test_the_draft_models_cache_is_a_fresh_run_on_the_verified_text(one_thread, params):
    """Every round drops the rejected drafts and feeds the bonus token: after drafting, the cache holds the
    verified text (as one fresh pass over it computes it) followed by the draft but its last token."""
    target, fresh = tiny_model(), tiny_model(noise=NOISE)
    proposer = Recording(DraftModel(tiny_model(noise=NOISE)), V, max_len=64)
    res = generate(target, StubTokenizer(), PROMPTS[0], params, max_new_tokens=40, block_size=8, proposer=proposer)
    assert res.rounds > 5 and 1 in res.acceptance_lengths  # rollbacks happened
    for tokens, draft, cached, cache_len, kv in proposer.rounds:
        assert cached == tokens + draft[:-1] and cache_len == len(cached)
        fresh.setup_cache(1, 64)
        fresh(torch.tensor([tokens]))
        torch.testing.assert_close(kv, fresh.kv_cache[..., :len(tokens), :], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_sampling_has_the_law_of_plain_sampling(one_thread):
    target, draft_model = tiny_model(), DraftModel(tiny_model(noise=NOISE))
    samples, rounds = spec_draw(target, TEMP, lambda seed: DraftModelProposer(draft_model, V, max_len=64))
    assert rounds[1] > 100 and sum(v for n, v in rounds.items() if n > 1) > 50
    assert chi2_pvalue(samples, exact_law(target, PROMPT, TEMP, MAX_NEW_TINY, EOS)) > 1e-3


def test_a_fixed_draft_length(one_thread):
    """An exact copy of the target as draft model: every draft is accepted, so k would grow if it adapted."""
    target = tiny_model()
    proposer = DraftModelProposer(DraftModel(tiny_model()), V, max_len=64, k=2, adaptive=False)
    ar = generate(target, StubTokenizer(), PROMPTS[1], max_new_tokens=30, block_size=8)
    res = generate(target, StubTokenizer(), PROMPTS[1], max_new_tokens=30, block_size=8, proposer=proposer)
    assert res.token_ids == ar.token_ids and set(res.acceptance_lengths[:-1]) == {3}


def test_the_target_drafting_for_itself_from_its_folder(smol, prompt_ids, ar_tokens):
    """The whole method as the CLI builds it: the draft model loaded from a folder onto the runtime, here
    the target's own, so that every draft is accepted."""
    model, tok, model_dir = smol
    ids = prompt_ids[-1]  # a short chat prompt
    run = make_runner("draft-model", model, tok, model_dir, drafter=str(model_dir))
    res = run(ids, max_new_tokens=24)
    assert res.token_ids == ar_tokens(ids, 24) and res.tau > 4 and run.settings == {"block_size": 16, "draft_k": None}


def _error_line(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("d3d: error: "), lines
    return lines[0]


def test_without_draft_model_it_is_a_one_line_error_before_loading(capsys, monkeypatch):
    import d3d.cli.run

    monkeypatch.setattr(d3d.cli.run, "open_target", lambda *a, **k: pytest.fail("the target was loaded"))
    line = _error_line(capsys, "generate", "hi", "--method", "draft-model")
    assert "method draft-model needs --draft-model NAME|PATH" in line
    line = _error_line(capsys, "generate", "hi", "--method", "draft-model", "--draft-model", "/nonexistent/m")
    assert "does not exist: /nonexistent/m" in line
    assert "--draft-k must be >= 1" in _error_line(capsys, "generate", "hi", "--draft-k", "0")
    REGISTRY["draft-model"].check_drafter("Qwen2.5-Coder-0.5B-Instruct")  # known by name: fetched when run
    with pytest.raises(D3DError, match="does not exist"):
        REGISTRY["ar-draft"].check_drafter("Qwen2.5-Coder-0.5B-Instruct")


def test_another_vocabulary_is_a_one_line_error(smol, tmp_path):
    model, tok, model_dir = smol
    config = json.loads((model_dir / "config.json").read_text())
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 8}))
    with pytest.raises(D3DError, match=r"has 8 vocabulary rows, the target 49152: --draft-model needs a model "
                                       r"with the target's tokenizer"):
        make_runner("draft-model", model, tok, model_dir, drafter=str(small))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    changed = load_tokenizer(model_dir)
    changed.add_tokens(["<not-in-the-target>"])
    changed.save_pretrained(other)
    with pytest.raises(D3DError, match="has another tokenizer than the target"):
        make_runner("draft-model", model, tok, model_dir, drafter=str(other))
    with pytest.raises(D3DError, match="method draft-model needs --draft-model"):
        make_runner("draft-model", model, tok, model_dir)


def test_a_known_target_drafts_with_its_sibling_by_default(tmp_path):
    from d3d.methods.catalog import drafter_path

    method = REGISTRY["draft-model"]
    method.check_drafter(None, "Qwen2.5-Coder-1.5B-Instruct")
    assert drafter_path("draft-model", tmp_path / "Qwen2.5-Coder-1.5B-Instruct").name == "Qwen2.5-Coder-0.5B-Instruct"
    assert drafter_path("draft-model", tmp_path / "Qwen2.5-Coder-1.5B-Instruct", str(tmp_path)) == tmp_path
    with pytest.raises(D3DError, match="method draft-model needs --draft-model"):
        method.check_drafter(None, "SmolLM2-135M-Instruct")


def test_demo_and_serve_pick_a_known_targets_own_best_method(tmp_path):
    from d3d.methods.catalog import BEST_METHOD, BEST_METHODS, best_method

    assert best_method(None) == best_method("SmolLM2-135M-Instruct") == BEST_METHOD
    assert best_method(tmp_path / "Qwen2.5-Coder-1.5B-Instruct") == BEST_METHODS["Qwen2.5-Coder-1.5B-Instruct"]
    assert all(name in REGISTRY for name in BEST_METHODS.values())
