"""Command-line interface: `d3d generate | bench | report | demo | data | train`.

Every user mistake that can be caught without the model (method names, sampling settings, token
budgets, prompt files) is checked before the model is loaded, so it fails instantly.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from .errors import D3DError
from .registry import drafter_options, get, method_names

class _Parser(argparse.ArgumentParser):
    """argparse with the same one-line `d3d: error: ...` format as every other error."""

    def error(self, message: str):
        self.exit(2, f"d3d: error: {message} (see {self.prog} --help)\n")


def _threads(n: int | None) -> None:
    if n is not None and n < 1:
        raise D3DError(f"--threads must be >= 1 (got {n})")
    import torch

    torch.set_num_threads(n or min(2, torch.get_num_threads()))


def _num_threads() -> int:
    import torch

    return torch.get_num_threads()


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise D3DError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise D3DError(f"device {device!r} requested but CUDA is not available")


def _check_budget(max_new_tokens: int, block_size: int) -> None:
    if max_new_tokens <= 0:
        raise D3DError(f"--max-new-tokens must be > 0 (got {max_new_tokens})")
    if block_size < 1:
        raise D3DError(f"--block-size must be >= 1 (got {block_size})")


def _check_tree_budget(tree_budget: int | None) -> None:
    if tree_budget is not None and tree_budget < 1:
        raise D3DError(f"--tree-budget must be >= 1 (got {tree_budget})")


def _load_target(target: str | None, device: str = "cpu", quantize: str | None = None):
    """load_target, with any failure to read the checkpoint reported as a user error."""
    from .target import load_target

    try:
        return load_target(target, device, quantize=quantize)
    except D3DError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise D3DError(f"could not load target {target}: {msg}") from None


def _check_max_shards(max_shards: int | None) -> None:
    if max_shards is not None and max_shards < 1:
        raise D3DError(f"--max-shards must be >= 1 (got {max_shards})")


def _check_drafter(drafter: str | None) -> None:
    if drafter is not None and not Path(drafter).expanduser().exists():
        raise D3DError(f"drafter path does not exist: {drafter}")


def _int_list(spec: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise D3DError(f"{flag} takes comma-separated integers (got {spec!r})") from None
    if not out:
        raise D3DError(f"{flag} is empty")
    return out


def _dest(option: str) -> str:
    return option.replace("-", "_")


def _drafter_for(method: str, args: argparse.Namespace) -> str | None:
    """The --drafter (or --dflash-drafter, ...) path that `method` uses (checked to exist)."""
    path = getattr(args, _dest(get(method).drafter_option), None)
    _check_drafter(path)
    return path


def _sampling(args: argparse.Namespace):
    from .verify import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from .methods import make_runner, parse_methods
    from .target import encode_prompt

    if not args.prompt.strip():
        raise D3DError("empty prompt")
    methods = parse_methods(args.method)
    if len(methods) != 1:
        raise D3DError("generate takes exactly one --method")
    method = methods[0]
    params = _sampling(args)
    _check_budget(args.max_new_tokens, args.block_size)
    _check_tree_budget(args.tree_budget)
    _check_device(args.device)
    _check_drafter(args.drafter)

    if args.draft_device:
        _check_device(args.draft_device)
    if args.trace and method != "d3d-async":
        raise D3DError("--trace records the rounds of --method d3d-async")

    model, tok, model_dir = _load_target(args.target, args.device, args.quantize)
    runner = make_runner(method, model, tok, model_dir, drafter=_drafter_for(method, args), block_size=args.block_size,
                         draft_device=args.draft_device, tree_budget=args.tree_budget)
    extra = {"trace": []} if args.trace else {}
    res = runner(encode_prompt(tok, args.prompt, args.raw), params=params, max_new_tokens=args.max_new_tokens,
                 stop=args.stop, **extra)
    if args.trace:
        from .async_engine import write_chrome_trace
        from .plots import plot_timeline

        write_chrome_trace(extra["trace"], args.trace)
        plot_timeline(extra["trace"], Path(args.trace).with_suffix(".png"))
        print(f"wrote {args.trace} and {Path(args.trace).with_suffix('.png')}", file=sys.stderr)
    if args.json:
        print(json.dumps({"method": method, **res.to_json()}))
        return
    print(res.text)
    print(f"[{method}] {res.new_tokens} new tokens, tau {res.tau:.2f}, {res.tokens_per_s:.1f} tokens/s",
          file=sys.stderr)


QUICK_LIMIT, QUICK_NEW_TOKENS = 1, 16  # d3d bench --quick (CI smoke runs)


def _bench_prompts(args: argparse.Namespace) -> dict[str, list]:
    from .bench import read_prompts_file
    from .prompts import BENCHMARKS, benchmark_prompts, canonical_benchmark

    if args.limit is not None and args.limit <= 0:
        raise D3DError(f"--limit must be > 0 (got {args.limit})")
    if args.prompts:
        return {Path(args.prompts).stem: read_prompts_file(args.prompts)[:args.limit]}
    names = [b.strip() for b in (args.benchmarks or ",".join(BENCHMARKS)).split(",") if b.strip()]
    names = list(dict.fromkeys(canonical_benchmark(b) for b in names))
    if not names:
        raise D3DError("no benchmark given")
    return {b: benchmark_prompts(b, args.limit) for b in names}


def cmd_bench(args: argparse.Namespace) -> None:
    from .bench import format_table, machine_info, run_bench
    from .data import atomic_write_json
    from .drafter import weights_fingerprint
    from .methods import drafter_path, make_runner, parse_methods

    methods = parse_methods(args.methods)
    methods = ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]
    if args.quick:
        args.limit = QUICK_LIMIT if args.limit is None else args.limit
        args.max_new_tokens = QUICK_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    args.max_new_tokens = 128 if args.max_new_tokens is None else args.max_new_tokens
    params = _sampling(args)
    _check_budget(args.max_new_tokens, args.block_size)
    _check_tree_budget(args.tree_budget)
    _check_device(args.device)
    _check_drafter(args.drafter)
    prompts = _bench_prompts(args)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise D3DError(f"cannot create the folder of --out {out}: {e.strerror or e}") from None

    model, tok, model_dir = _load_target(args.target, args.device, args.quantize)
    drafters = {m: drafter_path(m, model_dir, _drafter_for(m, args)) for m in methods}
    runners = {m: make_runner(m, model, tok, model_dir, drafter=drafters[m], block_size=args.block_size,
                              tree_budget=args.tree_budget) for m in methods}
    settings = {"methods": methods, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "block_size": args.block_size,
                "raw": args.raw, "target": args.target,
                **{_dest(o): getattr(args, _dest(o)) for o in drafter_options()},
                "drafter_weights": {m: weights_fingerprint(p) for m, p in drafters.items() if p is not None},
                "benchmarks": list(prompts), "limit": args.limit, "quick": args.quick, "quantize": args.quantize}
    for runner in runners.values():  # what a method resolved itself, e.g. d3d-tree's budget and cost curve
        settings.update({k: v for k, v in runner.settings.items() if k != "block_size"})
    curve = None
    if args.cost_curve:
        from .treecost import width_cost_curve

        curve = {str(w): round(t, 5) for w, t in width_cost_curve(model).items()}
        print("target forward cost vs width (tokens fed after 256 cached: seconds, x one token): " + ", ".join(
            f"{w}: {t * 1e3:.1f} ms ({t / curve['1']:.2f}x)" for w, t in curve.items()), flush=True)
    journal = out.with_name(out.name + ".journal")
    report = run_bench(model, tok, runners, prompts, params, args.max_new_tokens, raw=args.raw,
                       save_outputs=args.save_outputs, block_size=args.block_size, journal=journal,
                       header={**settings, "device": args.device, "threads": _num_threads()})
    report = {"machine": machine_info(args.device), "command": "d3d " + shlex.join(args.argv),
              "settings": settings, **({"cost_curve_s": curve} if curve else {}), **report}
    atomic_write_json(out, report)
    journal.unlink()
    print(format_table(report["results"]))
    resumed = f" ({report['resumed']} generations replayed from an interrupted run)" if report["resumed"] else ""
    print(f"wrote {out}{resumed}")


def cmd_report(args: argparse.Namespace) -> None:
    from .report import write_report

    out_dir = args.out_dir or str(Path(args.results[0]).parent)
    md, files = write_report(args.results, out_dir)
    print(md, end="")
    print(f"wrote {', '.join(str(f) for f in files)}", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    _check_budget(args.max_new_tokens, 16)
    run_demo(*_load_target(args.target), args.max_new_tokens)


def cmd_data(args: argparse.Namespace) -> None:
    from .data import build_dataset
    from .checkpoints import DEFAULT_TARGET
    from .target import load_target

    model, tok, model_dir = load_target(args.target)
    log_path = Path(args.out) / "progress.log"
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    m = build_dataset(model, tok, Path(args.out), args.target or DEFAULT_TARGET, args.max_tokens,
                      args.max_new_tokens, batch_size=args.batch_size, shard_size=args.shard_size, log=log)
    print(f"{args.out}: {m['examples']} examples, {m['response_tokens']} response tokens")


def cmd_train(args: argparse.Namespace) -> None:
    from .train import TrainConfig, train_drafter

    if not (Path(args.data) / "manifest.json").exists():
        raise D3DError(f"no dataset at {args.data} (build one with `d3d data --out {args.data}`)")
    _check_max_shards(args.max_shards)
    from .dflash import default_target_layers
    from .checkpoints import read_hf_config, resolve_target

    if args.init:
        _check_drafter(args.init)
    if args.init_model is not None and (args.init or args.kind != "d3d"):
        raise D3DError("--init-model builds a new d3d drafter: it excludes --init and --kind other than d3d")
    if args.freeze_below < 0:
        raise D3DError(f"--freeze-below must be >= 0 (got {args.freeze_below})")
    if args.max_file_mb is not None and args.max_file_mb <= 0:
        raise D3DError(f"--max-file-mb must be > 0 (got {args.max_file_mb})")
    whole = args.init_model is not None
    layers = None if whole and args.layers is None else _int_list(args.layers or "26,27,28,29", "--layers")
    draft_vocab = args.draft_vocab if args.draft_vocab is not None else 0 if whole else 8192
    ar_weight = {"d3d": 0.5, "dflash": 0.0, "ar": 1.0}[args.kind] if args.ar_weight is None else args.ar_weight
    if not 0 <= args.layer_drop < 1:
        raise D3DError(f"--layer-drop must be in [0, 1) (got {args.layer_drop})")
    if args.kind == "ar" and ar_weight <= 0:
        raise D3DError("--kind ar trains with the next-token loss only: --ar-weight must be > 0")
    n = read_hf_config(resolve_target(args.target))["num_hidden_layers"]
    if not whole and not all(0 <= i < n for i in layers):
        raise D3DError(f"--layers must lie in 0..{n - 1} (got {layers})")
    target_layers = None
    if args.kind == "dflash":
        target_layers = _int_list(args.target_layers, "--target-layers") if args.target_layers \
            else default_target_layers(n, 4)
        if not all(0 <= i < n for i in target_layers):
            raise D3DError(f"--target-layers must lie in 0..{n - 1} (got {target_layers})")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, ar_weight=ar_weight,
                      gamma=args.gamma, blocks_per_seq=0 if args.kind == "ar" else args.blocks_per_seq, seed=args.seed,
                      warmup=args.warmup, max_prompt_tokens=args.max_prompt_tokens, layer_drop=args.layer_drop,
                      freeze_below=args.freeze_below)
    run_dir = Path(args.run_dir or Path(args.out).with_name(Path(args.out).name + ".run"))
    summary = train_drafter(args.target, Path(args.data), Path(args.out), run_dir, layers, draft_vocab,
                            args.block_size, cfg, command="d3d " + shlex.join(args.argv),
                            max_shards=args.max_shards, kind=args.kind, target_layers=target_layers,
                            init=Path(args.init) if args.init else None, init_model=args.init_model,
                            max_file_mb=args.max_file_mb)
    before, after = summary["heldout_before"], summary["heldout_after"]
    tau = f"held-out teacher-forced tau {before['tau']} -> {after['tau']}, " if "tau" in after else ""
    print(f"{args.out}: {tau}held-out loss {before['loss']} -> {after['loss']}")


def cmd_prune(args: argparse.Namespace) -> None:
    from .data import atomic_write_json, load_dataset
    from .drafter import load_drafter, save_drafter
    from .methods import default_drafter
    from .plots import plot_pruning
    from .prompts import CALIBRATION_SETS
    from .prune import calibration_data, healer, heldout_taus, prune, pruning_report

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    bad = [s for s in sets if s not in CALIBRATION_SETS]
    if bad or not sets:
        raise D3DError(f"--sets must name some of {', '.join(CALIBRATION_SETS)} (got {args.sets!r})")
    if not 0 < args.keep_ratio <= 1:
        raise D3DError(f"--keep-ratio must be in (0, 1] (got {args.keep_ratio})")
    if args.heal_steps and not (Path(args.data) / "manifest.json").exists():
        raise D3DError(f"--heal-steps needs training data; none at {args.data}")
    _check_max_shards(args.max_shards)
    _check_drafter(args.drafter)
    model, tok, model_dir = _load_target(args.target, "cpu")
    src = args.drafter or default_drafter(model_dir)
    drafter = load_drafter(src, model, tok)
    if not 1 <= args.min_layers <= len(drafter.layers):
        raise D3DError(f"--min-layers must be in 1..{len(drafter.layers)} (got {args.min_layers})")
    run_dir = Path(args.run_dir or Path(args.out).with_name(Path(args.out).name + ".run"))
    run_dir.mkdir(parents=True, exist_ok=True)
    calib = calibration_data(model, tok, sets, args.prompts_per_set, args.max_new_tokens, run_dir / "calibration.json")
    heal = healer(load_dataset(args.data, args.max_shards), args.heal_steps, args.heal_lr, run_dir) \
        if args.heal_steps else None
    pruned, state = prune(drafter, calib, args.max_new_tokens, run_dir, keep_ratio=args.keep_ratio,
                          min_layers=args.min_layers, heal=heal, heal_steps=args.heal_steps)
    report = pruning_report(state, {
        "command": "d3d " + shlex.join(args.argv), "drafter": str(src), "out": args.out, "calibration_sets": sets,
        "prompts_per_set": args.prompts_per_set, "max_new_tokens": args.max_new_tokens,
        "keep_ratio": args.keep_ratio, "min_layers": args.min_layers, "heal_steps": args.heal_steps})
    if args.heldout:
        names = [b.strip() for b in args.heldout.split(",") if b.strip()]
        report["heldout"] = heldout_taus(model, tok, drafter, pruned, names, args.heldout_limit, args.max_new_tokens,
                                         run_dir / "heldout.json")
    pruned.cfg.training = dict(pruned.cfg.training, pruning={
        k: report[k] for k in ("command", "drafter", "layers_before", "layers_after", "tau_before", "tau_after")})
    save_drafter(pruned, Path(args.out))
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.report), report)
    plot_pruning(report, Path(args.report).with_suffix(".png"))
    print(f"{args.out}: {report['layers_before']} -> {report['layers_after']} layers, mean calibration tau "
          f"{report['tau_before']['mean']} -> {report['tau_after']['mean']} ({report['kept']:.1%} kept); "
          f"{state['stopped']}; wrote {args.report}")


def cmd_serve(args: argparse.Namespace) -> None:
    from .api import load
    from .methods import BEST_METHOD
    from .server import check_address, serve

    if not 0 <= args.port <= 65535:
        raise D3DError(f"--port must be in 0..65535 (got {args.port})")
    if args.max_queue < 1:
        raise D3DError(f"--max-queue must be >= 1 (got {args.max_queue})")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise D3DError(f"--request-timeout must be > 0 seconds (got {args.request_timeout})")
    _check_device(args.device)
    _check_drafter(args.drafter)
    check_address(args.host, args.port)
    gen = load(args.target, args.method or BEST_METHOD, args.drafter, device=args.device, block_size=args.block_size,
               quantize=args.quantize)
    key = args.api_key or os.environ.get("D3D_API_KEY") or None
    print(f"d3d serve: {gen.name} with method {gen.method} on http://{args.host}:{args.port} "
          f"(web page at /, OpenAI API at /v1; API key {'required' if key else 'not required'})",
          file=sys.stderr, flush=True)
    serve(gen, args.host, args.port, args.max_queue, api_key=key, allow_origins=args.allow_origin,
          request_timeout=args.request_timeout)


def _add_target_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--target", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: min(2, available))")
    if device:
        for option, methods in drafter_options().items():
            p.add_argument(f"--{option}", default=None, help=f"drafter checkpoint for {', '.join(methods)}")
        p.add_argument("--block-size", type=int, default=16, help="tokens verified per target forward")
        p.add_argument("--device", default="cpu")
        p.add_argument("--quantize", choices=["int8"], default=None,
                       help="int8 weights for target and drafter (CPU, fbgemm); default: fp32")


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-budget", type=int, default=None,
                   help="d3d-tree: a fixed number of tokens per verified tree (default: fitted to this device's "
                        "measured cost of a target forward vs its width, see d3d.tree.auto_tree)")


def _add_sampling_args(p: argparse.ArgumentParser, seed: int | None) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="d3d", description="Asynchronous speculative decoding with standalone diffusion drafters.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    g.add_argument("prompt")
    g.add_argument("--method", default="ar", help=f"one of {', '.join(method_names())}")
    _add_sampling_args(g, seed=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.add_argument("--trace", default=None, help="d3d-async: write a Chrome trace of the rounds (+ a PNG timeline)")
    g.add_argument("--draft-device", default=None, help="device of the drafter (default: the target's)")
    _add_tree_args(g)
    _add_target_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark methods against plain decoding, write a JSON report")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--prompts", help='JSONL file, one {"prompt": ...} per line')
    src.add_argument("--benchmarks", help="comma-separated among gsm8k,math500,humaneval,mt-bench,sharegpt "
                                          "(default: all)")
    b.add_argument("--methods", default="ar,ngram",
                   help=f"comma-separated among {', '.join(method_names())}; ar is always added as reference")
    _add_tree_args(b)
    b.add_argument("--limit", type=int, default=None, help="first N prompts of each benchmark")
    b.add_argument("--save-outputs", action="store_true", help="also store token ids and text per prompt")
    b.add_argument("--out", required=True, help="output JSON file (an interrupted run resumes from OUT.journal)")
    b.add_argument("--cost-curve", action="store_true",
                   help="first measure one target forward vs its width (1-64 tokens) and record it")
    b.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_LIMIT} prompt per benchmark, {QUICK_NEW_TOKENS} new tokens "
                        f"(unless --limit / --max-new-tokens say otherwise)")
    _add_sampling_args(b, seed=0)
    _add_target_args(b)
    b.set_defaults(func=cmd_bench, max_new_tokens=None)

    r = sub.add_parser("report", help="markdown table and plots from bench result files")
    r.add_argument("results", nargs="+", help="JSON files written by d3d bench")
    r.add_argument("--out-dir", default=None, help="where REPORT.md and the PNGs go (default: the first file's folder)")
    r.set_defaults(func=cmd_report)

    m = sub.add_parser("demo", help="plain decoding vs the best method on three embedded prompts (math, code, chat)")
    m.add_argument("--max-new-tokens", type=int, default=128)
    _add_target_args(m, device=False)
    m.set_defaults(func=cmd_demo)

    d = sub.add_parser("data", help="generate self-distillation data from the target (resumable)")
    d.add_argument("--target", default=None)
    d.add_argument("--out", default="data/distill")
    d.add_argument("--max-tokens", type=int, default=1_000_000, help="stop once this many response tokens exist")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--shard-size", type=int, default=128)
    d.add_argument("--threads", type=int, default=None)
    d.set_defaults(func=cmd_data)

    t = sub.add_parser("train", help="train a D3D drafter on distillation data (resumable; accelerate-ready)")
    t.add_argument("--target", default=None)
    t.add_argument("--data", default="data/distill")
    t.add_argument("--out", required=True, help="drafter folder to write (drafter.safetensors + drafter.json)")
    t.add_argument("--run-dir", default=None, help="checkpoints and history (default: OUT.run); reused to resume")
    t.add_argument("--layers", default=None,
                   help="target layers that initialise the drafter stack (default 26,27,28,29; "
                        "with --init-model: layers of that model, default all)")
    t.add_argument("--init", default=None, help="fine-tune this drafter checkpoint instead of building a new one")
    t.add_argument("--init-model", nargs="?", const="target", default=None, metavar="PATH_OR_NAME",
                   help="convert a whole pretrained causal LM with the target's tokenizer (a HF folder, a .gguf, "
                        "or `target`, the default when the flag has no value) into a token-shift block-diffusion "
                        "drafter; made from the target, layers kept frozen are stored as references (delta)")
    t.add_argument("--freeze-below", type=int, default=0, help="keep drafter stack layers 0..N-1 frozen")
    t.add_argument("--max-file-mb", type=float, default=None, help="split the weights into files of at most this size")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="LM head rows (most frequent tokens); 0 = all (default 8192; with --init-model 0)")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--max-prompt-tokens", type=int, default=64, help="prompt tail kept as training context")
    t.add_argument("--kind", choices=("d3d", "dflash", "ar"), default="d3d",
                   help="d3d: standalone block diffusion; dflash: conditioned on target hidden states "
                        "(baseline); ar: causal drafter for ar-draft (baseline)")
    t.add_argument("--target-layers", default=None, help="dflash: target layers to read (default: 4 spread out)")
    t.add_argument("--ar-weight", type=float, default=None,
                   help="lambda of the auxiliary AR loss (default: d3d 0.5, dflash 0, ar 1)")
    t.add_argument("--gamma", type=float, default=7.0, help="slot k loss weight exp(-k / gamma)")
    t.add_argument("--blocks-per-seq", type=int, default=12)
    t.add_argument("--layer-drop", type=float, default=0.0,
                   help="LayerDrop: skip each drafter layer with this probability per step (makes it prunable)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-shards", type=int, default=None, help="train on the first N data shards only")
    t.add_argument("--threads", type=int, default=None)
    t.set_defaults(func=cmd_train)

    pr = sub.add_parser("prune", help="remove drafter layers one at a time by their effect on tau (resumable)")
    pr.add_argument("--drafter", default=None, help="drafter to prune (default: the one shipped for the target)")
    pr.add_argument("--out", required=True, help="folder for the pruned drafter")
    pr.add_argument("--run-dir", default=None, help="calibration cache and resumable state (default: OUT.run)")
    pr.add_argument("--report", default="results/prune/report.json", help="report JSON (plot beside it)")
    pr.add_argument("--sets", default="math,code,chat", help="calibration sets (never benchmark test prompts)")
    pr.add_argument("--prompts-per-set", type=int, default=6)
    pr.add_argument("--max-new-tokens", type=int, default=128)
    pr.add_argument("--keep-ratio", type=float, default=0.99, help="stop before mean tau drops below this share")
    pr.add_argument("--min-layers", type=int, default=1, help="layer budget: never go below this many layers")
    pr.add_argument("--heal-steps", type=int, default=0, help="fine-tune steps after each removal (0 = none)")
    pr.add_argument("--heal-lr", type=float, default=2e-4)
    pr.add_argument("--data", default="data/distill", help="training data for healing")
    pr.add_argument("--max-shards", type=int, default=None, help="heal on the first N data shards only")
    pr.add_argument("--heldout", default="gsm8k,math500,humaneval,mt-bench,sharegpt",
                    help="benchmarks on which to check tau before/after ('' = skip)")
    pr.add_argument("--heldout-limit", type=int, default=5)
    pr.add_argument("--target", default=None)
    pr.add_argument("--threads", type=int, default=None)
    pr.set_defaults(func=cmd_prune)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming, a live web page and /metrics")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 = any free port")
    s.add_argument("--method", default=None,
                   help=f"one of {', '.join(method_names())} (default: d3d.methods.BEST_METHOD)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the running one (>= 1; beyond: 503)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health (default: $D3D_API_KEY)")
    s.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="also accept browser requests from this origin, e.g. http://localhost:3000 ('*' = any); "
                        "repeatable (default: only the server's own)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="deadline per request: 504 if still queued, else cut at the next round with "
                        "finish_reason 'length' (default: none)")
    _add_target_args(s)
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        _threads(getattr(args, "threads", None))
        args.func(args)
    except D3DError as e:
        print(f"d3d: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("d3d: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
