"""Markdown rendering of benchmark results (pure: dicts in, text out)."""

from __future__ import annotations

from kite_cli.bench.stats import RATIO_METRICS


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return str(value)


def fmt_pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


SUMMARY_COLUMNS = (
    ("system", "system"), ("conc.", "concurrency"), ("req", "requests"), ("err", "errors"),
    ("TTFT p50 (s)", "ttft_p50"), ("TTFT p99 (s)", "ttft_p99"), ("TPOT p50 (s)", "tpot_p50"),
    ("E2E p50 (s)", "e2e_p50"), ("E2E p99 (s)", "e2e_p99"), ("req/s", "requests_per_s"),
    ("out tok/s", "output_tokens_per_s"), ("retried 503", "retries"), ("prompt tok", "prompt_tokens"),
    ("computed", "prompt_tokens_computed"), ("reused", "prompt_tokens_reused"), ("hit rate", "hit_rate"), ("load avg (1 min)", "load_1min"),
)


def summary_table(runs: list[dict]) -> str:
    """runs: dicts with system, concurrency and the Summary fields."""
    head = "| " + " | ".join(h for h, _ in SUMMARY_COLUMNS) + " |"
    align = "|" + "|".join(":---" if k == "system" else "---:" for _, k in SUMMARY_COLUMNS) + "|"
    lines = [head, align]
    for run in runs:
        cells = []
        for _, key in SUMMARY_COLUMNS:
            v = run.get(key)
            if key == "load_1min":
                v = (run.get("load_average_after") or [None])[0]
            cells.append(fmt_pct(v) if key == "hit_rate" else fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


RATIO_LABELS = {"ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99", "tpot_p50": "TPOT p50", "e2e_p50": "E2E p50",
                "e2e_p99": "E2E p99", "requests_per_s": "req/s", "output_tokens_per_s": "out tok/s"}


def ratio_table(comparisons: list[dict]) -> str:
    """comparisons: {"kite": label, "peer": label, "ratios": stats.ratios(...)}; a ratio is KITE / peer,
    marked with * where KITE is behind (slower or lower throughput)."""
    metrics = list(RATIO_METRICS)
    lines = ["| KITE / peer | " + " | ".join(RATIO_LABELS[m] for m in metrics) + " |",
             "|:---|" + "|".join("---:" for _ in metrics) + "|"]
    for c in comparisons:
        cells = []
        for m in metrics:
            r = c["ratios"][m]
            cell = fmt(r["ratio"])
            if r["kite_ahead"] is False:
                cell += " *"
            cells.append(cell)
        lines.append(f"| {c['kite']} / {c['peer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tier_lines(tiers: dict | None) -> str:
    if not tiers:
        return "n/a (ru-pool /metrics not reachable)"
    nonzero = {k: v for k, v in sorted(tiers.items()) if v}
    if not nonzero:
        return "all kite_tier_* counters unchanged (0)"
    return ", ".join(f"{k}={v:g}" for k, v in nonzero.items())


def render(result: dict) -> str:
    """The whole Markdown report of one `kite bench` run (the JSON result as input)."""
    meta = result["meta"]
    out = [f"# kite bench: {meta['timestamp']}", "",
           f"- command: `{meta['command']}`",
           f"- machine: {meta['machine']}",
           f"- KITE: {meta['kite_url']} ({meta['stack']}); model {meta.get('model', 'n/a')}",
           f"- seed {meta['seed']}, max output tokens {meta['output_tokens']}, greedy (temperature 0)",
           "- peers run in this process one request at a time (concurrency 1); KITE runs at each listed "
           "concurrency. Each KITE run has its own cache_salt, so it starts with a cold cache.",
           ""]
    for name, reason in sorted(result.get("skipped", {}).items()):
        out.append(f"- **{name}** {reason}")
    if result.get("skipped"):
        out.append("")
    for wl in result["workloads"]:
        out += [f"## {wl['name']}", "", f"{wl['description']} Parameters: "
                + ", ".join(f"{k}={v}" for k, v in wl["params"].items())
                + f"; {wl['num_requests']} requests.", "", summary_table(wl["runs"]), ""]
        if wl.get("comparisons"):
            out += ["Ratios KITE / peer (lower is better for times, higher for throughput; "
                    "`*` marks where KITE is behind):", "", ratio_table(wl["comparisons"]), ""]
        out.append("Hit rate per tier: worker-local (hot, in the worker) = token hit rate above; ru-pool "
                   "tiers (kite_tier_* counters during the KITE reuse-on runs): "
                   + tier_lines(wl.get("pool_tiers")) + ".")
        eq = wl.get("equality")
        if eq:
            verdict = "PASS" if not eq["mismatches"] else f"FAIL ({len(eq['mismatches'])} mismatches)"
            out += ["", f"Greedy outputs, KITE reuse on vs off: {verdict}, {eq['compared']} requests compared."]
            for m in eq["mismatches"][:5]:
                out.append(f"  - {m['request_id']} (c={m['concurrency']}): on={m['on'][:60]!r} off={m['off'][:60]!r}")
        agree = wl.get("peer_agreement")
        if agree:
            out.append("Same text as KITE reuse-off (information, not a failure): " + ", ".join(
                f"{k} {v['same']}/{v['compared']}" for k, v in sorted(agree.items())) + ".")
        errs = [f"{r['system']} c={r['concurrency']}: {m}" for r in wl["runs"] for m in r.get("error_messages", [])]
        if errs:
            out += ["", "Errors:"] + [f"  - {e}" for e in errs]
        out.append("")
    out.append(f"Plots: {', '.join(result.get('plots', [])) or 'none'}.")
    return "\n".join(out) + "\n"
