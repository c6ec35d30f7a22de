"""The Grafana dashboard draws only series that /metrics really exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from relay_core import Relay

from .states import make_dead

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "relay-dashboard.json"


def test_dashboard_series_exist(client, relay: Relay, db) -> None:
    make_dead(db, relay.enqueue("send_email", {}))
    exposed = set(re.findall(r"^(relay_\w+?)(?:\{| )", client.get("/metrics").get_data(as_text=True), re.M))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"relay_\w+", expr)}
    assert used, "the dashboard draws nothing"
    assert used <= exposed, f"not exposed by /metrics: {sorted(used - exposed)}"
    assert {"relay_jobs", "relay_queue_oldest_job_age_seconds", "relay_workers_alive"} <= used
