"""The target's forward cost against its width at two revisions of the code, the revisions taking turns.

Each turn runs d3d.decoding.treecost.width_cost_curve (the fastest of `--repeats` forwards per width, after
`--context` cached tokens, 256 unless given) in a fresh process for the base revision (a git worktree of it, on PYTHONPATH; its C++
kernels build on first use) and then for this checkout; the report keeps every turn and the median per
width, so a slow spell of a shared machine slows both alike. For kernel changes: a forward of 8-32 rows is
what batched decoding, token trees and the drafter's blocks pay.

    python scripts/width_curve_ab.py --base 0cd1bf2 --widths 1,4,8,16,32,64,128 --turns 4 \
        --out results/width_curve_fp32_panels_smol_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from d3d.atomic import atomic_write_json
from d3d.bench.harness import machine_info

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, torch
from d3d.runtime.loading import load_target
from d3d.decoding.treecost import width_cost_curve
torch.set_num_threads(int(sys.argv[1]))
model, _, _ = load_target(sys.argv[2] or None, "cpu", quantize=sys.argv[3] or None)
widths = tuple(int(w) for w in sys.argv[4].split(","))
print(json.dumps(width_cost_curve(model, widths=widths, context=int(sys.argv[6]), repeats=int(sys.argv[5]))))
"""


def curve(src: Path, args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.threads), args.target or "", args.quantize or "",
                          args.widths, str(args.repeats), str(args.context)], env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"width_curve_ab: the run on {src} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return {w: s * 1e3 for w, s in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the revision to compare this checkout with")
    ap.add_argument("--target", default=None, help="a target name or path (default: the embedded SmolLM2)")
    ap.add_argument("--quantize", default=None, choices=[None, "int8", "int4"])
    ap.add_argument("--widths", default="1,4,8,16,32,64,128")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="tokens cached before each timed forward")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    turns = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.base], check=True,
                       capture_output=True)
        try:
            for turn in range(args.turns):
                for name, src in (("base", tree / "src"), ("head", ROOT / "src")):
                    turns[name].append(curve(src, args))
                    print(f"turn {turn + 1} {name}: " + ", ".join(f"{w}: {ms:.1f}" for w, ms in turns[name][-1].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    median = {name: {w: round(statistics.median(t[w] for t in runs), 2) for w in runs[0]} for name, runs in turns.items()}
    ratio = {w: round(median["head"][w] / median["base"][w], 3) for w in median["base"]}
    print("median ms, base -> head (ratio): " + ", ".join(
        f"{w}: {median['base'][w]:.1f} -> {median['head'][w]:.1f} ({ratio[w]:.2f})" for w in ratio))
    atomic_write_json(args.out, {"machine": machine_info("cpu", args.quantize), "command": "python " + " ".join(sys.argv),
                                 "base": args.base, "target": args.target or "SmolLM2-135M-Instruct",
                                 "context": args.context,
                                 "median_ms": median, "head_over_base": ratio,
                                 "turns_ms": {k: [{w: round(ms, 2) for w, ms in t.items()} for t in v]
                                              for k, v in turns.items()}})


if __name__ == "__main__":
    main()
