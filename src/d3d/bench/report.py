"""`d3d report`: markdown tables and plots from `d3d bench` result files.

Per result file: a table with one row per benchmark and, per method, tau and speedup vs AR (plus AR's
own tokens/s), then an "all" row pooled over every generation (d3d.bench.report.pooled); and three PNG plots:
speedup bars per benchmark and method, acceptance length histograms, tokens/s against tau.
"""
from __future__ import annotations

import json
from pathlib import Path
from statistics import median

from ..errors import D3DError

_ROW_KEYS = ("benchmark", "method", "tau", "speedup_vs_ar", "tokens_per_s")


def load_result(path: str | Path) -> dict:
    """A `d3d bench` JSON file, checked enough to render (clear errors otherwise)."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise D3DError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise D3DError(f"{path}: not valid JSON ({e.msg})") from None
    rows = report.get("results") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows:
        raise D3DError(f'{path}: not a d3d bench result (no "results" rows)')
    for r in rows:
        if not isinstance(r, dict) or any(k not in r for k in _ROW_KEYS):
            raise D3DError(f"{path}: a results row lacks one of {', '.join(_ROW_KEYS)}")
    return report


def _order(values) -> list:
    return list(dict.fromkeys(values))


def _methods(report: dict) -> list[str]:
    return _order(r["method"] for r in report["results"])


def _benchmarks(report: dict) -> list[str]:
    return _order(r["benchmark"] for r in report["results"])


def _rows(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["benchmark"], r["method"]): r for r in report["results"]}


def _shown_methods(report: dict) -> list[str]:
    """Methods that get tau/speedup columns and plots: every one but the AR reference (AR if alone)."""
    others = [m for m in _methods(report) if m != "ar"]
    return others or ["ar"]


def _pooled_from_prompts(prompts: list[dict]) -> tuple[float, float]:
    """(tau, seconds per decoded token) over generations, as the bench pools a benchmark's: acceptance
    lengths over rounds, decode time over tokens after the prefill's."""
    rounds = sum(p["rounds"] for p in prompts)
    tau = sum(sum(p["acceptance_lengths"]) for p in prompts) / max(1, rounds)
    return tau, sum(p["decode_s"] for p in prompts) / sum(max(1, p["new_tokens"] - 1) for p in prompts)


def pooled(report: dict) -> dict[str, dict[str, float]]:
    """Per method: tau, tokens/s and speedup over every generation of every benchmark it ran on, pooled
    as the bench pools one benchmark's (d3d.bench.harness._summary); the speedup is against `ar` pooled over the
    same benchmarks. A repeated bench (per-prompt records with a "run") gives the median over its runs of each
    run's pooled figures, as its rows do (d3d.bench.harness.median_of_runs). Files without per-prompt records
    fall back to arithmetic means over benchmarks."""
    per_prompt = report.get("per_prompt") or []
    runs = sorted({p["run"] for p in per_prompt if "run" in p})
    out = {}
    for m in _methods(report):
        rows = [r for r in report["results"] if r["method"] == m]
        benches = {r["benchmark"] for r in rows}
        mine = [p for p in per_prompt if p["method"] == m]
        ar = [p for p in per_prompt if p["method"] == "ar" and p["benchmark"] in benches]
        if not mine or (m != "ar" and not ar):
            out[m] = {k: sum(r[k] for r in rows) / len(rows) for k in ("tau", "speedup_vs_ar", "tokens_per_s")}
            continue
        figures = [_pooled_figures(m, [p for p in mine if p.get("run") == run], [p for p in ar if p.get("run") == run])
                   for run in runs or [None]]
        out[m] = {k: median(f[k] for f in figures) for k in figures[0]}
    return out


def _pooled_figures(method: str, mine: list[dict], ar: list[dict]) -> dict[str, float]:
    tau, tpot = _pooled_from_prompts(mine)
    speedup = 1.0 if method == "ar" else _pooled_from_prompts(ar)[1] / tpot
    return {"tau": tau, "tokens_per_s": 1 / tpot, "speedup_vs_ar": speedup}


