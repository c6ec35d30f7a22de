"""Loads the ``sql/*.sql`` files once into named statements.

Relay's statements on its tables live in those files: ``queries.sql`` holds
the queue's hot path (the claim query among it) so a reader finds it in one
step; the admin surface's reads live beside it. Outside them: the migrations
(``migrations/*.sql``, and the migrator's own bootstrap before its table
exists), session and transaction control (``SET``, ``BEGIN``/``COMMIT``,
``LISTEN``) and catalog checks such as ``to_regclass``. This module only
parses the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$")
_TRANSITION = re.compile(r"^-- transition: (\S+) -> (.+)$")


@dataclass(frozen=True)
class Query:
    """One named statement, with the status transitions it declares."""

    name: str
    description: str
    sql: str
    transitions: tuple[tuple[str, str], ...]


def parse(text: str) -> dict[str, Query]:
    """Split a queries file into :class:`Query` objects by ``-- name:`` header."""
    queries: dict[str, Query] = {}
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            blocks.append((match.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    for name, lines in blocks:
        comments = [ln for ln in lines if ln.startswith("--")]
        body = "\n".join(ln for ln in lines if not ln.startswith("--")).strip().rstrip(";")
        transitions: list[tuple[str, str]] = []
        for comment in comments:
            match = _TRANSITION.match(comment)
            if match:
                for target in match.group(2).split(","):
                    transitions.append((match.group(1), target.strip()))
        description = comments[0][2:].strip() if comments else ""
        if name in queries:
            raise ValueError(f"query {name} is defined twice")
        queries[name] = Query(name, description, body, tuple(transitions))
    return queries


def _load() -> dict[str, Query]:
    """Every ``sql/*.sql`` file of the package; a name may be defined only once."""
    queries: dict[str, Query] = {}
    folder = resources.files("relay_core").joinpath("sql")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, query in parse(entry.read_text(encoding="utf-8")).items():
            if name in queries:
                raise ValueError(f"query {name} is defined in two files")
            queries[name] = query
    return queries


QUERIES: dict[str, Query] = _load()


def sql(name: str) -> str:
    """The text of the statement called ``name``."""
    return QUERIES[name].sql
