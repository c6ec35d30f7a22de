"""Who takes part: each contestant's script, pinned requirements and Python floor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Contestant:
    """One queue library (or the ceiling) and how to run its script.

    ``requirements`` is None for the contestants that run on the interpreter
    running the harness (Relay from its own checkout, and the ceiling, which
    needs only psycopg); every peer gets its own virtualenv from its pins.
    """

    name: str
    requirements: str | None = None
    min_python: tuple[int, int] = (3, 11)

    @property
    def script(self) -> Path:
        """The contestant's script under ``bench/contestants``."""
        return BENCH / "contestants" / f"{self.name}.py"

    @property
    def requirements_file(self) -> Path | None:
        """The pinned requirements of its virtualenv, if it has one."""
        return BENCH / "requirements" / self.requirements if self.requirements else None


ALL = (
    Contestant("relay"),
    Contestant("ceiling"),
    Contestant("procrastinate", "procrastinate.txt"),
    Contestant("pgqueuer", "pgqueuer.txt"),
    Contestant("chancy", "chancy.txt"),
    Contestant("oban", "oban.txt", min_python=(3, 12)),
)

BY_NAME = {c.name: c for c in ALL}


def select(only: str | None) -> list[Contestant]:
    """The contestants named in ``--only`` (comma-separated), in the standard order."""
    if not only:
        return list(ALL)
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown contestants {unknown}; choose from {', '.join(BY_NAME)}")
    return [c for c in ALL if c.name in wanted]