def markdown_table(report: dict) -> str:
    """Benchmark x method table: AR tokens/s, then tau and speedup of each method; the pooled row last.
    A speedup marked with † is of a method whose output differed from AR (not lossless)."""
    methods, rows = _shown_methods(report), _rows(report)
    has_ar = "ar" in _methods(report)
    head = ["benchmark"] + (["ar tok/s"] if has_ar else [])
    for m in methods:
        head += [f"{m} tau", f"{m} speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cells(get) -> list[str]:
        out = []
        if has_ar:
            ar = get("ar")
            out.append(f"{ar['tokens_per_s']:.1f}" if ar else "")
        for m in methods:
            r = get(m)
            if r is None:
                out += ["", ""]
                continue
            mark = " †" if r.get("lossless") is False else ""
            out += [f"{r['tau']:.2f}", f"{r['speedup_vs_ar']:.2f}x{mark}"]
        return out

    for b in _benchmarks(report):
        lines.append("| " + " | ".join([b] + cells(lambda m: rows.get((b, m)))) + " |")
    total = pooled(report)
    lines.append("| " + " | ".join(["**all**"] + [f"**{c}**" if c else c for c in cells(
        lambda m: dict(total[m], lossless=None) if m in total else None)]) + " |")
    if any(r.get("lossless") is False for r in report["results"]):
        lines.append("\n† output differed from plain decoding on at least one prompt (not lossless).")
    return "\n".join(lines)


def _describe(report: dict) -> list[str]:
    out = []
    if report.get("command"):
        out.append(f"Command: `{report['command']}`")
    s = report.get("settings") or {}
    if s:
        prompts = {r["benchmark"]: r.get("prompts") for r in report["results"]}
        counts = ", ".join(f"{b} {n}" for b, n in prompts.items() if n is not None)
        out.append(f"Settings: temperature {s.get('temperature')}, {s.get('max_new_tokens')} new tokens, "
                   f"block size {s.get('block_size')}; prompts per benchmark: {counts}.")
    mach = report.get("machine") or {}
    if mach:
        commit = mach.get("git_commit")
        commit = (commit[:10] + (" (modified)" if mach.get("git_dirty") else "")) if commit else "unknown"
        kernels = f" (kernels: {mach['kernels']})" if mach.get("kernels") and not mach.get("gpu") else ""
        out.append(f"Machine: {mach.get('gpu') or mach.get('cpu')}{kernels}, {mach.get('threads')} threads, "
                   f"device {mach.get('device')}, torch {mach.get('torch')}, d3d commit {commit}.")
    return out


def _histograms(report: dict, method: str) -> dict[str, list[int]]:
    """Benchmark -> acceptance length counts (from the results row, else from per-prompt rows)."""
    out = {}
    for b in _benchmarks(report):
        row = _rows(report).get((b, method))
        if row is None:
            continue
        hist = row.get("tau_histogram")
        if hist is None:
            lengths = [a for p in report.get("per_prompt", []) if p["benchmark"] == b and p["method"] == method
                       for a in p.get("acceptance_lengths", [])]
            hist = [0] * max(lengths, default=1)
            for a in lengths:
                hist[a - 1] += 1
        out[b] = hist
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(report: dict, path: Path) -> None:
    plt = _pyplot()
    methods, rows, bench = _shown_methods(report), _rows(report), _benchmarks(report)
    total = pooled(report)
    groups = bench + ["all"]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) + 2), 3.8))
    for j, m in enumerate(methods):
        vals = [rows[(b, m)]["speedup_vs_ar"] if (b, m) in rows else 0.0 for b in bench] + [total[m]["speedup_vs_ar"]]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, vals, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup vs plain decoding (x)")
    ax.set_title("Speedup per benchmark")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tau_histograms(report: dict, path: Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    methods = _shown_methods(report)
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.4), squeeze=False, sharey=True)
    for ax, m in zip(axes[0], methods):
        for b, hist in _histograms(report, m).items():
            n = sum(hist)
            if n:
                ax.plot(range(1, len(hist) + 1), [c / n for c in hist], marker="o", ms=3, label=b)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{m}: acceptance length per round")
        ax.set_xlabel("acceptance length (accepted drafts + 1)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tps_vs_tau(report: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, m in enumerate(_methods(report)):
        color = f"C{k}"
        pts = [(p["tau"], (p["new_tokens"] - 1) / p["decode_s"]) for p in report.get("per_prompt", [])
               if p["method"] == m and p.get("decode_s", 0) > 0 and p.get("new_tokens", 0) > 1]
        if pts:
            ax.scatter(*zip(*pts), s=10, alpha=0.35, color=color)
        summary = [(r["tau"], r["tokens_per_s"]) for r in report["results"] if r["method"] == m]
        ax.scatter(*zip(*summary), s=60, color=color, edgecolors="k", label=m)
    ax.set_xlabel("tau (mean acceptance length)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Throughput against acceptance length\n(large: benchmark means; small: single prompts)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTS = (("speedup", plot_speedup), ("tau_hist", plot_tau_histograms), ("tps_vs_tau", plot_tps_vs_tau))


def write_report(paths: list[str | Path], out_dir: str | Path) -> tuple[str, list[Path]]:
    """Render REPORT.md and the PNG plots of every result file into out_dir; returns (markdown, files).
    Plots are named STEM_speedup.png, STEM_tau_hist.png, STEM_tps_vs_tau.png after each file."""
    reports = [(Path(p), load_result(p)) for p in paths]
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise D3DError(f"cannot create --out-dir {out_dir}: {e.strerror or e}") from None
    parts, files, stems = ["# d3d benchmark results", ""], [], set()
    for path, report in reports:
        stem, n = path.stem, 2
        while stem in stems:
            stem, n = f"{path.stem}_{n}", n + 1
        stems.add(stem)
        parts += [f"## {path.name}", "", *[line + "  " for line in _describe(report)], "",
                  markdown_table(report), ""]
        for name, plot in PLOTS:
            png = out_dir / f"{stem}_{name}.png"
            plot(report, png)
            files.append(png)
            parts += [f"![{name}]({png.name})", ""]
    md = "\n".join(parts).rstrip() + "\n"
    (out_dir / "REPORT.md").write_text(md, encoding="utf-8")
    return md, [out_dir / "REPORT.md", *files]
