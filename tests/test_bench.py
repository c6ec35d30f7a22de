"""The benchmark must not rot: CI runs it once at its tiny --quick sizes.

Speed is judged from the full run's ratios (bench/README.md), never here; this
only proves every workload still runs end to end for Relay and the ceiling.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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
