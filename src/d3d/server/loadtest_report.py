"""`d3d loadtest`'s verdict: each bar (the issue's "done when") held, failed or not measured, and what it
was measured at, in words (d3d.server.loadtest's summary is the input)."""
from __future__ import annotations


def client_5xx(out: dict) -> int:
    """5xx answers the load test's own clients got, all phases."""
    n = out.get("server_5xx", 0) + sum(r["got"].startswith("5") for r in out.get("cases", []))
    n += sum(r["next_status"] >= 500 for r in out.get("long_prompt", {}).get("runs", []))
    conn = out.get("connections", {})
    n += sum(k.startswith("5") and v for k, v in conn.get("small_status", {}).items())
    return n + sum(v for o in conn.get("outcomes", {}).values() for k, v in o["got"].items() if k.startswith("5"))


def verdicts(out: dict) -> dict:
    """Each bar's pass (True), fail (False) or not measured (None)."""
    conn, log = out.get("connections", {}).get("held", {}), out.get("server_log")
    held = {"greedy_equal_ar": out.get("greedy_all_equal_ar"),
            "cases_answered_as_expected": all(r["held"] for r in out["cases"]) if "cases" in out else None,
            "long_prompt_frees_worker": out.get("long_prompt", {}).get("held"),
            "connections_small_requests_within_2s": conn.get("small_answered_in_time"),
            "connections_memory_within_100mb": conn.get("memory"),
            "connections_ended_as_expected": conn.get("connections_ended_as_expected"),
            "zero_5xx": client_5xx(out) == 0 and (log is None or log["status_5xx"] == 0),
            "zero_tracebacks": None if log is None else log["tracebacks"] == 0 and log["trouble_lines"] == 0}
    return held


def measured(out: dict) -> dict:
    """What each bar was measured at, in words."""
    lp, conn, log = out.get("long_prompt"), out.get("connections"), out.get("server_log")
    text = {"greedy_equal_ar": "" if "greedy_checked" not in out else
            f"{out['greedy_checked']} greedy answers compared, {len(out['greedy_mismatches'])} differ, "
            f"{out['greedy_cut_by_deadline']} cut by the deadline",
            "zero_5xx": f"5xx seen by the clients: {client_5xx(out)}, in the server log: "
                        f"{'n/a' if log is None else log['status_5xx']}",
            "zero_tracebacks": "n/a" if log is None else f"{log['tracebacks']} tracebacks, {log['trouble_lines']} "
                                                         f"error lines in {log['lines']} log lines"}
    if "cases" in out:
        bad = [f"{r['case']}: got {r['got']} in {r['seconds']} s" for r in out["cases"] if not r["held"]]
        text["cases_answered_as_expected"] = f"{len(out['cases']) - len(bad)}/{len(out['cases'])}" + \
            (f" ({'; '.join(bad)})" if bad else "")
    if lp:
        text["long_prompt_frees_worker"] = f"{lp['prompt_tokens']} tokens, client left after {lp['leave_after_s']} s: " + \
            ", ".join(f"{'streamed' if r['stream'] else 'plain'}: worker free after {r['freed_after_leave_s']} s, next "
                      f"request {r['next_status']} {r['next_answered_after_leave_s']} s after" for r in lp["runs"]) + \
            f" (bar {lp['bar_s']:g} s)"
    if conn:
        rss, lat = conn["rss_mb"], conn["small_latency_s"]
        text["connections_small_requests_within_2s"] = f"{conn['small_requests']} small requests, p50 {lat['p50']} s, " \
            f"max {lat['max']} s, statuses {conn['small_status']} with {conn['open_during']['median']} connections open"
        text["connections_memory_within_100mb"] = f"RSS {rss['idle']} MB idle, peak {rss['peak']} MB " \
            f"(+{rss['peak_over_idle']} MB)"
        text["connections_ended_as_expected"] = "; ".join(f"{k}: {o['got']}" for k, o in conn["outcomes"].items())
    return text


def verdict_lines(out: dict) -> list[str]:
    """One line per bar, with what it was measured at, for people."""
    words = measured(out)
    return [f"{'held' if ok else 'FAILED' if ok is False else 'n/a'}: {name}: {words.get(name, '')}"
            for name, ok in out["held"].items()]
