"""The `d3d` argument parser. It imports neither torch nor a method module (`d3d --help` stays fast): the
method names and drafter options come from d3d.methods.registry, the commands import what they need when run."""
from __future__ import annotations

import argparse

from ..methods.registry import drafter_options, method_names
from .drafters import PARSERS as DRAFTER_PARSERS
from .measure import cmd_estimate, cmd_loadtest
from .run import QUICK_LIMIT, QUICK_NEW_TOKENS, cmd_bench, cmd_demo, cmd_generate, cmd_report, cmd_serve


# what a drafter option names, where it is not a drafter checkpoint
DRAFTER_HELP = {"draft-model": "NAME|PATH: a model with the target's tokenizer (known name, HF folder or .gguf)"}


class _Parser(argparse.ArgumentParser):
    """argparse with the same one-line `d3d: error: ...` format as every other error."""

    def error(self, message: str):
        self.exit(2, f"d3d: error: {message} (see {self.prog} --help)\n")


def _add_target_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--target", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: min(2, available))")
    if device:
        for option, methods in drafter_options().items():
            what = DRAFTER_HELP.get(option, "drafter checkpoint")
            p.add_argument(f"--{option}", default=None, help=f"{what} for {', '.join(methods)}")
        p.add_argument("--block-size", type=int, default=16, help="tokens verified per target forward")
        p.add_argument("--device", default="cpu")
        p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                       help="int8 or int4 weights for target and drafter (CPU, d3d's own kernels; int4 loads a "
                            "GGUF target straight from its 4-bit tensors); default: fp32")
        p.add_argument("--quantize-drafter", choices=["int8", "int4"], default=None,
                       help="int8 or int4 weights for the drafter only, whatever the target's precision (the output "
                            "stays the target's; default: as --quantize)")
        p.add_argument("--compile", action="store_true",
                       help="compile the target's forward passes (torch.compile; fp32 CPU; 1-2 min at start)")


def _add_method_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-budget", type=int, default=None,
                   help="d3d-tree, lookup-tree, suffix: a fixed number of tokens per verified tree (default: fitted to this device's "
                        "measured cost of a target forward vs its width, see d3d.decoding.tree.auto_tree)")
    p.add_argument("--ar-draft-k", type=int, default=None,
                   help="ar-draft: a fixed draft length (default: adaptive, starting at 4)")
    p.add_argument("--draft-k", type=int, default=None,
                   help="draft-model, d3d: a fixed draft length (default: draft-model adaptive, starting at 4; d3d "
                        "sized every round from this device's measured costs, see d3d.decoding.budget)")
    p.add_argument("--datastore", default=None, metavar="PATH|none",
                   help="d3d-tree, lookup-tree: retrieve continuations from this datastore (`d3d datastore` "
                        "builds one; default: the one shipped for the target; none: no retrieval)")
    p.add_argument("--no-learn", action="store_true",
                   help="d3d-tree, lookup-tree, suffix: do not also draft from this run's own earlier generations "
                        "(default: every finished generation joins a bounded index of the method's own, which "
                        "changes drafts only, never the output)")
    p.add_argument("--learn-tokens", type=int, default=None, metavar="N",
                   help="d3d-tree, lookup-tree: tokens of earlier generations kept for retrieval, the oldest "
                        "dropped first (default 65536, about 0.8 MB)")


def _add_sampling_args(p: argparse.ArgumentParser, seed: int | None) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")


