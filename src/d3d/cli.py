"""Command-line interface: `d3d generate | bench | demo | data`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .target import D3DError


def _threads(n: int | None) -> None:
    torch.set_num_threads(n or min(2, torch.get_num_threads()))


def cmd_data(args) -> None:
    from .data import build_dataset
    from .target import load_target

    model, tok, model_dir = load_target(args.target)
    log_path = Path(args.out) / "progress.log"
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    m = build_dataset(model, tok, Path(args.out), args.target or "SmolLM2-135M-Instruct", args.max_tokens,
                      args.max_new_tokens, batch_size=args.batch_size, log=log)
    print(f"{args.out}: {m['examples']} examples, {m['response_tokens']} response tokens")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="d3d", description="Asynchronous speculative decoding with standalone "
                                "diffusion drafters.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("data", help="generate self-distillation data from the target (resumable)")
    d.add_argument("--target", default=None)
    d.add_argument("--out", default="data/distill")
    d.add_argument("--max-tokens", type=int, default=1_000_000, help="stop once this many response tokens exist")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--threads", type=int, default=None)
    d.set_defaults(func=cmd_data)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _threads(getattr(args, "threads", None))
    try:
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
