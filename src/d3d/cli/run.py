"""The commands that run a target: generate, bench, report, demo and serve."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ..errors import D3DError
from ..methods.registry import check_method_options, drafter_options, get
from .checks import (check_budget, check_device, check_drafter, dest, drafter_for, loading, method_options,
                     named_paths, num_threads, open_target, output_folder, sampling)


def cmd_generate(args: argparse.Namespace) -> None:
    from ..decoding.engine import check_stop
    from ..methods.catalog import check_quantize, check_quantize_drafter, make_runner, parse_methods
    from ..corpus.prompts import encode_prompt

    check_stop(args.stop)
    if not args.prompt.strip():
        raise D3DError("empty prompt")
    methods = parse_methods(args.method)
    if len(methods) != 1:
        raise D3DError("generate takes exactly one --method")
    method = methods[0]
    params = sampling(args)
    check_budget(args.max_new_tokens, args.block_size)
    options = method_options(args)
    check_device(args.device)
    check_drafter(args.drafter)

    if args.draft_device:
        check_device(args.draft_device)
    if args.trace and method != "d3d-async":
        raise D3DError("--trace records the rounds of --method d3d-async")
    if args.trace:
        output_folder(args.trace, "--trace")

    check_quantize_drafter(args.quantize_drafter, methods)
    check_quantize(args.quantize, methods)
    drafter = drafter_for(method, args)
    model, tok, model_dir = open_target(args.target, args.device, args.quantize, args.compile)
    with loading(f"method {method}"):
        runner = make_runner(method, model, tok, model_dir, drafter=drafter, block_size=args.block_size,
                             draft_device=args.draft_device, quantize_drafter=args.quantize_drafter, **options)
    extra = {"trace": []} if args.trace else {}
    res = runner(encode_prompt(tok, args.prompt, args.raw), params=params, max_new_tokens=args.max_new_tokens,
                 stop=args.stop, **extra)
    if args.trace:
        from ..bench.plots import plot_timeline
        from ..decoding.trace import write_chrome_trace

        write_chrome_trace(extra["trace"], args.trace)
        plot_timeline(extra["trace"], Path(args.trace).with_suffix(".png"))
        print(f"wrote {args.trace} and {Path(args.trace).with_suffix('.png')}", file=sys.stderr)
    if args.json:
        from ..runtime.kernels import runtime_info

        ran_on = runtime_info(args.quantize is not None) if args.device == "cpu" else {}
        print(json.dumps({"method": method, **res.to_json(), **ran_on}))
        return
    print(res.text)
    print(f"[{method}] {res.new_tokens} new tokens, tau {res.tau:.2f}, {res.tokens_per_s:.1f} tokens/s",
          file=sys.stderr)


QUICK_LIMIT, QUICK_NEW_TOKENS = 1, 16  # d3d bench --quick (CI smoke runs)


def _bench_prompts(args: argparse.Namespace) -> dict[str, list]:
    from ..bench.harness import read_prompts_file
    from ..corpus.prompts import BENCHMARKS, benchmark_prompts, canonical_benchmark

    if args.limit is not None and args.limit <= 0:
        raise D3DError(f"--limit must be > 0 (got {args.limit})")
    if args.prompts:
        return {Path(args.prompts).stem: read_prompts_file(args.prompts)[:args.limit]}
    names = [b.strip() for b in (args.benchmarks or ",".join(BENCHMARKS)).split(",") if b.strip()]
    names = list(dict.fromkeys(canonical_benchmark(b) for b in names))
    if not names:
        raise D3DError("no benchmark given")
    return {b: benchmark_prompts(b, args.limit) for b in names}


def _bench_runs(methods: list[str], named: dict[str, str], stores: dict[str, str], args: argparse.Namespace,
                model_dir: Path) -> dict[str, tuple[str, Path | None, dict]]:
    """Run name -> (method, drafter checkpoint, options it overrides). With --drafters NAME=PATH, every
    method that would take its checkpoint from --drafter (d3d, d3d-async, d3d-tree) runs once per named
    drafter, as METHOD@NAME; with --datastores NAME=PATH, every method that retrieves runs once per named
    datastore, as METHOD@NAME (METHOD@DRAFTER@DATASTORE with both); the others run once."""
    from ..methods.catalog import drafter_path

    runs: dict[str, tuple[str, Path | None, dict]] = {}
    for m in methods:
        if named and get(m).option == "drafter":
            per_drafter = {f"{m}@{name}": (m, Path(path), {}) for name, path in named.items()}
        else:
            per_drafter = {m: (m, drafter_path(m, model_dir, drafter_for(m, args)), {})}
        for run, (_, path, _) in per_drafter.items():
            if stores and get(m).retrieves:
                runs |= {f"{run}@{name}": (m, path, {"datastore": store}) for name, store in stores.items()}
            else:
                runs[run] = (m, path, {})
    return runs


def cmd_bench(args: argparse.Namespace) -> None:
    from ..bench.harness import format_table, machine_info, run_bench
    from ..atomic import atomic_write_json
    from ..drafters.files import weights_fingerprint
    from ..methods.catalog import check_quantize, check_quantize_drafter, make_runner, parse_methods

    methods = parse_methods(args.methods)
    methods = ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]
    levels = None
    if args.clients is not None:
        from ..bench.batched import parse_clients

        levels = parse_clients(args.clients)
        refused = [m for m in methods if not get(m).batches]
        if refused:
            raise D3DError(f"--clients: method {refused[0]} does not run batched")
    if args.quick:
        args.limit = QUICK_LIMIT if args.limit is None else args.limit
        args.max_new_tokens = QUICK_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    args.max_new_tokens = 128 if args.max_new_tokens is None else args.max_new_tokens
    params = sampling(args)
    check_budget(args.max_new_tokens, args.block_size)
    if args.repeat < 1:
        raise D3DError(f"--repeat must be >= 1 (got {args.repeat})")
    options = method_options(args)
    check_device(args.device)
    check_drafter(args.drafter)
    named = named_paths(args.drafters, "--drafters")
    if named and not any(get(m).option == "drafter" for m in methods):
        raise D3DError("--drafters needs a method that takes --drafter in --methods (e.g. d3d, d3d-async)")
    stores = named_paths(args.datastores, "--datastores", check=lambda p: check_method_options({"datastore": p}))
    if stores and not any(get(m).retrieves for m in methods):
        raise D3DError("--datastores needs a method that retrieves in --methods (d3d-tree, lookup-tree)")
    if stores and args.datastore is not None:
        raise D3DError("--datastores names every datastore to run: it excludes --datastore")
    check_quantize_drafter(args.quantize_drafter, methods)
    check_quantize(args.quantize, methods)
    prompts = _bench_prompts(args)
    out = output_folder(args.out, "--out")

    model, tok, model_dir = open_target(args.target, args.device, args.quantize, args.compile)
    runs = _bench_runs(methods, named, stores, args, model_dir)
    if levels is not None:
        return _bench_batched(args, levels, model, tok, model_dir, runs, options, params, prompts, out)
    runners = {}
    for name, (m, path, extra) in runs.items():
        with loading(f"method {name}"):
            runners[name] = make_runner(m, model, tok, model_dir, drafter=path, block_size=args.block_size,
                                        quantize_drafter=args.quantize_drafter, **(options | extra))
    settings = {"methods": methods, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "block_size": args.block_size,
                "raw": args.raw, "target": args.target,
                **{dest(o): getattr(args, dest(o)) for o in drafter_options()},
                **({"drafters": named} if named else {}), **({"datastores": stores} if stores else {}),
                "drafter_weights": {n: weights_fingerprint(p) for n, (_, p, _) in runs.items() if p is not None},
                "benchmarks": list(prompts), "limit": args.limit, "quick": args.quick, "quantize": args.quantize,
                "quantize_drafter": args.quantize_drafter, "compile": args.compile, "repeat": args.repeat}
    for runner in runners.values():  # what a method resolved itself, e.g. d3d-tree's budget and cost curve
        settings.update({k: v for k, v in runner.settings.items() if k != "block_size"})
    settings["method_settings"] = {name: runner.settings for name, runner in runners.items()}
    curve = None
    if args.cost_curve:
        from ..decoding.treecost import width_cost_curve

        curve = {str(w): round(t, 5) for w, t in width_cost_curve(model).items()}
        print("target forward cost vs width (tokens fed after 256 cached: seconds, x one token): " + ", ".join(
            f"{w}: {t * 1e3:.1f} ms ({t / curve['1']:.2f}x)" for w, t in curve.items()), flush=True)
    journal = out.with_name(out.name + ".journal")
    report = run_bench(model, tok, runners, prompts, params, args.max_new_tokens, raw=args.raw,
                       save_outputs=args.save_outputs, block_size=args.block_size, journal=journal,
                       header={**settings, "device": args.device, "threads": num_threads()}, repeat=args.repeat)
    report = {"machine": machine_info(args.device, args.quantize), "command": "d3d " + shlex.join(args.argv),
              "settings": settings, **({"cost_curve_s": curve} if curve else {}), **report}
    atomic_write_json(out, report)
    journal.unlink()
    print(format_table(report["results"]))
    resumed = f" ({report['resumed']} generations replayed from an interrupted run)" if report["resumed"] else ""
    print(f"wrote {out}{resumed}")


def _bench_batched(args, levels, model, tok, model_dir, runs, options, params, prompts, out: Path) -> None:
    """d3d bench --clients: the methods at each number of concurrent generations (d3d.bench.batched)."""
    from ..atomic import atomic_write_json
    from ..bench.batched import format_levels, run_batched
    from ..bench.harness import machine_info
    from ..corpus.prompts import encode_prompt, first_turn
    from ..decoding.engine import validate_request
    from ..methods.catalog import make_runner
    from ..server.loadtest_throughput import throughput_plot

    firsts = [[first_turn(i) for i in items] for items in prompts.values()]
    texts = [f[j] for j in range(max(map(len, firsts))) for f in firsts if j < len(f)]  # benchmarks in turn
    ids = [encode_prompt(tok, t, args.raw) for t in texts]
    for i in ids:
        validate_request(model, i, args.max_new_tokens, args.block_size)

    def builder(m, path, extra):
        return lambda slot: make_runner(m, slot, tok, model_dir, drafter=path, block_size=args.block_size,
                                        quantize_drafter=args.quantize_drafter, **(options | extra | {"learn": False}))

    builders = {name: builder(*run) for name, run in runs.items()}
    result = run_batched(model, builders, ids, levels, params, args.max_new_tokens, repeat=args.repeat)
    machine = machine_info(args.device, args.quantize)
    report = {"machine": machine, "command": "d3d " + shlex.join(args.argv), "target": args.target,
              "max_tokens": args.max_new_tokens, "threads": num_threads(), "clients": levels, "requests": len(ids),
              "benchmarks": list(prompts), "learn": False, "runtime": {k: machine.get(k) for k in ("cpu", "kernels")},
              "servers": result}
    atomic_write_json(out, report)
    throughput_plot(report, out.with_suffix(".png"))
    print(format_levels(result))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def cmd_report(args: argparse.Namespace) -> None:
    from ..bench.report import write_report

    out_dir = args.out_dir or str(Path(args.results[0]).parent)
    md, files = write_report(args.results, out_dir)
    print(md, end="")
    print(f"wrote {', '.join(str(f) for f in files)}", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> None:
    from ..bench.demo import run_demo
    from ..methods.catalog import best_method

    check_budget(args.max_new_tokens, 16)
    run_demo(*open_target(args.target), args.max_new_tokens, best_method(args.target))


def cmd_serve(args: argparse.Namespace) -> None:
    from ..api import load
    from ..methods.catalog import best_method
    from ..server import check_address, serve
    from ..server.security import check_api_key

    if not 0 <= args.port <= 65535:
        raise D3DError(f"--port must be in 0..65535 (got {args.port})")
    if args.max_queue < 1:
        raise D3DError(f"--max-queue must be >= 1 (got {args.max_queue})")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise D3DError(f"--request-timeout must be > 0 seconds (got {args.request_timeout})")
    if not args.read_timeout > 0 or args.read_timeout == float("inf"):
        raise D3DError(f"--read-timeout must be > 0 seconds (got {args.read_timeout})")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise D3DError(f"--max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise D3DError(f"--prefill-chunk must be >= 1 (got {args.prefill_chunk})")
    if args.max_batch < 1:
        raise D3DError(f"--max-batch must be >= 1 (got {args.max_batch})")
    if args.max_connections < 1:
        raise D3DError(f"--max-connections must be >= 1 (got {args.max_connections})")
    key = args.api_key if args.api_key is not None else os.environ.get("D3D_API_KEY")
    key = check_api_key(key)  # empty or whitespace-only: refused here, before the model loads
    check_device(args.device)
    check_drafter(args.drafter)
    check_address(args.host, args.port)
    options = method_options(args)
    method = args.method or best_method(args.target)
    drafter = drafter_for(method, args)
    with loading(f"target {args.target} with method {method}"):
        gen = load(args.target, method, drafter, device=args.device, block_size=args.block_size,
                   quantize=args.quantize, compile=args.compile, quantize_drafter=args.quantize_drafter, **options)
    print(f"d3d serve: {gen.name} with method {gen.method} on http://{args.host}:{args.port} "
          f"(web page at /, OpenAI API at /v1; API key {'required' if key else 'not required'})",
          file=sys.stderr, flush=True)
    serve(gen, args.host, args.port, args.max_queue, api_key=key, allow_origins=args.allow_origin,
          request_timeout=args.request_timeout, allow_hosts=args.allow_host, max_prompt_tokens=args.max_prompt_tokens,
          prefill_chunk=args.prefill_chunk, max_connections=args.max_connections, read_timeout=args.read_timeout,
          max_batch=args.max_batch)
