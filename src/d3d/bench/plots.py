"""Plots: the timeline of one asynchronous generation (which lane worked when)."""
from __future__ import annotations

from pathlib import Path


def plot_timeline(events: list[dict], path: str | Path, max_rounds: int = 12) -> None:
    """Draw the first rounds' spans of a generate_async trace: target lane (verify) above the drafter lane."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [e for e in events if e.get("ph") == "X"]
    verifies = [e for e in spans if e["name"] == "verify"]
    if len(verifies) > max_rounds:
        end = verifies[max_rounds]["ts"]
        spans = [e for e in spans if e["ts"] < end]
    t0 = min(e["ts"] for e in spans)
    colors = {"prefill": "0.6", "verify": "tab:blue", "draft": "tab:orange", "sync draft": "tab:red",
              "pick": "tab:green"}
    fig, ax = plt.subplots(figsize=(11, 2.6))
    for e in spans:
        lane = 1 - e["tid"]
        ax.broken_barh([((e["ts"] - t0) / 1000, e["dur"] / 1000)], (lane - 0.35, 0.7),
                       color=colors.get(e["name"], "k"), label=e["name"])
    handles = {h.get_label(): h for h in ax.collections}
    ax.legend(handles.values(), handles.keys(), loc="lower right", bbox_to_anchor=(1, 1.0), ncol=5, fontsize=8,
              frameon=False)
    ax.set_yticks([1, 0], ["target", "drafter"])
    ax.set_xlabel("ms since prefill")
    ax.set_title("d3d-async: verification and packed drafting per round", loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pruning(report: dict, path: str | Path) -> None:
    """Mean calibration tau and packed-draft time against the number of layers removed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    removed = list(range(len(steps) + 1))
    tau = [report["tau_before"]["mean"]] + [s["tau"]["mean"] for s in steps]
    packed = [report["times_before"]["packed_ms"]] + [s["packed_ms"] for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(removed, tau, "o-", color="tab:blue")
    ax.axhline(report["keep_ratio"] * tau[0], color="tab:blue", ls=":", lw=1,
               label=f"{report['keep_ratio']:g} x starting tau")
    ax.set_xlabel("layers removed")
    ax.set_ylabel("mean calibration tau", color="tab:blue")
    ax.set_xticks(removed)
    ax.legend(loc="lower left", fontsize=8, frameon=False)
    ax2 = ax.twinx()
    ax2.plot(removed, packed, "s--", color="tab:orange")
    ax2.set_ylabel("packed-draft ms", color="tab:orange")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"Pruning: {report['layers_before']} -> {report['layers_after']} layers", loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