def _generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of one prompt")
    p.add_argument("prompt")
    p.add_argument("--method", default="ar", help=f"one of {', '.join(method_names())}")
    _add_sampling_args(p, seed=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.add_argument("--trace", default=None, help="d3d-async: write a Chrome trace of the rounds (+ a PNG timeline)")
    p.add_argument("--draft-device", default=None, help="device of the drafter (default: the target's)")
    _add_method_options(p)
    _add_target_args(p)
    p.set_defaults(func=cmd_generate)


def _bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods against plain decoding, write a JSON report")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", help='JSONL file, one {"prompt": ...} per line')
    src.add_argument("--benchmarks", help="comma-separated among gsm8k,math500,humaneval,mt-bench,sharegpt "
                                          "(default: all) and history (MT-Bench chats and HumanEval code edits "
                                          "as one stream, where earlier answers matter)")
    p.add_argument("--methods", default="ar,ngram",
                   help=f"comma-separated among {', '.join(method_names())}; ar is always added as reference")
    p.add_argument("--drafters", nargs="+", default=None, metavar="NAME=PATH",
                   help="run every method that takes --drafter once per drafter (rows METHOD@NAME), "
                        "interleaved per prompt with the others")
    p.add_argument("--datastores", nargs="+", default=None, metavar="NAME=PATH",
                   help="run every method that retrieves (d3d-tree, lookup-tree) once per datastore (rows "
                        "METHOD@NAME; with --drafters METHOD@DRAFTER@DATASTORE), interleaved per prompt")
    _add_method_options(p)
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each benchmark")
    p.add_argument("--save-outputs", action="store_true", help="also store token ids and text per prompt")
    p.add_argument("--out", required=True, help="output JSON file (an interrupted run resumes from OUT.journal)")
    p.add_argument("--cost-curve", action="store_true",
                   help="first measure one target forward vs its width (1-64 tokens) and record it")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="make the whole interleaved run N times and report each figure's median over the runs")
    p.add_argument("--clients", default=None, metavar="1,2,4,8",
                   help="batched mode: the methods at each number of concurrent generations on one batched target "
                        "(as d3d serve --max-batch runs them; nothing learned from earlier answers): aggregate and "
                        "per-request tokens/s, time to first token; each prompt's first turn, benchmarks in turn")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_LIMIT} prompt per benchmark, {QUICK_NEW_TOKENS} new tokens "
                        f"(unless --limit / --max-new-tokens say otherwise)")
    _add_sampling_args(p, seed=0)
    _add_target_args(p)
    p.set_defaults(func=cmd_bench, max_new_tokens=None)


def _report(sub) -> None:
    p = sub.add_parser("report", help="markdown table and plots from bench result files")
    p.add_argument("results", nargs="+", help="JSON files written by d3d bench")
    p.add_argument("--out-dir", default=None, help="where REPORT.md and the PNGs go (default: the first file's folder)")
    p.set_defaults(func=cmd_report)


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="plain decoding vs the best method on three embedded prompts (math, code, chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _add_target_args(p, device=False)
    p.set_defaults(func=cmd_demo)


def _serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming, a live web page and /metrics",
                       description="OpenAI-compatible HTTP server with streaming, a live web page and /metrics. "
                                   "Requests share one thing: with lookup-tree and d3d-tree (and suffix), drafts are "
                                   "also retrieved from earlier requests' answers (at most --learn-tokens tokens, "
                                   "the oldest dropped first). Only drafts: every answer is the target's own "
                                   "either way, but a request's speed can depend on what earlier requests "
                                   "generated; --no-learn turns it off (for suffix too).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--method", default=None,
                   help=f"one of {', '.join(method_names())} (default: the fastest measured for the target, d3d.methods.catalog.best_method)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the running one (>= 1; beyond: 503)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health (default: $D3D_API_KEY)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="also accept browser requests from this origin, e.g. http://localhost:3000 ('*' = any); "
                        "repeatable (default: only the server's own)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="deadline per request: 504 if still queued, else cut at the next round with "
                        "finish_reason 'length' (default: none)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also accept requests whose Host header names NAME (e.g. a DNS name of this machine; "
                        "'*' = any); repeatable (default: loopback names and the --host address; others get 421)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="refuse (400) prompts of over N tokens (default: what the context window allows)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="process prompts N tokens per forward, checking cancellation and deadline between "
                        "chunks (default 256; in a batch the widest chunk that adds about 0.25 s to a forward, "
                        "narrower deep in a long prompt, so that running requests keep streaming)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="decode up to N requests together in batched forwards, joining and leaving between "
                        "rounds (continuous batching), with each round's drafts sized for the whole batch; "
                        "1 = one request at a time; methods that do not batch run one at a time (default 8: "
                        "on a CPU a forward of 8 rows costs little more than one)")
    p.add_argument("--max-connections", type=int, default=512, metavar="N",
                   help="open connections at most; beyond, 503 (default 512)")
    p.add_argument("--read-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="time a client has to send a request's headers, and again its body (408); idle "
                        "connections close after it (default 10)")
    _add_method_options(p)
    _add_target_args(p)
    p.set_defaults(func=cmd_serve)


