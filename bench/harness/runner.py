"""Runs one contestant script once and reads back its one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from .contestants import Contestant

#: Of a workload's time limit, what the script keeps for starting up, stopping its worker and
#: reporting: the rest is how long it waits for the work, so a slow library is measured, not
#: cut short by the script's own shorter default.
SCRIPT_MARGIN_SECONDS = 60.0


def script_wait(timeout: float) -> float:
    """How long a contestant script may wait for its work within the harness's ``timeout``."""
    return max(timeout - SCRIPT_MARGIN_SECONDS, timeout / 2)


def invoke(
    contestant: Contestant,
    python: str,
    dsn: str,
    workload: str,
    args: dict[str, object],
    timeout: float,
    log: Path,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``workload`` and return its result; on failure a dict with ``error``.

    The script's stderr goes to ``log``, so a failure can be read in full
    while the table shows only that it happened.
    """
    command = [
        python,
        str(contestant.script),
        "--dsn",
        dsn,
        "--workload",
        workload,
        "--timeout",
        f"{script_wait(timeout):g}",
    ]
    for key, value in args.items():
        command += [f"--{key}", str(value)]
    started = time.monotonic()
    with log.open("a") as err:
        err.write(f"\n== {contestant.name} {workload} {args}\n")
        err.flush()
        try:
            done = subprocess.run(
                command,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=timeout,
                check=False,
                env={**os.environ, **(env or {})},
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f}s"}
    if done.returncode != 0:
        return {"error": f"exit code {done.returncode} after {time.monotonic() - started:.1f}s (see {log.name})"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": "no result line"}
    return json.loads(lines[-1])
