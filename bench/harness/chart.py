"""Draws the results file as one PNG: ratios to the ceiling, latency, and claim cost vs size.

Run as a script by the tools venv's Python (matplotlib lives only there):
``python bench/harness/chart.py results.json chart.png``.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {
    "relay": "#d62728",
    "ceiling": "#7f7f7f",
    "procrastinate": "#1f77b4",
    "pgqueuer": "#2ca02c",
    "chancy": "#9467bd",
    "oban": "#ff7f0e",
}


#: The throughput panel's label of each workload it shows.
THROUGHPUT_LABELS = {"W1": "W1 drain", "W2": "W2 single enqueue", "W3": "W3 bulk enqueue"}


def _median(summary: dict, workload: str, name: str, key: str) -> float | None:
    try:
        return summary[workload][name][key]["median"]
    except KeyError:
        return None


def draw(results: dict, out: str) -> None:
    """Three panels: throughput ÷ ceiling (W1-W3), latency (W4), ms per job vs rows (W5)."""
    summary = results["summary"]
    names = [n for n in results["order"] if any(n in summary.get(w, {}) for w in summary)]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))

    ax = axes[0]
    workloads = [w for w in ("W1", "W2", "W3") if w in summary]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ratios = []
        for w in workloads:
            value, ceiling = _median(summary, w, name, "rate"), _median(summary, w, "ceiling", "rate")
            ratios.append(value / ceiling if value and ceiling else 0)
        xs = [j + i * width for j in range(len(workloads))]
        ax.bar(xs, ratios, width, label=name, color=COLORS.get(name))
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(workloads))])
    ax.set_xticklabels([THROUGHPUT_LABELS[w] for w in workloads])
    ax.set_ylabel("throughput ÷ ceiling (higher is better)")
    ax.axhline(1.0, color="#7f7f7f", linewidth=0.8, linestyle="--")
    ax.set_title("Throughput relative to the raw-SQL ceiling")

    ax = axes[1]
    keys = ("p50_ms", "p95_ms", "p99_ms")
    for i, name in enumerate(names):
        values = [_median(summary, "W4", name, k) or 0 for k in keys]
        ax.bar([j + i * width for j in range(3)], values, width, label=name, color=COLORS.get(name))
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(3)])
    ax.set_xticklabels(["p50", "p95", "p99"])
    ax.set_yscale("log")
    ax.set_ylabel("enqueue-to-start ms (lower is better, log)")
    ax.set_title("W4 latency into idle workers")

    ax = axes[2]
    for name in names:
        row = summary.get("W5", {}).get(name, {})
        points = sorted((int(k[3:]), v["median"]) for k, v in row.items() if k.startswith("ms@"))
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, color=COLORS.get(name))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows in the jobs table")
    ax.set_ylabel("ms per job while draining (lower is better)")
    ax.set_title("W5 claim cost vs table size")

    meta = results.get("meta", {})
    fig.suptitle(f"Relay bench, {meta.get('started', '')} ({meta.get('mode', '')}, {meta.get('machine', '')})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    with open(sys.argv[1]) as source:
        draw(json.load(source), sys.argv[2])
