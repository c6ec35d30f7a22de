"""Settings shared by the dashboard tests' fixtures."""

from __future__ import annotations

from typing import Any

SECRET = "relay-dashboard-test-key-" + "k" * 32
FAST_HASH = {"RELAY_ARGON2_TIME_COST": 1, "RELAY_ARGON2_MEMORY_COST": 1024, "RELAY_ARGON2_PARALLELISM": 1}
PASSWORD = "correct horse battery"


def base_config(dsn: str, **overrides: Any) -> dict[str, Any]:
    """Settings of a test app: explicit, never from the environment; cheap password hashing."""
    return {"TESTING": True, "RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, **FAST_HASH, **overrides}