def _estimate(sub) -> None:
    p = sub.add_parser("estimate", help="replayed greedy tau of drafters against the target's cached greedy "
                                         "continuations (no target forward per drafter)")
    p.add_argument("--drafters", nargs="+", required=True, metavar="NAME=PATH",
                   help="drafter checkpoints; PATH whole-target: the untrained whole-target drafter")
    p.add_argument("--benchmarks", default="gsm8k,math500,humaneval,mt-bench", help="first turns of these")
    p.add_argument("--limit", type=int, default=4, help="first N prompts of each benchmark")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cache", default="runs/continuations.json", help="the target's continuations (reused)")
    p.add_argument("--quantize-drafter", choices=("int8", "int4"), default=None, help="quantize the drafters only")
    p.add_argument("--save", default=None, help="write the whole-target drafter here (a delta checkpoint)")
    p.add_argument("--out", required=True, help="JSON report; drafters are added to one with the same settings")
    p.add_argument("--target", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_estimate)


def _loadtest(sub) -> None:
    # d3d.server.loadtest_base.PHASES, written out: importing it would load the server at every command
    phases = "random, cases, long_prompt, connections"
    p = sub.add_parser("loadtest", help="concurrent valid, faulty and cancelled requests against d3d serve, then "
                                         "abuse (foreign Host, slow bodies, a long prompt whose client leaves, "
                                         "many open connections); checks greedy answers against plain decoding "
                                         "and each bar of holding under abuse")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--api-key", default=None, help="the key of the server given with --url")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=150, help="seconds during which clients start requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--method", default="ngram", help="the method of the server started here")
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--target", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=10, metavar="SECONDS",
                   help="the started server's --request-timeout (default 10)")
    p.add_argument("--phases", default=phases.replace(" ", ""),
                   help=f"comma-separated, run in this order: {phases} (default: all)")
    p.add_argument("--long-prompt-tokens", type=int, default=4000, metavar="N",
                   help="long_prompt: prompt tokens (real prompts repeated; default 4000)")
    p.add_argument("--leave-after", type=float, default=2, metavar="SECONDS",
                   help="long_prompt: the client hangs up this long after sending (default 2)")
    p.add_argument("--connections", type=int, default=200, metavar="N",
                   help="connections: slow or idle connections held open (default 200)")
    p.add_argument("--hold", type=float, default=30, metavar="SECONDS",
                   help="connections: how long they are held (default 30)")
    p.add_argument("--server-log", default=None, metavar="PATH",
                   help="keep the started server's log here (default: a temporary file; scanned either way)")
    p.add_argument("--throughput", action="store_true",
                   help="instead of the phases: aggregate and per-request tokens/s and time to first token at "
                        "each --concurrency, for a server per --methods (--no-learn) and llama.cpp's server "
                        "where llama-cpp-python[server] is installed; answers checked against each server's "
                        "one-client answers; short requests' time to first token during a --long-prompt-tokens "
                        "prefill")
    p.add_argument("--methods", default=None,
                   help="--throughput: d3d serve methods, comma-separated (default: ar and the target's best)")
    p.add_argument("--concurrency", default="1,2,4,8", help="--throughput: clients per level (default 1,2,4,8)")
    p.add_argument("--requests", type=int, default=None,
                   help="--throughput: distinct prompts per level (default: twice the most clients)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="--throughput: the d3d servers' --max-batch (default: the most clients)")
    p.add_argument("--no-llama-cpp", action="store_true", help="--throughput: leave llama.cpp's server out")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="--throughput: run all the servers N times in turns and report each figure's median")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="--throughput: the d3d servers' weights (llama.cpp's server then runs Q8_0, or with int4 the "
                        "target's own 4-bit GGUF, else Q4_0); default: fp32")
    p.set_defaults(func=cmd_loadtest)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="d3d", description="Asynchronous speculative decoding with standalone diffusion drafters.")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_generate, _bench, _report, _demo, *DRAFTER_PARSERS, _serve, _estimate, _loadtest):
        add(sub)
    return p
