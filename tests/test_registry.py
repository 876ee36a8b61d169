"""A new method is one registered object: a toy proposer added here, and nowhere else, works in
`d3d generate --method`, `d3d bench --methods` and the Python API / server front door (d3d.load), and
the command line lists it (with its own drafter option, if it has one)."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from d3d import load
from d3d.cli import main
from d3d.decoding.engine import generate
from d3d.decoding.proposer import Proposer
from d3d.errors import D3DError
from d3d.methods.catalog import check_quantize, make_runner, parse_methods
from d3d.methods.registry import BUILTIN, REGISTRY, Method, Runner, register
from helpers import StubTokenizer, tiny_model


class RepeatLast(Proposer):
    """Proposes the last token k times: often wrong, so verification does all the work."""

    def reset(self, prompt_ids):
        pass

    def propose(self, tokens, k):
        return [tokens[-1]] * k, None


@pytest.fixture
def toy():
    def build(s):
        return Runner(partial(generate, s.model, s.tokenizer, proposer=RepeatLast(), block_size=4), block_size=4,
                      toy_repeats=4)

    method = register(Method("toy-repeat", build, help="test only"))
    yield method
    del REGISTRY[method.name]


def test_a_registered_method_runs_everywhere(toy, smol, tmp_path, capsys):
    model, tok, model_dir = smol
    ids = tok.encode("Count: 1, 1, 1, 1,", add_special_tokens=False)
    assert make_runner("toy-repeat", model, tok, model_dir)(ids, max_new_tokens=12).token_ids == \
        make_runner("ar", model, tok, model_dir)(ids, max_new_tokens=12).token_ids

    assert main(["generate", "What is 2+3?", "--method", "toy-repeat", "--max-new-tokens", "8", "--json",
                 "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "toy-repeat"

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name three colours."}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", "--prompts", str(prompts), "--methods", "toy-repeat", "--max-new-tokens", "8",
                 "--out", str(out), "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert rows["toy-repeat"]["lossless"] is True
    assert report["settings"]["toy_repeats"] == 4  # a runner's declared settings reach the bench report

    gen = load(method="toy-repeat")
    assert gen.method == "toy-repeat" and gen.generate("Hi!", max_new_tokens=4)
    assert gen.block_size == 4  # request checks reserve the runner's declared block size


def test_a_plain_function_runner_runs_with_the_setup_block_size(smol):
    model, tok, model_dir = smol
    runner = make_runner("ngram", model, tok, model_dir, block_size=8)
    assert runner.settings == {"block_size": 8}


def test_unknown_methods_name_the_registered_ones():
    with pytest.raises(D3DError, match="unknown method .nope.; choose from ar, ar-draft, d3d, d3d-async"):
        parse_methods("ar,nope")


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_command_line_lists_registered_methods_and_their_drafter_options(toy, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse would wrap lines, breaking names at their hyphens
    drafted = register(Method("toy-drafted", lambda s: None, drafter_kind="d3d", drafter_option="toy-drafter"))
    try:
        for command in ("generate", "bench", "serve"):
            text = _help(capsys, command)
            assert "toy-repeat" in text and "d3d-tree" in text, command
            assert "--toy-drafter TOY_DRAFTER drafter checkpoint for toy-drafted" in text, command
            assert "--drafter DRAFTER drafter checkpoint for d3d, d3d-async, d3d-tree" in text, command
    finally:
        del REGISTRY[drafted.name]


def test_the_builtin_table_lists_exactly_the_builtin_methods():
    import d3d.methods.catalog  # noqa: F401 (registers the built-ins)

    assert {name: m.option for name, m in REGISTRY.items()} == BUILTIN
    with pytest.raises(D3DError, match="registry.BUILTIN"):
        register(Method("ngram", lambda s: None, drafter_kind="d3d"))
    assert REGISTRY["ngram"].drafter_kind is None


def test_quantize_is_refused_by_the_methods_that_run_the_target_on_their_own_runtime():
    """--quantize int8 converts d3d's loaded target; hf and hf-lookup run transformers' fp32 model and
    llama-cpp llama.cpp's F32 GGUF, so they would ignore it: a one-line error naming the method and what
    it runs, before the target loads (d3d.load) and in make_runner, which generate and bench go through.
    llama-cpp-q8 (llama.cpp's own int8) and the methods on d3d's target take it."""
    says = {"hf": "transformers' own fp32 model; --quantize does not apply: run it without --quantize",
            "hf-lookup": "transformers' own fp32 model; --quantize does not apply: run it without --quantize",
            "llama-cpp": "llama.cpp's own F32 GGUF; --quantize does not apply: use llama-cpp-q8 for int8"}
    for method, what in says.items():
        with pytest.raises(D3DError) as e:
            check_quantize("int8", ["ar", "d3d-tree", method])
        assert str(e.value) == f"{method} runs {what}"
        with pytest.raises(D3DError, match=f"^{method} runs"):
            load(method=method, quantize="int8")
        check_quantize(None, [method])
    check_quantize("int8", ["ar", "ngram", "d3d", "d3d-tree", "lookup-tree", "llama-cpp-q8", "suffix"])
    model = tiny_model()
    model.quantized = "int8"  # as d3d.runtime.quantize marks an int8 target
    with pytest.raises(D3DError, match="^hf runs"):
        make_runner("hf", model, StubTokenizer(), Path("tiny"))
