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


def test_the_enqueue_breakdown_runs_and_reports_every_part(database_url: str, python: str) -> None:
    scratch = f"relay_bench_enqueue_{uuid.uuid4().hex[:10]}"
    result = subprocess.run(
        [python, "bench/enqueue_breakdown.py", "--jobs", "20", "--rounds", "1", "--database", scratch],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in result.stdout.splitlines() if line.startswith("| ")}
    parts = ["ceiling", "jobs, no trigger", "jobs, counting trigger", "relay.jobs, NOTIFY", "Relay.enqueue"]
    assert [name for name in rows if name in parts] == parts
    assert rows["ceiling"].split(" | ")[2] == "1.00x"
    for name in parts:
        wall, ratio, cpu, wal = rows[name].rstrip(" |").split(" | ")[1:]
        assert float(wall.split()[0]) > 0 and float(ratio.rstrip("x")) > 0, rows[name]
        assert float(cpu) >= 0 and int(wal) > 0, rows[name]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (scratch,)).fetchone()[0] == 0
