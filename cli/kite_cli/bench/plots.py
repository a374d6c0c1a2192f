"""PNG plots of a benchmark result (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(run: dict) -> str:
    return f"{run['system']} (c={run['concurrency']})"


def ttft_distribution(workload: dict, path: Path) -> Path:
    """Empirical CDF of TTFT per system run (log x axis)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for run in workload["runs"]:
        xs = sorted(r["ttft"] for r in run["raw"] if r["error"] is None and r["ttft"] is not None)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=_label(run), linewidth=1.8)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"TTFT distribution: {workload['name']}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def hit_rate_over_time(workload: dict, path: Path) -> Path:
    """Cumulative prompt-token hit rate over the run, for every system that reuses (points: per request)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    drawn = 0
    for run in workload["runs"]:
        timeline = run.get("hit_timeline") or []
        if not timeline or not any(p[1] for p in timeline):
            continue
        xs = [p[0] for p in timeline]
        line, = ax.plot(xs, [100 * p[2] for p in timeline], label=f"{_label(run)} cumulative", linewidth=1.8)
        ax.scatter(xs, [100 * p[1] for p in timeline], s=12, alpha=0.5, color=line.get_color())
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no reuse in any run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds since the run started (request completion)")
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_ylim(-2, 102)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Hit rate over time: {workload['name']} (dots: single requests)")
    if drawn:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def throughput_vs_concurrency(workload: dict, path: Path) -> Path:
    """Output tokens/s against client concurrency, one line per system."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    by_system: dict[str, list[tuple[int, float]]] = {}
    for run in workload["runs"]:
        if run.get("output_tokens_per_s") is not None:
            by_system.setdefault(run["system"], []).append((run["concurrency"], run["output_tokens_per_s"]))
    for system, points in sorted(by_system.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system, linewidth=1.8)
    concurrencies = sorted({run["concurrency"] for run in workload["runs"]})
    ax.set_xticks(concurrencies)
    ax.set_xlabel("concurrent requests (client side)")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Throughput vs concurrency: {workload['name']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_all(result: dict, out_dir: Path) -> list[str]:
    written = []
    for wl in result["workloads"]:
        for kind, fn in (("ttft", ttft_distribution), ("hit_rate", hit_rate_over_time),
                         ("throughput", throughput_vs_concurrency)):
            path = out_dir / f"{wl['name']}_{kind}.png"
            fn(wl, path)
            written.append(path.name)
    return written
