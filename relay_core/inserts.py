"""What an enqueue sends to the database, written once for sync and async connections.

An enqueue is one INSERT, but around it sit decisions that need the
database's answer: the ``max_attempts`` workers published for a type, a keyed
insert that conflicted (return the holder's id, or insert again when the
holder was pruned in between), the ids of a bulk insert in input order. Each
is written here once, as a generator that yields the statement it needs and
receives that statement's answer; ``connections.run`` sends the statements on
a sync connection and ``connections.run_async`` on an async one, so
``enqueue`` and ``enqueue_async`` cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .errors import RelayError
from .queries import sql
from .validation import MAX_PAYLOAD_BYTES_LIMIT, NewJob

#: Bulk payloads whose JSON array, commas included, is up to this many characters
#: travel as that one document; larger bulk enqueues use the array form. jsonb
#: tops out at 256 MiB, and JSON text can take six times its size as jsonb (see
#: MAX_PAYLOAD_BYTES_LIMIT): at 64 MiB, 300 payloads of 200 kB ([0,0,...]) were
#: refused by the database.
ALIKE_MAX_PAYLOAD_CHARS = MAX_PAYLOAD_BYTES_LIMIT
#: Tries of a keyed insert whose conflicting holder keeps vanishing before it is read.
KEY_RACE_ATTEMPTS = 3

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement an enqueue needs run, by its name in ``queries``; its answer is the rows as
    dicts, or only the first column of the first row (None without a row) with ``first_value``."""

    name: str
    params: dict[str, Any]
    first_value: bool = False

    @property
    def sql(self) -> str:
        """The statement's text."""
        return sql(self.name)


#: Yields the statements to run, receives each one's answer, returns the enqueue's result.
Steps = Generator[Statement, Any, T]


def enqueue_one(job: NewJob, unresolved: bool, notify: bool) -> Steps[int]:
    """One job, taking its published ``max_attempts`` if ``unresolved``; its id.

    The insert reads what was published itself: one statement, so an enqueue
    from a Relay without the type's handler costs no more round trips than
    one with it.
    """
    return (yield from insert_one(job, notify, published=unresolved))


def enqueue_many(jobs: list[NewJob], unresolved: list[bool], notify: bool) -> Steps[list[int]]:
    """Many jobs: one lookup for all the unresolved types, then one insert; their ids in input order."""
    jobs = yield from with_published(jobs, unresolved)
    return (yield from insert_many(jobs, notify))


def with_published(jobs: list[NewJob], unresolved: list[bool]) -> Steps[list[NewJob]]:
    """``jobs`` where each ``unresolved`` one takes the max_attempts workers published for its type.

    One statement for all the types, on the connection of the insert that
    follows (a caller's ``conn``: in its transaction); a type nothing was
    published for keeps the default it was validated with.
    """
    types = sorted({job.type for job, open_ in zip(jobs, unresolved, strict=True) if open_})
    if not types:
        return jobs
    rows = yield Statement("job_type_max_attempts_many", {"types": types})
    published = {row["type"]: row["max_attempts"] for row in rows}
    return [
        replace(job, max_attempts=published[job.type]) if open_ and job.type in published else job
        for job, open_ in zip(jobs, unresolved, strict=True)
    ]


def insert_one(job: NewJob, notify: bool, published: bool = False) -> Steps[int]:
    """Insert one job; with an idempotency key already held, the holder's id instead.

    ``published``: the job takes the max_attempts workers published for its
    type, where there is one, instead of its own.
    """
    params = job.params()
    params["notify"] = notify
    params["published"] = published
    if job.idempotency_key is None:
        return (yield Statement("job_insert", params, first_value=True))
    for _ in range(KEY_RACE_ATTEMPTS):
        job_id = yield Statement("job_insert_keyed", params, first_value=True)
        if job_id is not None:
            return job_id
        lookup = {"idempotency_key": job.idempotency_key}
        existing = yield Statement("job_id_by_idempotency_key", lookup, first_value=True)
        if existing is not None:
            return existing
        # The holder was deleted (pruned) between the two statements: the key is free again.
    raise RelayError(f"idempotency key {job.idempotency_key!r} conflicted but its job vanished; retry")


def insert_many(jobs: list[NewJob], notify: bool) -> Steps[list[int]]:
    """Insert many jobs in one statement; their ids (or their keys' holders') in input order."""
    first = jobs[0]
    document_chars = sum(len(j.payload_json) for j in jobs) + len(jobs) + 1  # with its commas and brackets
    if document_chars < ALIKE_MAX_PAYLOAD_CHARS and all(
        j.type == first.type
        and j.queue == first.queue
        and j.priority == first.priority
        and j.run_at == first.run_at
        and j.max_attempts == first.max_attempts
        and j.idempotency_key is None
        for j in jobs
    ):
        alike = {
            "type": first.type,
            "queue": first.queue,
            "priority": first.priority,
            "run_at": first.run_at,
            "max_attempts": first.max_attempts,
            "payloads": "[" + ",".join(j.payload_json for j in jobs) + "]",
            "notify": notify,
        }
        return list((yield Statement("job_insert_many_alike", alike))[0]["ids"])
    params = {
        "types": [j.type for j in jobs],
        "payloads": [j.payload_json for j in jobs],
        "queues": [j.queue for j in jobs],
        "priorities": [j.priority for j in jobs],
        "run_ats": [j.run_at for j in jobs],
        "max_attempts": [j.max_attempts for j in jobs],
        "idempotency_keys": [j.idempotency_key for j in jobs],
        "notify": notify,
    }
    row = (yield Statement("job_insert_many", params))[0]
    # Jobs without a key were inserted first, in input order: their ids ascend with
    # their positions. A job with a key gets its key's job: the one inserted now
    # (a key repeated within one call resolves to that same job) or its holder.
    unkeyed_ids: list[int] = []
    by_key: dict[str, int] = {}
    for job_id, key in zip(row["ids"], row["keys"], strict=True):
        if key is None:
            unkeyed_ids.append(job_id)
        else:
            by_key[key] = job_id
    conflicted = sorted({j.idempotency_key for j in jobs if j.idempotency_key and j.idempotency_key not in by_key})
    if conflicted:
        holders = yield Statement("job_ids_by_idempotency_keys", {"idempotency_keys": conflicted})
        for found in holders:
            by_key[found["idempotency_key"]] = found["id"]
    for key in conflicted:
        if key not in by_key:  # its holder was deleted between the two statements: insert it now
            by_key[key] = yield from insert_one(next(j for j in jobs if j.idempotency_key == key), notify)
    fresh = iter(unkeyed_ids)
    return [next(fresh) if job.idempotency_key is None else by_key[job.idempotency_key] for job in jobs]
