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


def test_every_series_is_read_from_the_chosen_deployment_only() -> None:
    """Each panel takes the highest value across the web processes that report one database; with a
    staging and a production Relay scraped into one Prometheus, that was the highest of the two."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["job"]["query"]["query"] == "label_values(relay_workers_alive, job)"
    assert not variables["job"]["includeAll"] and not variables["job"]["multi"]
    assert '{job=~"$job"}' in variables["queue"]["query"]["query"]
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    selectors = [m for expr in exprs for m in re.finditer(r"relay_\w+(\{[^}]*\})?", expr)]
    assert selectors
    unfiltered = [m.group(0) for m in selectors if 'job=~"$job"' not in (m.group(1) or "")]
    assert not unfiltered, f"series read from every deployment: {unfiltered}"


def test_the_deployment_choice_lists_a_database_with_no_jobs(client) -> None:
    """Read from relay_jobs, which has no sample while no queue holds a job, the choice of deployment was
    empty on a new or fully pruned database, and every panel, the workers' too, showed no data."""
    exposed = client.get("/metrics").get_data(as_text=True)
    assert not re.search(r"^relay_jobs\{", exposed, re.M)  # no job anywhere
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = re.fullmatch(r"label_values\((relay_\w+), job\)", variables["job"]["query"]["query"])
    assert source is not None
    assert re.search(rf"^{source[1]}(\{{| )", exposed, re.M), f"{source[1]} has no sample"
