"""The command line end to end, as a user runs it: errors are one clean line, outputs have their schema."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test runs the command line in a subprocess


def d3d(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "d3d.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, contains: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("d3d: error:"), proc.stderr
    assert contains in lines[0]


BAD_PROMPT_FILES = {
    "broken.jsonl": '{"prompt": "fine"}\n{"prompt": "broken\n',
    "nokey.jsonl": '{"text": "no prompt key"}\n',
    "emptyprompt.jsonl": '{"prompt": ""}\n',
    "blank.jsonl": "\n\n",
}

# (arguments, expected fragment of the error); "{tmp}" is a folder holding BAD_PROMPT_FILES and junk.txt
EARLY_ERRORS = [
    (("generate", ""), "empty prompt"),
    (("generate", "   "), "empty prompt"),
    (("generate", "hi", "--max-new-tokens", "0"), "max-new-tokens"),
    (("bench", "--quick", "--repeat", "0", "--out", "{tmp}/r.json"), "--repeat must be >= 1"),
    (("generate", "hi", "--method", "nope"), "unknown method"),
    (("generate", "hi", "--temperature", "-1"), "temperature"),
    (("generate", "hi", "--top-p", "0"), "top-p"),
    (("generate", "hi", "--top-p", "1.5"), "top-p"),
    (("generate", "hi", "--target", "/nonexistent/model"), "does not exist"),
    (("generate", "hi", "--target", "{tmp}"), "not a model"),
    (("generate", "hi", "--target", "{tmp}/junk.txt"), "not a model"),
    (("bench", "--prompts", "p.jsonl", "--methods", "ar,nope", "--out", "x.json"), "unknown method"),
    (("bench", "--prompts", "/nonexistent/p.jsonl", "--out", "x.json"), "cannot read prompts file"),
    (("bench", "--prompts", "{tmp}/broken.jsonl", "--out", "x.json"), ":2: not valid JSON"),
    (("bench", "--prompts", "{tmp}/nokey.jsonl", "--out", "x.json"), 'string "prompt"'),
    (("bench", "--prompts", "{tmp}/emptyprompt.jsonl", "--out", "x.json"), "empty prompt"),
    (("bench", "--prompts", "{tmp}/blank.jsonl", "--out", "x.json"), "no prompts"),
    (("bench", "--benchmarks", "nope", "--out", "x.json"), "unknown benchmark"),
    (("demo", "--max-new-tokens", "0"), "max-new-tokens"),
    (("generate", "hi", "--method", "dflash", "--dflash-drafter", "/nonexistent/d"), "does not exist"),
    (("generate", "hi", "--ar-draft-k", "0"), "--ar-draft-k must be >= 1"),
    (("generate", "hi", "--method", "ngram", "--quantize-drafter", "int8"), "--quantize-drafter needs a method"),
    (("generate", "hi", "--method", "hf", "--quantize", "int8"), "hf runs transformers' own fp32 model"),
    (("bench", "--prompts", "p.jsonl", "--methods", "llama-cpp", "--quantize", "int8", "--out", "x.json"),
     "use llama-cpp-q8 for int8"),
    (("bench", "--prompts", "p.jsonl", "--methods", "llama-cpp-source", "--quantize", "int8", "--out", "x.json"),
     "llama-cpp-source runs llama.cpp on the target's source GGUF"),
    (("loadtest", "--quantize", "int4"), "--quantize applies to --throughput"),
    (("bench", "--prompts", "p.jsonl", "--clients", "0,2", "--out", "x.json"), "--clients takes counts >= 1"),
    (("bench", "--prompts", "p.jsonl", "--clients", "1,x", "--out", "x.json"), "--clients takes comma-separated"),
    (("bench", "--prompts", "p.jsonl", "--methods", "d3d-async", "--clients", "1,2", "--out", "x.json"),
     "method d3d-async does not run batched"),
    (("bench", "--prompts", "p.jsonl", "--methods", "ngram", "--drafters", "a={tmp}", "--out", "x.json"),
     "--drafters needs a method"),
    (("bench", "--prompts", "p.jsonl", "--methods", "d3d", "--drafters", "{tmp}", "--out", "x.json"), "NAME=PATH"),
    (("bench", "--prompts", "p.jsonl", "--methods", "d3d", "--datastores", "a=none", "--out", "x.json"),
     "--datastores needs a method that retrieves"),
    (("bench", "--prompts", "p.jsonl", "--methods", "lookup-tree", "--datastores", "a=/nonexistent.npz",
      "--out", "x.json"), "datastore file does not exist"),
    (("bench", "--prompts", "p.jsonl", "--methods", "lookup-tree", "--datastores", "a=none", "--datastore", "none",
      "--out", "x.json"), "it excludes --datastore"),
    (("train", "--out", "x", "--extra-data", "/nonexistent/data"), "no dataset at /nonexistent/data"),
    (("estimate", "--drafters", "a=/nonexistent/d", "--out", "x.json"), "does not exist"),
    (("estimate", "--drafters", "a=whole-target", "--benchmarks", "nope", "--out", "x.json"), "unknown benchmark"),
    (("estimate", "--drafters", "a={tmp}", "--save", "x", "--out", "x.json"), "--save writes the whole-target"),
    (("prune", "--out", "x", "--sets", "math,poetry"), "--sets"),
    (("prune", "--out", "x", "--keep-ratio", "1.5"), "--keep-ratio"),
    (("prune", "--out", "x", "--drafter", "/nonexistent/d"), "does not exist"),
    (("prune", "--out", "x", "--heal-steps", "5", "--max-shards", "0"), "--max-shards must be >= 1"),
    (("train", "--out", "x", "--layers", "1,x"), "comma-separated integers"),
    (("train", "--out", "x", "--layers", "3,99"), "--layers must lie in"),
    (("train", "--out", "x", "--kind", "dflash", "--target-layers", "40"), "--target-layers must lie in"),
    (("train", "--out", "x", "--kind", "ar", "--ar-weight", "0"), "--ar-weight must be > 0"),
    (("train", "--out", "x", "--init", "/nonexistent/d"), "does not exist"),
    (("train", "--out", "x", "--max-shards", "0"), "--max-shards must be >= 1"),
    (("train", "--out", "x", "--layer-drop", "1"), "--layer-drop must be in [0, 1)"),
    (("train", "--out", "x", "--distill", "1.5"), "--distill must be in [0, 1]"),
    (("generate", "hi", "--compile", "--quantize", "int8"), "--compile supports the fp32 CPU runtime only"),
    (("generate", "hi", "--stop", ""), "stop strings must be non-empty"),
    (("generate", "hi", "--method", "d3d-async", "--trace", "{tmp}/junk.txt/t.json"), "cannot create the folder of --trace"),
]


# runs d3d.cli.main on each argument list in turn, in one process (each case costs little more than
# importing torch, which the process does once), and prints [exit code, stderr] per case as JSON
EARLY_ERROR_DRIVER = """
import contextlib, io, json, sys
from d3d.cli import main
done = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    done.append([code, err.getvalue()])
print(json.dumps(done))
"""


@pytest.fixture(scope="module")
def early_errors(tmp_path_factory) -> dict[tuple, subprocess.CompletedProcess]:
    """Every error that must be caught before the model loads, all run by one process of the command
    line's main (EARLY_ERROR_DRIVER)."""
    tmp = tmp_path_factory.mktemp("bad")
    for name, content in BAD_PROMPT_FILES.items():
        (tmp / name).write_text(content)
    (tmp / "junk.txt").write_text("not a model")
    argvs = [[a.format(tmp=tmp) for a in args] for args, _ in EARLY_ERRORS]
    proc = subprocess.run([sys.executable, "-c", EARLY_ERROR_DRIVER], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {args: subprocess.CompletedProcess(argv, code, "", err)
            for (args, _), argv, (code, err) in zip(EARLY_ERRORS, argvs, json.loads(proc.stdout))}


@pytest.mark.parametrize("args, contains", EARLY_ERRORS)
def test_errors_before_loading(early_errors, args, contains):
    assert_one_line_error(early_errors[args], contains)


def test_prompt_longer_than_context():
    assert_one_line_error(d3d("generate", "hello " * 9000, "--threads", "1"), "context window")


