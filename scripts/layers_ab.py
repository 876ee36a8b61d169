"""The C++ layers (torch.ops.d3d.layers) at two revisions in one process, called in turns on the same weights.

Whole-process timings move by up to 2x from one minute to the next on a shared machine, which hides a 10% change
in a kernel. Here the base revision's csrc/ is copied with its operator namespace renamed (`d3d` -> `d3dx`), built
with torch.utils.cpp_extension and loaded beside this checkout's operators; the target is loaded once (packed by
this checkout, so both revisions must take the same packed layout), the outputs and KV caches of the two are
checked bit for bit, then each (rows, context) case is timed `--pairs` times, the two revisions taking turns.
The report keeps every time and the median of the paired ratios (this checkout over the base). Weights' pages are
the same for both: what this measures is the layers' code.

    python scripts/layers_ab.py --base 259dac4 --quantize int4 --rows 1,16 --contexts 16,400 --pairs 60 \
        --out results/layers_ab_buffers_int4_smol_cpu.json
"""
from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.cpp_extension

from d3d.atomic import atomic_write_json
from d3d.bench.harness import machine_info
from d3d.runtime.kernels import BUILD_CFLAGS, BUILD_LDFLAGS, SOURCES
from d3d.runtime.loading import load_target

ROOT = Path(__file__).resolve().parents[1]
CSRC = "src/d3d/runtime/csrc"


def load_base(rev: str, workdir: Path) -> None:
    """Build the base revision's kernels as torch.ops.d3dx."""
    out = workdir / "csrc"
    out.mkdir()
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"], check=True,
                           capture_output=True, text=True).stdout.split()
    digest = hashlib.sha1(rev.encode())
    for name in names:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"], check=True, capture_output=True,
                              text=True).stdout
        text = re.sub(r"\bd3d\b", "d3dx", text)
        (out / name.replace("d3d.h", "d3dx.h")).write_text(text)
        digest.update(text.encode())
    torch.utils.cpp_extension.load(
        name=f"d3dx_{digest.hexdigest()[:10]}", sources=[str(out / s.name) for s in SOURCES],
        extra_include_paths=[str(out)], is_python_module=False, extra_cflags=BUILD_CFLAGS, extra_ldflags=BUILD_LDFLAGS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare this checkout with")
    ap.add_argument("--target", default=None)
    ap.add_argument("--quantize", default=None, choices=[None, "int8", "int4"])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--contexts", default="16,400")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_target(args.target, quantize=args.quantize)
    with tempfile.TemporaryDirectory() as tmp:
        load_base(args.base, Path(tmp))
    rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model.setup_cache(1, max(contexts) + max(rows) + 1)
    a = model.args
    atts = [layer.attention for layer in model.layers]
    caches = [att.k_cache for att in atts], [att.v_cache for att in atts]
    ops = {"base": torch.ops.d3dx.layers, "head": torch.ops.d3d.layers}

    def run(key: str, x: torch.Tensor, start: int) -> torch.Tensor:
        T = x.shape[1]
        return ops[key](x, model.cpu_params, *caches, model.inv_freq, torch.arange(start, start + T), None, start,
                        a.n_heads, a.norm_eps)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for T in rows:
            x = torch.randn(1, T, a.dim, generator=g)
            outs = {}
            for key in ops:
                for cache in caches[0] + caches[1]:
                    cache.zero_()
                outs[key] = [run(key, x, max(contexts))] + [c.clone() for c in caches[0] + caches[1]]
            if not all(torch.equal(p, q) for p, q in zip(outs["base"], outs["head"])):
                raise SystemExit(f"{T} rows: the two revisions' outputs or KV caches differ")
        times: dict[str, list[float]] = {}
        for i in range(args.pairs):
            for key in (("base", "head") if i % 2 else ("head", "base")):
                for T in rows:
                    for C in contexts:
                        x = torch.randn(1, T, a.dim, generator=g)
                        t0 = time.perf_counter()
                        run(key, x, C)
                        times.setdefault(f"{key} rows={T} context={C}", []).append(time.perf_counter() - t0)
    cases = {}
    for T in rows:
        for C in contexts:
            base, head = times[f"base rows={T} context={C}"], times[f"head rows={T} context={C}"]
            cases[f"rows={T} context={C}"] = {
                "base_ms": round(statistics.median(base) * 1e3, 3), "head_ms": round(statistics.median(head) * 1e3, 3),
                "head_over_base": round(statistics.median(h / b for b, h in zip(base, head)), 3)}
            print(f"rows={T} context={C}: {cases[f'rows={T} context={C}']}")
    command = "python scripts/layers_ab.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out") + f" --out {args.out}"
    atomic_write_json(Path(args.out), {"machine": machine_info("cpu", args.quantize), "command": command, "base": args.base,
                                       "bitwise_equal": True, "cases": cases,
                                       "times_s": {k: [round(t, 6) for t in v] for k, v in times.items()}})


if __name__ == "__main__":
    main()
