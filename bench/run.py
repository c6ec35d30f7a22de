"""Relay's side-by-side benchmark: one command, every contestant, interleaved rounds.

    python bench/run.py                    # full run: every contestant, W1-W5
    python bench/run.py --quick --only relay,ceiling   # tiny sizes, no peer venvs (CI)
    python bench/run.py --soak             # adds W6, the 10-minute soak

Run it with Relay's virtualenv (Relay and the ceiling use that interpreter);
each peer gets its own virtualenv under bench/.venvs from its pinned
requirements. Every run uses a fresh database cloned from the contestant's
template, rounds are interleaved (A B C ... A B C) so a noisy machine hurts
everyone alike, and the results go to bench/results/latest.json, a chart
bench/results/latest.png (when the tools venv is there) and a markdown table
on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import databases, report, runner, venvs
from harness.contestants import BENCH, Contestant, select
from harness.plan import ROUNDED, workloads

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
#: Part of every database name, so two harness runs on one server never drop each other's databases.
RUN_ID = str(os.getpid())


def parse_args() -> argparse.Namespace:
    """The harness's command line."""
    parser = argparse.ArgumentParser(description="Benchmark Relay against the Python PostgreSQL queues.")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (for CI)")
    parser.add_argument("--only", help="comma-separated contestants (default: all)")
    parser.add_argument("--workloads", help="comma-separated workloads (default: W1-W5, plus W6 with --soak)")
    parser.add_argument("--soak", action="store_true", help="also run W6, the 10-minute soak")
    parser.add_argument("--rounds", type=int, help="rounds of W1-W4 (default 3, 1 with --quick)")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("BENCH_DATABASE_URL") or os.environ.get("DATABASE_URL") or DEFAULT_DSN,
        help="any database on the server, for CREATE/DROP DATABASE (env BENCH_DATABASE_URL, else DATABASE_URL)",
    )
    parser.add_argument(
        "--out", help="where latest.json and latest.png go (default bench/results, bench/results/quick with --quick)"
    )
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG (and the tools venv)")
    return parser.parse_args()


def git_commit() -> str:
    """The commit of the checkout being measured, marked when the tree has changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "relay_core"], capture_output=True, text=True, cwd=BENCH.parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+local changes" if dirty else "")


def prepare(
    contestants: list[Contestant], admin: str, log: Path
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Venvs and template databases: (python by name, template by name, unavailable reason by name)."""
    pythons: dict[str, str] = {}
    templates: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    for contestant in contestants:
        try:
            print(f"preparing {contestant.name} ...", flush=True)
            python = venvs.ensure(contestant, log)
        except venvs.NotRunnable as exc:
            unavailable[contestant.name] = str(exc)
            print(f"  {contestant.name}: {exc}", flush=True)
            continue
        template = f"{databases.PREFIX}{RUN_ID}_{contestant.name}_tpl"
        dsn = databases.create(admin, template)
        result = runner.invoke(contestant, python, dsn, "setup", {}, 300, log)
        if "error" in result:
            unavailable[contestant.name] = f"schema setup failed: {result['error']}"
            databases.drop(admin, template)
            continue
        pythons[contestant.name] = python
        templates[contestant.name] = template
    return pythons, templates, unavailable


def run_once(
    contestant: Contestant,
    python: str,
    admin: str,
    template: str,
    workload: Any,
    round_no: int,
    log: Path,
) -> dict[str, Any]:
    """One workload in a fresh clone of the contestant's template database."""
    name = f"{databases.PREFIX}{RUN_ID}_{contestant.name}"
    dsn = databases.create(admin, name, template=template)
    started = time.monotonic()
    try:
        result = runner.invoke(contestant, python, dsn, workload.id, workload.args, workload.timeout, log, workload.env)
    finally:
        databases.drop(admin, name)
    run = {"contestant": contestant.name, "workload": workload.id, "round": round_no}
    if "error" in result:
        run["error"] = result["error"]
        print(f"  {workload.id} {contestant.name:<14} FAILED: {result['error']}", flush=True)
    else:
        run["result"] = result
        shown = result.get("value")
        print(
            f"  {workload.id} {contestant.name:<14} {shown:,.2f} {result.get('unit', '')}"
            f"  ({time.monotonic() - started:.1f}s)",
            flush=True,
        )
    return run


