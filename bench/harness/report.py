"""Turns the raw runs into medians, ranges, ratios, targets and a markdown table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    """One number a workload reports, and whether more of it is better."""

    workload: str
    key: str
    label: str
    higher_is_better: bool


def _values(run: dict[str, Any]) -> dict[str, float]:
    """The metrics one successful run yields, by key."""
    result = run["result"]
    workload = run["workload"]
    if workload in ("W1", "W2", "W3"):
        return {"rate": result["value"]}
    if workload == "W4":
        return {k: result[k] for k in ("p50_ms", "p95_ms", "p99_ms")}
    if workload == "W5":
        values = {f"ms@{level['size']}": level["ms_per_job"] for level in result["levels"]}
        values["flat"] = result["value"]
        return values
    if workload == "W6":
        # A soak yields its result only with windows (see ``soak``).
        return {
            "drift": result["value"] * 100,
            "table_mb": result["windows"][-1]["table_bytes"] / 2**20,
            # The issue asks that the worker stay under its bound through the soak: the peak, not the end.
            "rss_mb": max(w["rss_mb"] for w in result["windows"]),
        }
    return {}


def metrics_for(workload: str, runs: list[dict[str, Any]]) -> list[Metric]:
    """The metrics shown for ``workload``, in column order."""
    if workload in ("W1", "W2", "W3"):
        return [Metric(workload, "rate", "jobs/s", True)]
    if workload == "W4":
        return [
            Metric(workload, "p50_ms", "p50 ms", False),
            Metric(workload, "p95_ms", "p95 ms", False),
            Metric(workload, "p99_ms", "p99 ms", False),
        ]
    if workload == "W5":
        sizes = sorted({int(k[3:]) for r in runs if "result" in r for k in _values(r) if k.startswith("ms@")})
        shown = [Metric(workload, f"ms@{s}", f"ms/job @ {s:,} rows", False) for s in sizes]
        return [Metric(workload, "flat", "largest ÷ smallest", False), *shown]
    if workload == "W6":
        return [
            Metric(workload, "drift", "throughput drift %", False),
            Metric(workload, "table_mb", "table MB at end", False),
            Metric(workload, "rss_mb", "worker peak RSS MB", False),
        ]
    return []


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """workload -> contestant -> metric key -> {median, min, max, n}, with "error" (the last) and
    "failed" (how many rounds) when rounds failed."""
    collected: dict[str, dict[str, dict[str, list[float]]]] = {}
    errors: dict[str, dict[str, list[str]]] = {}
    for run in runs:
        workload, name = run["workload"], run["contestant"]
        if "error" in run:
            errors.setdefault(workload, {}).setdefault(name, []).append(run["error"])
            continue
        per_metric = collected.setdefault(workload, {}).setdefault(name, {})
        for key, value in _values(run).items():
            per_metric.setdefault(key, []).append(value)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in sorted(set(collected) | set(errors)):
        table: dict[str, dict[str, Any]] = {}
        for name, per_metric in collected.get(workload, {}).items():
            table[name] = {
                key: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                for key, v in per_metric.items()
            }
        for name, failures in errors.get(workload, {}).items():
            table.setdefault(name, {}).update(error=failures[-1], failed=len(failures))
        summary[workload] = table
    return summary


def ratio(summary: dict[str, Any], workload: str, key: str, name: str, reference: str) -> float | None:
    """``name``'s median over ``reference``'s, when both exist."""
    table = summary.get(workload, {})
    try:
        return table[name][key]["median"] / table[reference][key]["median"]
    except (KeyError, ZeroDivisionError):
        return None


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def markdown(
    summary: dict[str, Any],
    runs: list[dict[str, Any]],
    titles: dict[str, str],
    order: list[str],
    unavailable: dict[str, str],
) -> str:
    """One table per workload: median (min-max) of each metric, ratios on the first."""
    parts = []
    for workload, table in summary.items():
        metrics = metrics_for(workload, [r for r in runs if r["workload"] == workload])
        if not metrics:
            continue
        first = metrics[0]
        better = "higher" if first.higher_is_better else "lower"
        header = ["contestant", *(f"{m.label} median (min-max)" for m in metrics), "x ceiling", "x Relay"]
        lines = [
            f"### {workload}: {titles.get(workload, '')} ({better} is better; ratios on {first.label})",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for name in order:
            if name in unavailable:
                lines.append(f"| {name} | {unavailable[name]} |" + " |" * (len(header) - 2))
                continue
            row = table.get(name)
            if row is None:
                continue
            if "error" in row and not any(metric.key in row for metric in metrics):
                lines.append(f"| {name} | failed: {row['error']} |" + " |" * (len(header) - 2))
                continue
            cells = [name]
            for metric in metrics:
                cell = row.get(metric.key)
                if cell is None:
                    cells.append("")
                elif cell["n"] > 1:
                    cells.append(f"{_number(cell['median'])} ({_number(cell['min'])}-{_number(cell['max'])})")
                else:
                    cells.append(_number(cell["median"]))
            # A soak's drift is a signed percentage near zero: no ratio of two of them means anything.
            compared = workload != "W6"
            cells.append(_ratio(ratio(summary, workload, first.key, name, "ceiling")) if compared else "")
            cells.append(_ratio(ratio(summary, workload, first.key, name, "relay")) if compared else "")
            lines.append("| " + " | ".join(cells) + " |")
            if "error" in row:
                # The medians above are of the rounds that ran: say the others failed, and why.
                lines.append(f"| {name}: {row['failed']} round(s) failed | {row['error']} |" + " |" * (len(header) - 2))
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def targets(summary: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """Issue 6's targets for Relay: (target, measured, met); met is None when not measured."""

    def median(workload: str, key: str, name: str = "relay") -> float | None:
        try:
            return summary[workload][name][key]["median"]
        except KeyError:
            return None

    def failed(workload: str) -> int:
        return summary.get(workload, {}).get("relay", {}).get("failed", 0)

    checks: list[tuple[str, str, bool | None]] = []

    def check(target: str, workload: str, value: float | None, shown: str, met: bool) -> None:
        # A round Relay failed fails its target, whatever the rounds that ran measured.
        if failed(workload):
            measured = f"{shown}, {failed(workload)} round(s) failed" if value is not None else "failed"
            checks.append((target, measured, False))
        else:
            checks.append((target, "not measured" if value is None else shown, None if value is None else met))

    for workload, floor in (("W1", 0.6), ("W2", 0.9), ("W3", 0.8)):
        value = ratio(summary, workload, "rate", "relay", "ceiling")
        check(f"{workload} >= {floor}x ceiling", workload, value, f"{value or 0:.2f}x ceiling", (value or 0) >= floor)
    for key, limit in (("p50_ms", 2.0), ("p99_ms", 10.0)):
        value = median("W4", key)
        check(f"W4 {key[:3]} <= {limit:g} ms", "W4", value, f"{value or 0:.2f} ms", (value or 0) <= limit)
    value = median("W5", "flat")
    check("W5 largest table within 2x of smallest", "W5", value, f"{value or 0:.2f}x", (value or 0) <= 2.0)
    drift = median("W6", "drift")
    if drift is not None or failed("W6"):
        check("W6 throughput drift < 10%", "W6", drift, f"{drift or 0:.1f}%", abs(drift or 0) < 10)
        rss = median("W6", "rss_mb")
        check("W6 worker peak RSS < 80 MB", "W6", rss, f"{rss or 0:.0f} MB", (rss or 0) < 80)
    return checks


def targets_markdown(checks: list[tuple[str, str, bool | None]]) -> str:
    """The targets as a markdown table."""
    lines = ["| Relay target | measured | met |", "|---|---|---|"]
    for target, measured, met in checks:
        lines.append(f"| {target} | {measured} | {'-' if met is None else ('yes' if met else 'no')} |")
    return "\n".join(lines) + "\n"
