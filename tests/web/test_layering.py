"""Dependencies point one way: relay_web uses relay_core's public surface; relay_core knows no Flask."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What relay_web may import from relay_core (validation: the input rules both share, such as what a job id is;
#: pools: the connection pool that reconnects at a capped pace after an outage; connect_options: the time
#: limits on a silent network path every connection gets; sessions: the session settings, and autocommit for
#: a block; jsonb: how a connection reads numbers too long for int; timestamps: how it reads times no
#: datetime holds; outages: one log line per outage rather than one per request that met it).
ALLOWED = {
    "relay_core",
    "relay_core.admin",
    "relay_core.connect_options",
    "relay_core.jsonb",
    "relay_core.monitor",
    "relay_core.outages",
    "relay_core.pools",
    "relay_core.sessions",
    "relay_core.timestamps",
    "relay_core.users",
    "relay_core.validation",
}


def _imports(folder: str) -> dict[str, set[str]]:
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        names = set(re.findall(r"^\s*from\s+([\w.]+)\s+import|^\s*import\s+([\w.]+)", text, re.M))
        found[str(path.relative_to(ROOT))] = {a or b for a, b in names}
    return found


def test_relay_web_uses_only_relay_cores_public_modules() -> None:
    for path, modules in _imports("relay_web").items():
        core = {m for m in modules if m.split(".")[0] == "relay_core"}
        assert core <= ALLOWED, f"{path} imports {sorted(core - ALLOWED)}"


def test_relay_core_never_imports_flask() -> None:
    for path, modules in _imports("relay_core").items():
        web = {m for m in modules if m.split(".")[0] in {"flask", "flask_jwt_extended", "werkzeug", "relay_web"}}
        assert not web, f"{path} imports {sorted(web)}"


def test_no_job_sql_in_relay_web() -> None:
    for path in (ROOT / "relay_web").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b(FROM|UPDATE|INTO)\s+relay\.", text, re.IGNORECASE), path
