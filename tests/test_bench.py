"""The benchmark must not rot: CI runs it once at its tiny --quick sizes.

Speed is judged from the full run's ratios (bench/README.md), never here; this
only proves every workload still runs end to end for Relay and the ceiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from .helpers import ROOT

pytestmark = pytest.mark.slow


def test_quick_benchmark_runs_every_workload(database_url: str, python: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            python,
            "bench/run.py",
            "--quick",
            "--only",
            "relay,ceiling",
            "--no-chart",
            "--dsn",
            database_url,
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "latest.json").read_text())["summary"]
    for workload in ("W1", "W2", "W3", "W4", "W5"):
        assert set(summary[workload]) == {"relay", "ceiling"}, workload
    assert summary["W1"]["relay"]["rate"]["median"] > 0


def test_the_harness_lets_a_contestant_script_wait_for_its_work_nearly_as_long_as_it_allows(tmp_path: Path) -> None:
    """Scripts waited 300 s whatever the workload's limit: a library draining 20,000 jobs at 54/s
    was reported FAILED although the harness would have waited 600 s for it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from harness import runner
        from harness.contestants import Contestant
    finally:
        sys.path.remove(str(ROOT / "bench"))
    echo = tmp_path / "echo.py"
    echo.write_text(
        "import json, sys\nprint(json.dumps({'timeout': float(sys.argv[sys.argv.index('--timeout') + 1])}))\n"
    )

    class Echo(Contestant):
        @property
        def script(self) -> Path:
            return echo

    waits = [runner.invoke(Echo("echo"), sys.executable, "", "W1", {}, limit, tmp_path / "log") for limit in (900, 60)]
    assert waits == [{"timeout": 840.0}, {"timeout": 30.0}]


def run_probe(python: str, database_url: str, script: str, *args: str) -> str:
    """Run the bench script ``script`` with ``args`` on a scratch database of its own; its output.

    Asserts it exited 0 and dropped its database.
    """
    scratch = f"relay_bench_{Path(script).stem}_{uuid.uuid4().hex[:10]}"
    result = subprocess.run(
        [python, script, *args, "--database", scratch],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (scratch,)).fetchone()[0] == 0
    return result.stdout


def test_the_enqueue_breakdown_runs_and_reports_every_part(database_url: str, python: str) -> None:
    output = run_probe(python, database_url, "bench/enqueue_breakdown.py", "--jobs", "20", "--rounds", "1")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in output.splitlines() if line.startswith("| ")}
    parts = [
        "ceiling",
        "jobs, no count",
        "jobs, statement trigger",
        "jobs, counted by the insert",
        "relay.jobs, NOTIFY",
        "Relay.enqueue",
    ]
    assert [name for name in rows if name in parts] == parts
    assert rows["ceiling"].split(" | ")[2] == "1.00x"
    for name in parts:
        wall, ratio, cpu, wal = rows[name].rstrip(" |").split(" | ")[1:]
        assert float(wall.split()[0]) > 0 and float(ratio.rstrip("x")) > 0, rows[name]
        assert float(cpu) >= 0 and int(wal) > 0, rows[name]


def test_the_concurrent_enqueue_bench_runs_and_reports_every_shape(database_url: str, python: str) -> None:
    output = run_probe(
        python, database_url, "bench/concurrent_enqueue.py", "--threads", "2", "--jobs", "10", "--rounds", "1"
    )
    rows = [line.rstrip(" |").split(" | ") for line in output.splitlines() if line[:3] in ("| 1", "| 2")]
    assert [(row[0].lstrip("| "), row[1]) for row in rows] == [("1", "yes"), ("1", "no"), ("2", "yes"), ("2", "no")]
    for row in rows:
        assert float(row[2].split()[0].replace(",", "")) > 0 and float(row[3].rstrip("x")) > 0, row
    assert [row[3] for row in rows if row[1] == "no"] == ["1.00x", "1.00x"]


def _harness(module: str):  # type: ignore[no-untyped-def]
    """A module of bench/harness (the bench is scripts, not a package Relay installs)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(f"harness.{module}", fromlist=[module])
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _rate_run(contestant: str, workload: str, value: float | None, error: str | None = None) -> dict:
    run = {"contestant": contestant, "workload": workload, "round": 1}
    return {**run, "error": error} if error else {**run, "result": {"value": value}}


def test_a_round_relay_failed_is_shown_and_fails_its_target() -> None:
    """The table showed the median of the rounds that ran, and the target was met, while a round
    Relay failed (its worker crashed) appeared nowhere but in the exit code and the JSON."""
    report = _harness("report")
    runs = [
        _rate_run("relay", "W1", 18_000.0),
        _rate_run("ceiling", "W1", 17_000.0),
        _rate_run("relay", "W1", None, error="the worker stopped after 0 of 20000 handlers started"),
        _rate_run("ceiling", "W1", 16_000.0),
    ]
    summary = report.summarize(runs)
    table = report.markdown(summary, runs, {"W1": "drain"}, ["relay", "ceiling"], {})
    assert "| relay: 1 round(s) failed | the worker stopped after 0 of 20000 handlers started |" in table
    (w1,) = [check for check in report.targets(summary) if check[0].startswith("W1")]
    assert w1[2] is False and "1 round(s) failed" in w1[1], w1


def test_an_unknown_workload_is_refused_with_a_message(python: str, database_url: str, tmp_path: Path) -> None:
    """W7 or W6 without --soak were dropped without a word: empty tables and exit code 1."""
    for given, said in (("W1,W7", "unknown workloads: W7"), ("W6", "W6, the soak, runs only with --soak")):
        result = subprocess.run(
            [python, "bench/run.py", "--workloads", given, "--dsn", database_url, "--out", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (result.returncode, said in result.stdout) == (2, True), result.stdout + result.stderr


def test_a_soak_too_short_for_a_drift_fails_rather_than_reading_as_none(python: str, database_url: str) -> None:
    """With one window after the warm-up (or none), W6 reported a drift of 0%, and its target read as met."""
    databases = _harness("databases")
    scratch = f"relay_bench_soak_{uuid.uuid4().hex[:10]}"
    dsn = databases.create(database_url, scratch)
    try:
        script = str(ROOT / "bench" / "contestants" / "ceiling.py")
        common = ["--dsn", dsn, "--concurrency", "1"]
        subprocess.run([python, script, "--workload", "setup", *common], check=True, timeout=60)
        result = subprocess.run(
            [python, script, "--workload", "W6", "--duration", "1", "--window", "0.5", "--rate", "50", *common],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        databases.drop(database_url, scratch)
    assert result.returncode != 0 and result.stdout == "", result.stdout
    assert "W6 cannot tell a drift" in result.stderr and "--duration at least 3 x --window" in result.stderr
