"""Measuring commands: estimate (replayed greedy tau of several drafters, no target forward per drafter)
and loadtest (concurrent valid and faulty requests against `d3d serve`)."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ..errors import D3DError
from .checks import named_paths, open_target


def _estimate_drafter(model, tok, target: str | None, path: str, quantize: str | None, save: str | None):
    """The drafter a --drafters path names (WHOLE_TARGET: the untrained whole-target drafter, written to
    --save if given), with its quantization."""
    from ..runtime.checkpoints import DEFAULT_TARGET
    from ..drafters.files import load_drafter, save_drafter
    from ..training.estimate import WHOLE_TARGET, whole_target_drafter
    from ..runtime.quantize import apply_quantize

    if path == WHOLE_TARGET:
        drafter = whole_target_drafter(model, tok, target or DEFAULT_TARGET)
        if save:
            save_drafter(drafter, Path(save))
    else:
        drafter = load_drafter(path, model, tok)
    return apply_quantize(drafter, quantize, tok, batch_invariant=False)


def _estimate_row(drafter, path: str) -> dict:
    from ..drafters.files import weights_fingerprint
    from ..training.estimate import WHOLE_TARGET

    training = drafter.cfg.training or {}
    return {"path": path, "weights": None if path == WHOLE_TARGET else weights_fingerprint(path),
            "layers": len(drafter.layers), "training": training.get("command"),
            "heldout_teacher_forced": training.get("heldout_after")}


def _merged(out: Path, header: dict) -> dict:
    """The report at `out` to add drafters to (a fresh one if absent); one made with other settings is refused."""
    if not out.exists():
        return {**header, "drafters": {}}
    old = json.loads(out.read_text())
    keys = ("benchmarks", "limit", "max_new_tokens", "target")
    if any(old.get(k) != header[k] for k in keys):
        raise D3DError(f"{out} holds estimates with other settings ({', '.join(keys)}); choose another --out")
    return {**old, **header, "drafters": old.get("drafters", {})}


def cmd_estimate(args: argparse.Namespace) -> None:
    from ..bench.harness import machine_info
    from ..atomic import atomic_write_json
    from ..training.estimate import WHOLE_TARGET, benchmark_continuations, estimate_tau
    from ..corpus.prompts import canonical_benchmark

    named = named_paths(args.drafters, "--drafters", special=(WHOLE_TARGET,))
    benchmarks = list(dict.fromkeys(canonical_benchmark(b.strip()) for b in args.benchmarks.split(",") if b.strip()))
    if not benchmarks:
        raise D3DError("no benchmark given")
    if args.limit <= 0 or args.max_new_tokens <= 0:
        raise D3DError("--limit and --max-new-tokens must be > 0")
    if args.save and WHOLE_TARGET not in named.values():
        raise D3DError(f"--save writes the {WHOLE_TARGET} drafter: name one in --drafters")
    out = Path(args.out)
    report = _merged(out, {"command": "d3d " + shlex.join(args.argv), "machine": machine_info("cpu"),
                           "what": "replayed greedy d3d tau against the target's cached continuations",
                           "benchmarks": benchmarks, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                           "target": args.target})
    model, tok, _ = open_target(args.target)
    conts = benchmark_continuations(model, tok, benchmarks, args.limit, args.max_new_tokens, Path(args.cache))
    for name, path in named.items():
        drafter = _estimate_drafter(model, tok, args.target, path, args.quantize_drafter, args.save)
        row = {**_estimate_row(drafter, path), "quantize": args.quantize_drafter,
               **estimate_tau(drafter, conts, args.max_new_tokens)}
        report["drafters"][name] = row
        print(f"{name}: tau {row['tau']} (mean over benchmarks {row['mean']}; "
              + ", ".join(f"{b} {t}" for b, t in row["per_benchmark"].items()) + ")", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, report)
    print(f"wrote {out}")


def _throughput(args: argparse.Namespace) -> None:
    import sys

    from ..atomic import atomic_write_json
    from ..methods.catalog import best_method, parse_methods
    from ..server.loadtest import LoadTest
    from ..server.loadtest_throughput import run_throughput, throughput_plot, throughput_table

    try:
        levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        raise D3DError(f"--concurrency takes numbers of clients, e.g. 1,2,4,8 (got {args.concurrency!r})") from None
    if not levels or min(levels) < 1:
        raise D3DError(f"--concurrency takes numbers of clients >= 1 (got {args.concurrency!r})")
    if args.requests is not None and args.requests < 1 or args.max_tokens < 1 or args.long_prompt_tokens < 1:
        raise D3DError("--requests, --max-tokens and --long-prompt-tokens must be >= 1")
    if args.max_batch is not None and args.max_batch < 1:
        raise D3DError(f"--max-batch must be >= 1 (got {args.max_batch})")
    if args.repeat < 1:
        raise D3DError(f"--repeat must be >= 1 (got {args.repeat})")
    if args.url:
        raise D3DError("--throughput starts its own servers (one per method): drop --url")
    methods = parse_methods(args.methods or f"ar,{best_method(args.target)}")
    cfg = LoadTest(max_tokens=args.max_tokens, target=args.target, threads=args.threads or 1,
                   long_prompt_tokens=args.long_prompt_tokens, quantize=args.quantize)
    out = {"command": "d3d " + shlex.join(args.argv),
           **run_throughput(cfg, methods, levels, args.requests, not args.no_llama_cpp, args.max_batch, args.repeat)}
    print(throughput_table(out), file=sys.stderr)
    if args.out:
        atomic_write_json(Path(args.out), out)
        throughput_plot(out, Path(args.out).with_suffix(".png"))
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}", file=sys.stderr)


def cmd_loadtest(args: argparse.Namespace) -> None:
    import sys

    from ..server.loadtest import PHASES, LoadTest, run_load_test, verdict_lines

    if args.throughput:
        return _throughput(args)
    if args.quantize:
        raise D3DError("--quantize applies to --throughput (its own servers); start the server yourself with "
                       "d3d serve --quantize and pass --url")
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        raise D3DError("--clients and --max-tokens must be >= 1 and --duration > 0")
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise D3DError(f"--phases: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PHASES)}")
    if not args.request_timeout > 0 or args.leave_after <= 0 or args.hold <= 0:
        raise D3DError("--request-timeout, --leave-after and --hold must be > 0")
    if args.long_prompt_tokens < 1 or args.connections < 1:
        raise D3DError("--long-prompt-tokens and --connections must be >= 1")
    cfg = LoadTest(url=args.url, api_key=args.api_key, clients=args.clients, duration=args.duration,
                   max_tokens=args.max_tokens, method=args.method, target=args.target, threads=args.threads or 1,
                   max_queue=args.max_queue, seed=args.seed, request_timeout=args.request_timeout,
                   phases=tuple(p for p in PHASES if p in phases), long_prompt_tokens=args.long_prompt_tokens,
                   leave_after=args.leave_after, connections=args.connections, hold_s=args.hold,
                   server_log=args.server_log)
    out = {"command": "d3d " + shlex.join(args.argv), **run_load_test(cfg)}
    text = json.dumps(out, indent=1)
    print(text)
    print("\n".join(verdict_lines(out)), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not out["all_held"]:
        failed = [name for name, ok in out["held"].items() if ok is False]
        raise D3DError(f"load test failed: {', '.join(failed)} (see the summary)")