def main() -> int:
    """Prepare, run the rounds, report."""
    args = parse_args()
    contestants = select(args.only)
    plan = workloads(args.quick, args.soak)
    if args.workloads:
        wanted = {w.strip().upper() for w in args.workloads.split(",") if w.strip()}
        known = {w.id for w in workloads(args.quick, soak=True)}
        if wanted - known:
            print(f"unknown workloads: {', '.join(sorted(wanted - known))} (known: {', '.join(sorted(known))})")
            return 2
        if "W6" in wanted and not args.soak:
            print("W6, the soak, runs only with --soak")
            return 2
        plan = [w for w in plan if w.id in wanted]
    rounds = args.rounds or (1 if args.quick else 3)
    out = Path(args.out or (BENCH / "results" / "quick" if args.quick else BENCH / "results"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "latest.log"
    log.write_text("")
    started = time.strftime("%Y-%m-%d %H:%M")
    commit = git_commit()  # taken first: the checkout may move while the bench runs

    pythons, templates, unavailable = prepare(contestants, args.dsn, log)
    runs: list[dict[str, Any]] = []
    try:
        for round_no in range(1, rounds + 1):
            print(f"round {round_no}/{rounds}", flush=True)
            for workload in (w for w in plan if w.id in ROUNDED):
                for contestant in contestants:
                    if contestant.name in pythons:
                        python, template = pythons[contestant.name], templates[contestant.name]
                        runs.append(run_once(contestant, python, args.dsn, template, workload, round_no, log))
        for workload in (w for w in plan if w.id not in ROUNDED):
            print(workload.id, flush=True)
            for contestant in contestants:
                if contestant.name in pythons:
                    python, template = pythons[contestant.name], templates[contestant.name]
                    runs.append(run_once(contestant, python, args.dsn, template, workload, 1, log))
    finally:
        for template in templates.values():
            databases.drop(args.dsn, template)

    summary = report.summarize(runs)
    order = [c.name for c in contestants]
    titles = {w.id: w.title for w in plan}
    table = report.markdown(summary, runs, titles, order, unavailable)
    checks = report.targets(summary)
    results = {
        "meta": {
            "started": started,
            "mode": "quick" if args.quick else "full",
            "rounds": rounds,
            "machine": f"{os.cpu_count()} cores, {platform.machine()}",
            "python": platform.python_version(),
            "postgres": databases.server_version(args.dsn),
            "server": databases.describe(args.dsn),
            "relay_commit": commit,
            "workloads": {w.id: {"title": w.title, "args": w.args} for w in plan},
        },
        "order": order,
        "unavailable": unavailable,
        "summary": summary,
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in checks],
        "runs": runs,
    }
    (out / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "latest.md").write_text(table + "\n" + report.targets_markdown(checks))
    print()
    print(table)
    print(report.targets_markdown(checks))
    if not args.no_chart:
        draw_chart(out, log, install=not args.quick)
    failed = [r for r in runs if "error" in r]
    return 1 if failed or not runs else 0


def draw_chart(out: Path, log: Path, install: bool) -> None:
    """latest.png through the tools venv (installed on full runs; skipped quietly when absent)."""
    python = venvs.tools_python(log, install=install)
    if python is None:
        print("chart skipped: no tools venv (a full run creates it)")
        return
    chart = Path(__file__).resolve().parent / "harness" / "chart.py"
    done = subprocess.run(
        [python, str(chart), str(out / "latest.json"), str(out / "latest.png")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode == 0:
        print(f"wrote {out / 'latest.json'} and {out / 'latest.png'}")
    else:
        print(f"chart failed: {done.stderr.strip()[-500:]}")


if __name__ == "__main__":
    sys.exit(main())
