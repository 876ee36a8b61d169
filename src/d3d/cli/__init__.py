"""Command-line interface: `d3d generate | bench | report | demo | data | train | prune | serve`.

Every user mistake that can be caught without the model (method names, sampling settings, token
budgets, prompt files) is checked before the model is loaded, so it fails instantly. parser.py builds
the parser, run.py and drafters.py hold the commands, checks.py the shared argument checks.
"""
from __future__ import annotations

import sys

from ..errors import D3DError
from .checks import set_threads
from .parser import build_parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        set_threads(getattr(args, "threads", None))
        args.func(args)
    except D3DError as e:
        print(f"d3d: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("d3d: interrupted", file=sys.stderr)
        return 130
    return 0
