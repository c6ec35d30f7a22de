"""The jobs endpoints: listing, one job, requeue, cancel, bulk actions and enqueue."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from urllib.parse import quote

import psycopg
import pytest
from psycopg.types.json import Jsonb

from relay_core import Relay
from relay_core.validation import QUEUE_NAME
from relay_web.errors import FILTERED_ENDPOINTS

from ..helpers import publish_handlers, wait_for
from .conftest import AuthActions
from .helpers import assert_problem
from .states import make_claimed, make_dead, make_succeeded

#: Strings that would break a query built by concatenation, or a LIKE pattern.
NASTY = [
    "'; DROP TABLE relay.jobs; --",
    '" OR 1=1 --',
    "%",
    "_",
    "\\",
    "a' OR 'a'='a",
    "$1",
    "%(status)s",
    "));",
    "é😀",
]


def _ids(response) -> list[int]:
    assert response.status_code == 200, response.get_json()
    return [job["id"] for job in response.get_json()["jobs"]]


def test_list_is_newest_first_with_filters(client, admin, relay: Relay, db: psycopg.Connection) -> None:
    a = relay.enqueue("send_email", {"n": 1})
    b = relay.enqueue("resize_image", {"n": 2}, queue="media")
    c = relay.enqueue("send_email", {"n": 3}, queue="media")
    make_dead(db, a, "SMTP timeout talking to mx.example.com")
    assert _ids(client.get("/api/admin/jobs", headers=admin)) == [c, b, a]
    assert _ids(client.get("/api/admin/jobs?status=dead", headers=admin)) == [a]
    assert _ids(client.get("/api/admin/jobs?queue=media", headers=admin)) == [c, b]
    assert _ids(client.get("/api/admin/jobs?type=send_email", headers=admin)) == [c, a]
    assert _ids(client.get("/api/admin/jobs?q=smtp", headers=admin)) == [a]
    assert _ids(client.get("/api/admin/jobs?q=RESIZE", headers=admin)) == [b]
    assert _ids(client.get("/api/admin/jobs?type=send_email&queue=media&status=queued", headers=admin)) == [c]
    row = client.get("/api/admin/jobs?status=dead", headers=admin).get_json()["jobs"][0]
    assert row["last_error"] == "SMTP timeout talking to mx.example.com" and row["attempts"] == 1


def test_keyset_pages_are_stable_under_inserts(client, admin, relay: Relay) -> None:
    ids = relay.enqueue_many([{"type": "t", "payload": {"i": i}} for i in range(7)])
    first = client.get("/api/admin/jobs?limit=3", headers=admin).get_json()
    assert [j["id"] for j in first["jobs"]] == ids[::-1][:3]
    relay.enqueue_many([{"type": "t"} for _ in range(5)])  # arrive between page reads
    second = client.get(f"/api/admin/jobs?limit=3&cursor={first['next_cursor']}", headers=admin).get_json()
    third = client.get(f"/api/admin/jobs?limit=3&cursor={second['next_cursor']}", headers=admin).get_json()
    assert [j["id"] for j in second["jobs"]] == ids[::-1][3:6]
    assert [j["id"] for j in third["jobs"]] == ids[::-1][6:]
    assert third["next_cursor"] is None


def test_default_and_maximum_page_size(client, admin, relay: Relay) -> None:
    relay.enqueue_many([{"type": "t"} for _ in range(205)])
    assert len(_ids(client.get("/api/admin/jobs", headers=admin))) == 50
    assert len(_ids(client.get("/api/admin/jobs?limit=200", headers=admin))) == 200
    for limit in ("1000000000", "201", "0", "-5", "ten", "1e3", "%20", "99999999999999999999999"):
        body = assert_problem(client.get(f"/api/admin/jobs?limit={limit}", headers=admin), 422, "validation")
        assert [e["field"] for e in body["errors"]] == ["limit"]


@pytest.mark.parametrize("value", NASTY)
def test_sql_metacharacters_in_every_filter_are_plain_data(client, admin, relay: Relay, db, value: str) -> None:
    plain = relay.enqueue("plain", {})
    tricky = relay.enqueue(f"type{value}", {})
    make_dead(db, tricky, f"error with {value} inside")
    quoted = quote(value, safe="")
    assert _ids(client.get(f"/api/admin/jobs?type={quote('type' + value, safe='')}", headers=admin)) == [tricky]
    assert _ids(client.get(f"/api/admin/jobs?q={quoted}", headers=admin)) == [tricky]
    assert _ids(client.get(f"/api/admin/jobs?type={quoted}", headers=admin)) == []
    for name in ("status", "cursor", "limit"):
        assert_problem(client.get(f"/api/admin/jobs?{name}={quoted}", headers=admin), 422, "validation")
    valid_queue = bool(QUEUE_NAME.match(value))  # "_" is a fine queue name
    if valid_queue:
        assert _ids(client.get(f"/api/admin/jobs?queue={quoted}", headers=admin)) == []
    else:
        assert_problem(client.get(f"/api/admin/jobs?queue={quoted}", headers=admin), 422, "validation")
    for path in ("/api/admin/jobs/requeue", "/api/admin/jobs/cancel"):
        assert client.post(path, headers=admin, json={"type": value}).get_json()["changed"] == 0
        assert client.post(path, headers=admin, json={"q": "nothing" + value}).get_json()["changed"] == 0
        response = client.post(path, headers=admin, json={"queue": value})
        if valid_queue:
            assert response.get_json()["changed"] == 0
        else:
            assert_problem(response, 422)
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 2
    assert relay.get_job(plain).status == "queued"


def test_nul_characters_are_refused_not_sent_to_the_database(client, admin) -> None:
    for name in ("type", "q"):
        assert_problem(client.get(f"/api/admin/jobs?{name}=a%00b", headers=admin), 422, "validation")
    assert_problem(client.post("/api/admin/jobs/requeue", headers=admin, json={"type": "a\u0000b"}), 422)
    assert_problem(client.post("/api/admin/jobs", headers=admin, json={"type": "a\u0000b"}), 422)


def test_an_empty_listing_parameter_is_as_if_not_given(client, admin, relay: Relay, db: psycopg.Connection) -> None:
    """DESIGN.md's listing, ``?status=dead&queue=&type=&limit=&cursor=``, was refused: 422 naming
    four parameters. A script or form sends every parameter it knows of, filled in or not."""
    relay.enqueue("send_email")
    dead = relay.enqueue("send_email")
    make_dead(db, dead, "SMTP timeout")
    assert _ids(client.get("/api/admin/jobs?status=dead&queue=&type=&limit=&cursor=", headers=admin)) == [dead]
    assert len(_ids(client.get("/api/admin/jobs?status=&q=&limit=", headers=admin))) == 2
    # Given twice, even empty, is still refused, as is an unknown one; and an action's parameter
    # is not widened to none.
    assert_problem(client.get("/api/admin/jobs?queue=&queue=", headers=admin), 422, "validation")
    for unknown in ("stauts=", "dead"):
        body = assert_problem(client.get(f"/api/admin/jobs?{unknown}", headers=admin), 422, "validation")
        assert [e["field"] for e in body["errors"]] == [unknown.rstrip("=")]
    body = assert_problem(client.post(f"/api/admin/jobs/{dead}/requeue?seen_lease_token=", headers=admin), 422)
    assert [e["field"] for e in body["errors"]] == ["seen_lease_token"]
    assert relay.get_job(dead).status == "dead"


@pytest.mark.parametrize("query", ["type=%ff", "q=%ff%fe", "queue=%c3", "status=dead&%ff=1"])
def test_a_query_string_that_is_not_utf8_is_refused(client, admin, relay: Relay, query: str) -> None:
    """It was read with U+FFFD in place of the bytes: ``?type=%ff`` answered an empty page."""
    relay.enqueue("send_email")
    body = assert_problem(client.get(f"/api/admin/jobs?{query}", headers=admin), 422, "validation")
    assert body["errors"] == [{"field": "query", "in": "query", "detail": "is not valid UTF-8 once percent-decoded"}]
    body = assert_problem(client.get(f"/api/admin/queues?{query}", headers=admin), 422, "validation")
    assert [e["field"] for e in body["errors"]] == ["query"]  # not the parameter read as U+FFFD
    assert _ids(client.get("/api/admin/jobs?type=%C3%A9", headers=admin)) == []  # é, well-formed


def test_unknown_and_repeated_parameters_are_refused(client, admin) -> None:
    body = assert_problem(client.get("/api/admin/jobs?stauts=dead", headers=admin), 422, "validation")
    assert body["errors"] == [{"field": "stauts", "in": "query", "detail": "is not a known field"}]
    body = assert_problem(client.get("/api/admin/jobs?status=dead&status=queued", headers=admin), 422)
    assert body["errors"][0]["field"] == "status"
    assert_problem(client.get("/api/admin/queues?x=1", headers=admin), 422)
    assert_problem(client.get("/api/admin/jobs?status=exploded", headers=admin), 422)


@pytest.mark.parametrize("job_id", ["-1", "0", "abc", "1.5", "9223372036854775808", "99999999999999999999", "1e3"])
def test_bad_job_ids_are_422(client, admin, job_id: str) -> None:
    body = assert_problem(client.get(f"/api/admin/jobs/{job_id}", headers=admin), 422, "validation")
    assert body["errors"][0] == {"field": "job_id", "in": "path", "detail": body["errors"][0]["detail"]}
    assert_problem(client.post(f"/api/admin/jobs/{job_id}/requeue", headers=admin), 422)


#: Spellings Python's int() and pydantic's lax mode read as a number, but Relay never writes.
NON_CANONICAL_22 = ["2_2", "22.0", "%20%2022", "22%20", "+22", "022", "%D9%A2%D9%A2", "%EF%BC%92%EF%BC%92", "22e0"]


@pytest.mark.parametrize("job_id", NON_CANONICAL_22)
def test_non_canonical_job_ids_are_422_and_touch_no_job(client, admin, relay: Relay, db, job_id: str) -> None:
    ids = relay.enqueue_many([{"type": "t"} for _ in range(22)])
    assert ids[-1] == 22
    for method, path in (("get", ""), ("post", "/cancel"), ("post", "/requeue")):
        response = getattr(client, method)(f"/api/admin/jobs/{job_id}{path}", headers=admin)
        body = assert_problem(response, 422, "validation")
        assert [(e["field"], e["in"]) for e in body["errors"]] == [("job_id", "path")], body
    make_dead(db, 22)
    assert_problem(client.post(f"/api/admin/jobs/{job_id}/requeue", headers=admin), 422, "validation")
    assert relay.get_job(22).status == "dead"
    assert client.get("/api/admin/jobs/22", headers=admin).get_json()["id"] == 22


@pytest.mark.parametrize("limit", ["1_0", "10.0", "%2010", "+10", "010", "%D9%A1%D9%A0", "1" + "0" * 5000])
def test_page_sizes_must_be_written_canonically(client, admin, limit: str) -> None:
    body = assert_problem(client.get(f"/api/admin/jobs?limit={limit}", headers=admin), 422, "validation")
    assert [e["field"] for e in body["errors"]] == ["limit"]


def test_unknown_job_is_404(client, admin) -> None:
    body = assert_problem(client.get("/api/admin/jobs/9223372036854775807", headers=admin), 404, "job-not-found")
    assert "9223372036854775807" in body["detail"]
    assert_problem(client.post("/api/admin/jobs/424242/requeue", headers=admin), 404, "job-not-found")
    assert_problem(client.post("/api/admin/jobs/424242/cancel", headers=admin), 404, "job-not-found")


def test_one_job_has_payload_history_lease_and_timings(client, admin, relay: Relay, db) -> None:
    job_id = relay.enqueue("send_email", {"to": "a@b.c", "html": "<script>x</script>"}, idempotency_key="k-1")
    make_dead(db, job_id, "SMTP 554 rejected", attempts=3)
    job = client.get(f"/api/admin/jobs/{job_id}", headers=admin).get_json()
    assert job["payload"] == {"to": "a@b.c", "html": "<script>x</script>"}
    assert job["status"] == "dead" and job["attempts"] == 3 and job["max_attempts"] == 20
    assert job["last_error"] == "SMTP 554 rejected" and job["idempotency_key"] == "k-1"
    assert [e["attempt"] for e in job["errors"]] == [1, 2, 3]
    assert job["errors"][0]["type"] == "ValueError" and job["errors"][0]["worker"] == "w1"
    assert job["claimed_by"] == "w1" and job["finished_at"] is not None and job["started_at"] is not None
    assert {"lease_token", "claimed_until", "run_at", "created_at", "progress", "result"} <= set(job)


def test_requeue_dead_job_resets_attempts_and_keeps_history(client, admin, relay: Relay, db) -> None:
    job_id = relay.enqueue("send_email", {})
    make_dead(db, job_id, "boom", attempts=2)
    response = client.post(f"/api/admin/jobs/{job_id}/requeue", headers=admin)
    assert response.status_code == 200
    job = response.get_json()
    assert job["status"] == "queued" and job["attempts"] == 0 and len(job["errors"]) == 2
    # Nothing of the last run is shown as if it were this one's; the error history keeps it.
    assert job["started_at"] is None and job["finished_at"] is None and job["claimed_by"] is None


def test_a_requeue_given_the_lease_token_it_read_is_refused_once_the_job_has_run_again(
    client, admin, relay: Relay, db
) -> None:
    """Two people requeue one dead job: the second requeue, arriving after the job ran and died again,
    ran it once more, though neither of them saw that run."""
    job_id = relay.enqueue("send_email", {})
    make_dead(db, job_id, "boom")
    seen = client.get(f"/api/admin/jobs/{job_id}", headers=admin).get_json()["lease_token"]
    # Someone else requeued it meanwhile; it ran (every claim changes the token) and died again.
    db.execute("UPDATE relay.jobs SET lease_token = lease_token + 1 WHERE id = %s", (job_id,))
    stale = client.post(f"/api/admin/jobs/{job_id}/requeue?seen_lease_token={seen}", headers=admin)
    body = assert_problem(stale, 409, "illegal-transition")
    assert body["detail"] == f"Job {job_id} is dead; it has run again since it was shown, so the requeue was not done."
    assert relay.get_job(job_id).status == "dead"
    current = client.post(f"/api/admin/jobs/{job_id}/requeue?seen_lease_token={seen + 1}", headers=admin)
    assert current.status_code == 200 and current.get_json()["status"] == "queued"
    for spelling in ("-1", "x", "2147483648", "01"):
        refused = client.post(f"/api/admin/jobs/{job_id}/requeue?seen_lease_token={spelling}", headers=admin)
        assert_problem(refused, 422, "validation")
    assert relay.get_job(job_id).status == "queued"


def test_illegal_transitions_are_409_naming_the_current_state(client, admin, relay: Relay, db) -> None:
    queued = relay.enqueue("t", {})
    done = relay.enqueue("t", {})
    make_succeeded(db, done)
    body = assert_problem(client.post(f"/api/admin/jobs/{queued}/requeue", headers=admin), 409, "illegal-transition")
    assert body["current_status"] == "queued" and body["job_id"] == queued
    assert body["allowed_from"] == ["dead", "cancelled"]
    assert body["detail"] == f"Job {queued} is queued; only dead or cancelled jobs can be requeued."
    body = assert_problem(client.post(f"/api/admin/jobs/{done}/cancel", headers=admin), 409, "illegal-transition")
    assert body["current_status"] == "succeeded"
    assert body["detail"] == f"Job {done} is succeeded; only queued or claimed jobs can be cancelled."
    assert relay.get_job(done).status == "succeeded" and relay.get_job(queued).status == "queued"


def test_cancel_queued_then_requeue_cancelled(client, admin, relay: Relay) -> None:
    job_id = relay.enqueue("t", {})
    assert client.post(f"/api/admin/jobs/{job_id}/cancel", headers=admin).get_json()["status"] == "cancelled"
    assert client.post(f"/api/admin/jobs/{job_id}/requeue", headers=admin).get_json()["status"] == "queued"


def test_cancel_running_job_asks_it_to_stop(client, admin, relay: Relay, db) -> None:
    job_id = relay.enqueue("t", {})
    make_claimed(db, job_id)
    job = client.post(f"/api/admin/jobs/{job_id}/cancel", headers=admin).get_json()
    assert job["status"] == "claimed" and job["cancel_requested_at"] is not None
    again = client.post(f"/api/admin/jobs/{job_id}/cancel", headers=admin)
    assert again.status_code == 200, "asking again while the stop is pending is not a conflict"
    assert again.get_json()["cancel_requested_at"] == job["cancel_requested_at"], "the first request's time is kept"


def test_a_cancel_that_waits_out_a_heartbeat_succeeds_where_the_database_defaults_to_repeatable_read(
    make_app, relay: Relay, db, dsn: str
) -> None:
    """The web app's transactions read committed whatever the database's default, as every Relay connection's do.

    The cancel's first statement finds the job claimed; its second waits for
    the row lock of a heartbeat renewing the lease. Under REPEATABLE READ the
    heartbeat's commit would make that second statement a serialization
    failure, answered 503.
    """
    strict = psycopg.conninfo.make_conninfo(dsn, options="-c default_transaction_isolation=repeatable\\ read")
    app = make_app(RELAY_DATABASE_URL=strict)
    headers = AuthActions(app.test_client(), dsn).headers("admin")
    job_id = relay.enqueue("t", {})
    make_claimed(db, job_id)
    answers: list = []
    with psycopg.connect(dsn) as heartbeat:
        heartbeat.execute("UPDATE relay.jobs SET claimed_until = now() + interval '1 minute' WHERE id = %s", (job_id,))
        cancel = threading.Thread(
            target=lambda: answers.append(app.test_client().post(f"/api/admin/jobs/{job_id}/cancel", headers=headers))
        )
        cancel.start()
        wait_for(
            lambda: (
                db.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'").fetchone()[
                    0
                ]
                == 1
            ),
            what="the cancel to wait for the heartbeat's row lock",
        )
        heartbeat.commit()
        cancel.join(15)
    assert answers and answers[0].status_code == 200, answers and answers[0].get_json()
    assert answers[0].get_json()["cancel_requested_at"] is not None


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"dry_run": true}', "application/json"),
        (b"this is not json", "application/json"),
        (b"dry_run=1", "application/x-www-form-urlencoded"),
        (b"[" * 200_000, "application/json"),
    ],
    ids=["json-fields", "not-json", "a-form", "nested-past-the-parser"],
)
@pytest.mark.parametrize("action", ["cancel", "requeue"])
def test_a_body_sent_to_an_action_that_takes_none_is_refused_and_changes_nothing(
    client, admin, relay: Relay, db, action: str, body: bytes, content_type: str
) -> None:
    """``{"dry_run": true}`` was read by nothing: the answer was 200 and the job cancelled."""
    job_id = relay.enqueue("t", {})
    if action == "requeue":
        make_dead(db, job_id)
    before = relay.get_job(job_id).status
    response = client.post(
        f"/api/admin/jobs/{job_id}/{action}", headers={**admin, "Content-Type": content_type}, data=body
    )
    problem = assert_problem(response, 422, "validation")
    assert problem["errors"] == [{"field": "body", "in": "body", "detail": "this endpoint takes no body; send none"}]
    assert relay.get_job(job_id).status == before


@pytest.mark.parametrize("body", [b"{}", b" null "])
def test_an_empty_object_or_null_sent_to_an_action_that_takes_no_body_asks_for_nothing_and_passes(
    client, admin, relay: Relay, body: bytes
) -> None:
    """Some HTTP clients send ``{}`` (or ``null``) with every POST."""
    job_id = relay.enqueue("t", {})
    response = client.post(
        f"/api/admin/jobs/{job_id}/cancel", headers={**admin, "Content-Type": "application/json"}, data=body
    )
    assert response.get_json()["status"] == "cancelled"


def test_the_spec_says_an_action_without_a_body_may_answer_422_and_413(client) -> None:
    doc = client.get("/api/openapi.json").get_json()
    cancel = doc["paths"]["/api/admin/jobs/{job_id}/cancel"]["post"]
    assert {"413", "422"} <= set(cancel["responses"]) and "requestBody" not in cancel
    # The refresh ignores a body, so none is too large; its 422 is for a query parameter it does not know.
    assert "413" not in doc["paths"]["/api/auth/refresh"]["post"]["responses"]


@pytest.mark.parametrize(
    ("action", "in_flight", "ends"),
    [
        # A failed attempt going back for a retry: the job is cancellable before and after.
        ("cancel", "status = 'queued', claimed_by = NULL, claimed_until = NULL", "cancelled"),
        # A last attempt failing: the job the admin saw running is dead, and requeueable, once it commits.
        ("requeue", "status = 'dead', claimed_until = NULL, finished_at = now()", "queued"),
    ],
    ids=["cancel-during-a-retry", "requeue-during-a-last-failure"],
)
def test_a_job_action_acts_on_what_a_workers_write_in_flight_commits(
    client, admin, relay: Relay, db, dsn: str, action: str, in_flight: str, ends: str
) -> None:
    """An action on a job whose worker is writing it waits for that write and acts on its outcome.

    The cancel read the job claimed, then found it queued at its second
    statement, matched neither and answered 409 "Job N is queued; only queued
    or claimed jobs can be cancelled": nothing was cancelled and the job ran again.
    """
    job_id = relay.enqueue("t", {})
    make_claimed(db, job_id)
    answers: list = []
    with psycopg.connect(dsn) as worker:
        worker.execute(f"UPDATE relay.jobs SET {in_flight} WHERE id = %s", (job_id,))
        acting = threading.Thread(
            target=lambda: answers.append(client.post(f"/api/admin/jobs/{job_id}/{action}", headers=admin))
        )
        acting.start()
        wait_for(
            lambda: db.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0] == 1,
            what=f"the {action} to wait for the worker's row lock",
        )
        worker.commit()
        acting.join(15)
    assert answers and answers[0].status_code == 200, answers and answers[0].get_json()
    assert answers[0].get_json()["status"] == ends
    assert relay.get_job(job_id).status == ends


@pytest.mark.parametrize(("action", "status"), [("cancel", "queued"), ("requeue", "dead")])
def test_a_single_job_action_with_an_empty_id_changes_nothing(
    client, admin, relay: Relay, db, action: str, status: str
) -> None:
    """``jobs//cancel`` (a script's empty job id) is not the bulk ``jobs/cancel``, not even after a redirect."""
    ids = relay.enqueue_many([{"type": "t"} for _ in range(3)])
    if status == "dead":
        for job_id in ids:
            make_dead(db, job_id)
    response = client.post(f"/api/admin/jobs//{action}", headers=admin, json={}, follow_redirects=True)
    assert_problem(response, 404)
    assert {relay.get_job(job_id).status for job_id in ids} == {status}


@pytest.mark.parametrize("at", ["last tuesday", "9999-12-31T23:59:59-05:00", 17])
def test_an_error_entry_written_by_hand_is_shown_not_a_500(client, admin, relay: Relay, db, at) -> None:
    """The history is JSON anyone with SQL access can write; a time that is none is shown as unknown."""
    job_id = relay.enqueue("t", {})
    make_dead(db, job_id)
    entry = {"attempt": 1, "at": at, "type": "Boom", "message": "written by hand"}
    db.execute("UPDATE relay.jobs SET errors = %s WHERE id = %s", (psycopg.types.json.Jsonb([entry]), job_id))
    errors = client.get(f"/api/admin/jobs/{job_id}", headers=admin).get_json()["errors"]
    assert errors == [
        {"attempt": 1, "at": None, "worker": None, "type": "Boom", "message": "written by hand", "traceback": None}
    ]


def test_bulk_requeue_by_filter_answers_how_many_changed(client, admin, relay: Relay, db) -> None:
    emails = relay.enqueue_many([{"type": "send_email"} for _ in range(5)])
    other = relay.enqueue("resize_image", {})
    for job_id in [*emails[:4], other]:
        make_dead(db, job_id)
    response = client.post("/api/admin/jobs/requeue", headers=admin, json={"type": "send_email", "status": "dead"})
    assert response.get_json() == {"action": "requeue", "changed": 4}
    assert {(relay.get_job(i).status, relay.get_job(i).started_at) for i in emails} == {("queued", None)}
    assert relay.get_job(other).status == "dead"
    assert client.post("/api/admin/jobs/requeue", headers=admin, json={}).get_json()["changed"] == 1


def test_a_bulk_filter_given_as_null_is_refused_not_read_as_every_value(client, admin, relay: Relay, db) -> None:
    """``{"queue": null}`` cancelled every queued job in every queue: a script that builds
    ``{"queue": $Q}`` from an unset variable must get a 422, as an empty string does, not act on all."""
    kept = relay.enqueue("send_email", {}, queue="mail")
    other = relay.enqueue("resize_image", {})
    dead = relay.enqueue("send_email", {})
    make_dead(db, dead)
    refusals = [
        ("/api/admin/jobs/cancel", {"queue": None}),
        ("/api/admin/jobs/cancel", {"type": None}),
        ("/api/admin/jobs/cancel", {"queue": "mail", "q": None}),
        ("/api/admin/jobs/requeue", {"type": None}),
        ("/api/admin/jobs/requeue", {"status": None}),
        ("/api/admin/jobs/requeue", {"queue": None, "type": "send_email"}),
    ]
    for path, body in refusals:
        problem = assert_problem(client.post(path, headers=admin, json=body), 422, "validation")
        null_fields = {name for name, value in body.items() if value is None}
        assert {error["field"] for error in problem["errors"]} == null_fields, problem
        assert all("leave it out" in error["detail"] for error in problem["errors"]), problem
    assert [relay.get_job(i).status for i in (kept, other, dead)] == ["queued", "queued", "dead"]
    # Left out, the same filters still match every value.
    assert client.post("/api/admin/jobs/requeue", headers=admin, json={"type": "send_email"}).get_json()["changed"] == 1
    assert client.post("/api/admin/jobs/cancel", headers=admin, json={}).get_json()["changed"] == 3


def test_bulk_actions_walk_many_batches(client, admin, relay: Relay, db) -> None:
    relay.enqueue_many([{"type": "bulk", "queue": "q1"} for _ in range(2500)])
    relay.enqueue("bulk", {}, queue="q2")
    response = client.post("/api/admin/jobs/cancel", headers=admin, json={"queue": "q1"})
    assert response.get_json() == {"action": "cancel", "changed": 2500}
    counts = dict(db.execute("SELECT queue, count(*) FILTER (WHERE status = 'cancelled') FROM relay.jobs GROUP BY 1"))
    assert counts == {"q1": 2500, "q2": 0}
    response = client.post("/api/admin/jobs/requeue", headers=admin, json={"status": "cancelled"})
    assert response.get_json()["changed"] == 2500


def _waiting_for_a_lock(db: psycopg.Connection, holder: psycopg.Connection) -> bool:
    """Whether some session waits for a lock ``holder`` holds (the bulk action): not any session of the
    server that waits for a lock, which another database's may do."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (holder.info.backend_pid,)
    ).fetchone()
    return row[0] > 0


@pytest.mark.parametrize("action", ["cancel", "requeue"])
def test_bulk_actions_wait_for_rows_someone_holds(client, admin, relay: Relay, db, dsn: str, action: str) -> None:
    """A claim locks candidates it does not take: a bulk action waits for them rather than skip them.

    Before, the action skipped held rows and answered as if it had covered
    them, and they stayed queued (or dead).
    """
    ids = relay.enqueue_many([{"type": "bulk", "queue": "held"} for _ in range(3)])
    if action == "requeue":
        for job_id in ids:
            make_dead(db, job_id)
    answers: list[dict] = []
    with psycopg.connect(dsn) as holder:
        # As a claim does: lock every candidate, then take only one of them.
        holder.execute("SELECT id FROM relay.jobs WHERE queue = 'held' ORDER BY id FOR UPDATE SKIP LOCKED")
        body = {"queue": "held"}
        request = threading.Thread(
            target=lambda: answers.append(client.post(f"/api/admin/jobs/{action}", headers=admin, json=body).get_json())
        )
        request.start()
        wait_for(lambda: _waiting_for_a_lock(db, holder), timeout=10, what="the bulk action waiting for the held rows")
        if action == "cancel":
            make_claimed(holder, ids[0])
        else:  # another admin requeued it meanwhile
            holder.execute("UPDATE relay.jobs SET status = 'queued' WHERE id = %s", (ids[0],))
        holder.commit()
        request.join(30)
    assert answers == [{"action": action, "changed": 2}]
    statuses = [relay.get_job(i).status for i in ids]
    assert statuses == (["claimed", "cancelled", "cancelled"] if action == "cancel" else ["queued"] * 3)


def test_bulk_requeue_leaves_alone_a_job_that_died_again_while_it_ran(
    client, admin, relay: Relay, db, dsn: str
) -> None:
    """The endpoint promises that jobs dying while the request runs are left alone.

    The last job is held while the request waits; meanwhile it is requeued by
    someone else, runs and dies again. Before, the request took that new death
    too (only the dashboard passed a cut-off time).
    """
    ids = relay.enqueue_many([{"type": "again", "queue": "again"} for _ in range(3)])
    for job_id in ids:
        make_dead(db, job_id)
    answers: list[dict] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT id FROM relay.jobs WHERE id = %s FOR UPDATE", (ids[-1],))
        request = threading.Thread(
            target=lambda: answers.append(
                client.post("/api/admin/jobs/requeue", headers=admin, json={"queue": "again"}).get_json()
            )
        )
        request.start()
        wait_for(lambda: _waiting_for_a_lock(db, holder), timeout=10, what="the bulk requeue waiting for the held row")
        holder.execute(
            "UPDATE relay.jobs SET attempts = 1, finished_at = clock_timestamp(), last_error = 'died again'"
            " WHERE id = %s",
            (ids[-1],),
        )
        holder.commit()
        request.join(30)
    assert answers == [{"action": "requeue", "changed": 2}]
    assert [relay.get_job(i).status for i in ids] == ["queued", "queued", "dead"]


def test_bulk_requeue_takes_a_dead_job_without_a_finish_time(client, admin, relay: Relay, db) -> None:
    """A dead row written by hand may have no finished_at: it ended before the request, whenever that was.

    Compared with the request's start, NULL matched nothing, and such a job
    was counted by the dashboard but never requeued.
    """
    job_id = relay.enqueue("legacy")
    make_dead(db, job_id)
    db.execute("UPDATE relay.jobs SET finished_at = NULL WHERE id = %s", (job_id,))
    assert client.post("/api/admin/jobs/requeue", headers=admin, json={}).get_json() == {
        "action": "requeue",
        "changed": 1,
    }
    assert relay.get_job(job_id).status == "queued"


def test_a_bulk_action_cut_off_part_way_says_how_many_jobs_changed(make_app, auth, relay: Relay, dsn: str) -> None:
    """The first batch commits; the second waits on a held row until the statement timeout.

    Before, the answer was the listings' plain query-timeout 503 ("narrow the
    filters and try again"), as if nothing had changed.
    """
    # Long enough for a batch of 1,000 on a busy machine: only the batch that meets the held row times out.
    client = make_app(RELAY_STATEMENT_TIMEOUT_MS=2000).test_client()
    headers = auth.headers("admin")
    ids = relay.enqueue_many([{"type": "bulk", "queue": "cut"} for _ in range(1500)])
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT id FROM relay.jobs WHERE id = %s FOR UPDATE", (ids[-1],))
        body = assert_problem(
            client.post("/api/admin/jobs/cancel", headers=headers, json={"queue": "cut"}), 503, "bulk-incomplete"
        )
    assert (body["action"], body["changed"]) == ("cancel", 1000)
    assert "1000 matching job(s) were cancelled" in body["detail"] and "statement timeout" in body["detail"]
    statuses = [relay.get_job(i).status for i in (ids[0], ids[999], ids[1000], ids[-1])]
    assert statuses == ["cancelled", "cancelled", "queued", "queued"]
    again = client.post("/api/admin/jobs/cancel", headers=headers, json={"queue": "cut"})
    assert again.get_json() == {"action": "cancel", "changed": 500}


def test_an_action_on_one_job_or_queue_held_up_by_a_lock_says_so(make_app, auth, relay: Relay, dsn: str) -> None:
    """It got the listings' advice, "narrow the filters (status, queue, type)", though it takes none."""
    client = make_app(RELAY_STATEMENT_TIMEOUT_MS=300).test_client()
    headers = auth.headers("admin")
    job_id = relay.enqueue("held", queue="mail")
    assert client.post("/api/admin/queues/mail/pause", headers=headers).status_code == 200
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM relay.jobs WHERE id = %s FOR UPDATE", (job_id,))
        holder.execute("SELECT FROM relay.queues WHERE name = 'mail' FOR UPDATE")
        for path in (f"/api/admin/jobs/{job_id}/cancel", "/api/admin/queues/mail/resume"):
            body = assert_problem(client.post(path, headers=headers), 503, "query-timeout")
            assert "another transaction holds what this needs" in body["detail"], body
            assert "filters" not in body["detail"]
    assert relay.get_job(job_id).status == "queued"
    assert client.get("/api/admin/queues", headers=headers).get_json()["queues"][0]["paused"] is True


@pytest.mark.parametrize(("path", "table"), [("/readyz", "relay.schema_migrations"), ("/metrics", "relay.job_counts")])
def test_a_probe_or_scrape_held_up_by_a_lock_gets_no_listings_advice(make_app, dsn: str, path: str, table: str) -> None:
    """/readyz and /metrics were told to "narrow the filters (status, queue, type)", which they do not take."""
    client = make_app(RELAY_STATEMENT_TIMEOUT_MS=300).test_client()
    with psycopg.connect(dsn) as holder:
        holder.execute(f"LOCK {table} IN ACCESS EXCLUSIVE MODE")
        body = assert_problem(client.get(path), 503, "query-timeout")
    assert "filters" not in body["detail"], body
    assert body["detail"] == (
        "The database gave up on this query: a lock another transaction holds, or a busy server. Try again shortly."
    )


def test_the_endpoints_given_the_listings_advice_are_the_apps_own(make_app) -> None:
    """Named by endpoint: a renamed view would silently lose its advice."""
    endpoints = {rule.endpoint for rule in make_app().url_map.iter_rules()}
    assert FILTERED_ENDPOINTS.issubset(endpoints)


def test_bulk_bodies_are_validated(client, admin) -> None:
    assert_problem(client.post("/api/admin/jobs/requeue", headers=admin, json={"status": "queued"}), 422)
    assert_problem(client.post("/api/admin/jobs/requeue", headers=admin, json={"typo": "x"}), 422)
    assert_problem(client.post("/api/admin/jobs/cancel", headers=admin, json={"status": "queued"}), 422)
    assert_problem(client.post("/api/admin/jobs/cancel", headers=admin, json=[]), 422)


def test_a_body_that_repeats_a_key_is_refused_and_changes_nothing(client, admin, relay: Relay, db) -> None:
    """The JSON parser keeps the last of two equal keys: {"type": "no_such_type", "type": "keep_me"}
    cancelled keep_me's jobs, while a proxy or audit log in between may read the first."""
    kept = relay.enqueue("keep_me")
    headers = {**admin, "Content-Type": "application/json"}
    twice = '{"type": "no_such_type", "type": "keep_me"}'
    repeated = client.post("/api/admin/jobs/cancel", headers=headers, data=twice)
    problem = assert_problem(repeated, 422, "validation")
    assert problem["errors"] == [{"field": "type", "in": "body", "detail": "give it once"}]
    nested = client.post("/api/admin/jobs", headers=headers, data='{"type": "t", "payload": {"to": "a", "to": "b"}}')
    problem = assert_problem(nested, 422, "validation")
    assert problem["errors"] == [{"field": "body", "in": "body", "detail": 'repeats a key within one object: "to"'}]
    assert relay.get_job(kept).status == "queued"
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1
    same_key_in_two_objects = '{"type": "t", "payload": {"a": {"k": 1}, "b": {"k": 2}}}'
    alike = client.post("/api/admin/jobs", headers=headers, data=same_key_in_two_objects)
    assert alike.status_code == 201, alike.get_json()


def test_enqueue_over_http(client, admin, relay: Relay) -> None:
    response = client.post(
        "/api/admin/jobs",
        headers=admin,
        json={
            "type": "send_email",
            "payload": {"to": "a@b.c"},
            "queue": "mail",
            "priority": -5,
            "run_at": "2030-01-01T09:00:00+02:00",
            "max_attempts": 3,
        },
    )
    assert response.status_code == 201
    job = response.get_json()
    assert response.headers["Location"] == f"/api/admin/jobs/{job['id']}"
    stored = relay.get_job(job["id"])
    assert (stored.type, stored.queue, stored.priority, stored.max_attempts) == ("send_email", "mail", -5, 3)
    assert stored.run_at.isoformat().startswith("2030-01-01T07:00:00")


def test_enqueue_over_http_takes_the_max_attempts_workers_published(client, admin, dsn: str, relay: Relay) -> None:
    """The web app loads no handlers: a job of a type a worker registered gets that handler's max_attempts."""
    publish_handlers(dsn, send_email=3)
    sent = [
        {"type": "send_email", "payload": {"to": "a@b.c"}},
        {"type": "send_email", "max_attempts": 4},
        {"type": "send_email", "max_attempts": None},
        {"type": "resize_image"},
    ]
    answers = [client.post("/api/admin/jobs", headers=admin, json=body) for body in sent]
    assert [a.status_code for a in answers] == [201] * 4
    assert [a.get_json()["max_attempts"] for a in answers] == [3, 4, 3, 20]
    assert [relay.get_job(a.get_json()["id"]).max_attempts for a in answers] == [3, 4, 3, 20]


def test_a_payload_nested_deeper_than_python_reads_is_shown_as_unreadable_not_a_500(client, admin, db) -> None:
    """A program writing with SQL can store 3,000 nested arrays; Python's parser stops near 1,000."""
    (job_id,) = db.execute(
        "INSERT INTO relay.jobs (type, payload) VALUES ('deep', %s::jsonb) RETURNING id", ("[" * 3000 + "]" * 3000,)
    ).fetchone()
    shown = client.get(f"/api/admin/jobs/{job_id}", headers=admin)
    assert shown.status_code == 200
    assert shown.get_json()["payload"].startswith("(unreadable JSON: 6,000 characters nested deeper than Python reads")
    listed = client.get("/api/admin/jobs?type=deep", headers=admin)
    assert [job["id"] for job in listed.get_json()["jobs"]] == [job_id]


@pytest.mark.parametrize("depth", [201, 254, 300, 900])
def test_a_result_nested_deeper_than_the_api_writes_is_shown_as_unreadable_not_a_500(
    client, admin, db, depth: int
) -> None:
    """A handler may return JSON nested 300 deep; Python reads it, the API's records stopped near 254 levels
    (pydantic's own bound), and the job answered 500 for as long as it was kept. A cancel of a job whose
    payload was that deep was committed and then answered 500."""
    deep = "[" * depth + "]" * depth
    (done,) = db.execute(
        "INSERT INTO relay.jobs (type, status, attempts, finished_at, result) "
        "VALUES ('deep', 'succeeded', 1, now(), %s::jsonb) RETURNING id",
        (deep,),
    ).fetchone()
    shown = client.get(f"/api/admin/jobs/{done}", headers=admin)
    assert shown.status_code == 200, shown.get_json()
    assert shown.get_json()["result"] == "(unreadable JSON: nested deeper than the admin API writes (200 levels))"
    assert shown.get_json()["payload"] == {}
    (queued,) = db.execute(
        "INSERT INTO relay.jobs (type, payload) VALUES ('deep', %s::jsonb) RETURNING id", (deep,)
    ).fetchone()
    cancelled = client.post(f"/api/admin/jobs/{queued}/cancel", headers=admin)
    assert cancelled.status_code == 200, cancelled.get_json()
    assert cancelled.get_json()["status"] == "cancelled"
    assert cancelled.get_json()["payload"].startswith("(unreadable JSON:")


def test_json_nested_as_deep_as_the_api_takes_is_shown_whole(client, admin, db) -> None:
    """The bound on what the API writes leaves every payload the API itself accepts (100 levels) as it is."""
    deep: object = {"leaf": True}
    for _ in range(199):
        deep = [deep]
    (job_id,) = db.execute(
        "INSERT INTO relay.jobs (type, payload) VALUES ('deep', %s) RETURNING id", (Jsonb(deep),)
    ).fetchone()
    shown = client.get(f"/api/admin/jobs/{job_id}", headers=admin)
    assert shown.status_code == 200 and shown.get_json()["payload"] == deep


def test_idempotency_key_returns_the_first_job(client, admin, db) -> None:
    headers = {**admin, "Idempotency-Key": "order-17-receipt"}
    first = client.post("/api/admin/jobs", headers=headers, json={"type": "receipt", "payload": {"order": 17}})
    again = client.post("/api/admin/jobs", headers=headers, json={"type": "receipt", "payload": {"order": 17}})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.get_json()["id"] == again.get_json()["id"]
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1
    clash = client.post("/api/admin/jobs", headers=headers, json={"type": "receipt", "payload": {"order": 18}})
    body = assert_problem(clash, 409, "idempotency-key-reused")
    assert body["job_id"] == first.get_json()["id"]
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1
    assert_problem(client.post("/api/admin/jobs", headers={**admin, "Idempotency-Key": ""}, json={"type": "r"}), 422)


@pytest.mark.parametrize(
    "changed",
    [{"run_at": "2031-01-01T09:00:00Z"}, {"max_attempts": 1}],
    ids=["a-run_at", "a-max_attempts"],
)
def test_a_used_key_with_a_run_at_or_max_attempts_the_first_job_was_not_given_is_409(
    client, admin, db, changed: dict
) -> None:
    """It answered 200 with the key's job: the client believed in a job for 2031 that ran at once."""
    headers = {**admin, "Idempotency-Key": "nightly-report"}
    first = client.post("/api/admin/jobs", headers=headers, json={"type": "report"})
    assert first.status_code == 201
    clash = client.post("/api/admin/jobs", headers=headers, json={"type": "report", **changed})
    assert assert_problem(clash, 409, "idempotency-key-reused")["job_id"] == first.get_json()["id"]
    assert db.execute("SELECT count(*), min(max_attempts) FROM relay.jobs").fetchone() == (1, 20)


def test_a_used_key_with_another_run_at_is_409_after_its_job_was_cancelled_before_it_ran(client, admin, db) -> None:
    """The key's job cancelled before any claim still has the run_at it was asked for: a request for
    another time was answered 200 with that cancelled job, where the API promises 409."""
    headers = {**admin, "Idempotency-Key": "launch-mail"}
    body = {"type": "mail", "run_at": "2030-01-01T00:00:00Z"}
    first = client.post("/api/admin/jobs", headers=headers, json=body).get_json()
    assert client.post(f"/api/admin/jobs/{first['id']}/cancel", headers=admin).status_code == 200
    clash = client.post("/api/admin/jobs", headers=headers, json={**body, "run_at": "2031-06-01T00:00:00Z"})
    assert assert_problem(clash, 409, "idempotency-key-reused")["job_id"] == first["id"]
    again = client.post("/api/admin/jobs", headers=headers, json=body)
    assert again.status_code == 200 and again.get_json()["status"] == "cancelled"


def test_a_repeated_request_giving_run_at_is_still_the_same_job_after_a_retry_moved_it(
    client, admin, db, relay: Relay
) -> None:
    """A retry sets a new run_at; the client's request is the one it sent the first time."""
    headers = {**admin, "Idempotency-Key": "weekly-export"}
    body = {"type": "export", "run_at": "2020-01-01T00:00:00Z", "max_attempts": 3}
    first = client.post("/api/admin/jobs", headers=headers, json=body).get_json()
    make_claimed(db, first["id"])
    db.execute(
        "UPDATE relay.jobs SET status = 'queued', claimed_by = NULL, claimed_until = NULL,"
        " run_at = now() + interval '5 seconds' WHERE id = %s",
        (first["id"],),
    )
    again = client.post("/api/admin/jobs", headers=headers, json=body)
    assert again.status_code == 200 and again.get_json()["id"] == first["id"]


def test_a_repeated_request_giving_run_at_is_still_the_same_job_after_it_died_and_was_requeued(
    client, admin, db
) -> None:
    """A requeue resets attempts and run_at: the job looked as if it still waited for its first attempt."""
    headers = {**admin, "Idempotency-Key": "monthly-invoice"}
    body = {"type": "invoice", "run_at": "2020-01-01T00:00:00Z"}
    first = client.post("/api/admin/jobs", headers=headers, json=body).get_json()
    make_claimed(db, first["id"])  # a claim takes a lease token, which no requeue resets
    make_dead(db, first["id"])
    assert client.post(f"/api/admin/jobs/{first['id']}/requeue", headers=admin).status_code == 200
    again = client.post("/api/admin/jobs", headers=headers, json=body)
    assert again.status_code == 200 and again.get_json()["id"] == first["id"]


@pytest.mark.parametrize("key", ["caf\u00e9-17", "cafÃ©-17", "order\x7f17", "order\t17"])
def test_an_idempotency_key_that_is_not_printable_ascii_is_refused_and_writes_nothing(
    client, admin, db, key: str
) -> None:
    """A header is read as ISO-8859-1: UTF-8 "café" was stored as "cafÃ©", DEL as given."""
    response = client.post("/api/admin/jobs", headers={**admin, "Idempotency-Key": key}, json={"type": "t"})
    problem = assert_problem(response, 422, "validation")
    assert problem["errors"] == [
        {
            "field": "Idempotency-Key",
            "in": "header",
            "detail": "must be printable ASCII (letters, digits, punctuation, spaces)",
        }
    ]
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"type": "t", "run_at": "2030-01-01T09:00:00"}, "run_at"),
        ({"type": "t", "queue": "Bad Queue"}, "queue"),
        ({"type": "t", "priority": "5"}, "priority"),
        ({"type": "t", "priority": 40000}, "priority"),
        ({"type": ""}, "type"),
        # A newline would come back from a form as CRLF, and "Requeue all" of the type would match nothing.
        ({"type": "mail\nsend"}, "type"),
        ({"type": "mail\t"}, "type"),
        ({"type": "send_email "}, "type"),
        ({"type": "t", "max_attempts": 0}, "max_attempts"),
        ({"type": "t", "colour": "red"}, "colour"),
        ({"payload": {}}, "type"),
        ({"type": "t", "payload": {"blob": "x" * 300_000}}, "payload"),
        ({"type": "t", "run_at": "0001-01-01T00:00:00+14:00"}, "run_at"),
        ({"type": "t", "run_at": "9999-12-31T23:59:59-14:00"}, "run_at"),
        # Digits in a string would be read as Unix seconds (or milliseconds): no offset was written.
        ({"type": "t", "run_at": "1700000000"}, "run_at"),
        ({"type": "t", "run_at": "-1"}, "run_at"),
        ({"type": "t", "run_at": "17000000000000"}, "run_at"),
        ({"type": "t", "run_at": 1700000000}, "run_at"),
        ({"type": "t", "run_at": "2030-01-01"}, "run_at"),
    ],
)
def test_enqueue_refuses_bad_input_and_writes_nothing(client, admin, db, body: dict, field: str) -> None:
    problem = assert_problem(client.post("/api/admin/jobs", headers=admin, json=body), 422, "validation")
    assert field in [e["field"] for e in problem["errors"]], problem
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


@pytest.mark.parametrize(
    "run_at",
    [
        "2030-01-01T09:00:00+24:00",
        "2030-01-01T09:00:00+23:60",
        "2030-01-01T09:00:00-99:00",
        "2030-13-01T09:00:00Z",
        "2030-02-30T09:00:00Z",
        "2030-01-01T24:00:00Z",
    ],
)
def test_a_run_at_that_names_no_real_moment_is_refused_in_relays_words(client, admin, db, run_at: str) -> None:
    """The shape is a date-time but a part is out of range: the detail said
    "offset must be a timedelta strictly between -timedelta(hours=24) ..."."""
    problem = assert_problem(client.post("/api/admin/jobs", headers=admin, json={"type": "t", "run_at": run_at}), 422)
    [error] = problem["errors"]
    assert error["field"] == "run_at"
    assert "is not a moment that exists" in error["detail"]
    for word in ("timedelta", "datetime", "must be in"):
        assert word not in error["detail"], error
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


@pytest.mark.parametrize("run_at", ["\uff12\uff10\uff13\uff10-01-01T00:00:00Z", "2030-01-01T09:00:00+\u0660\u0661:00"])
def test_a_run_at_written_with_other_digits_than_0_to_9_is_refused_for_its_format(client, admin, db, run_at) -> None:
    """Full-width or Arabic-Indic digits matched the format's \\d and were then called a moment that
    does not exist, as if a month or an offset were out of range."""
    problem = assert_problem(client.post("/api/admin/jobs", headers=admin, json={"type": "t", "run_at": run_at}), 422)
    [error] = problem["errors"]
    assert error["field"] == "run_at"
    assert "must be an RFC 3339 date-time" in error["detail"], error
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


def test_run_at_at_the_edges_of_the_utc_calendar_is_accepted(client, admin, relay: Relay) -> None:
    for run_at in ("0001-01-01T00:00:00+00:00", "0001-01-01T14:00:00+14:00", "9999-12-31T23:59:59-00:00"):
        response = client.post("/api/admin/jobs", headers=admin, json={"type": "t", "run_at": run_at})
        assert response.status_code == 201, response.get_json()
    assert client.get("/api/admin/jobs", headers=admin).status_code == 200


@pytest.mark.parametrize(
    ("payload", "field", "detail"),
    [
        (1e400, "payload", "finite number"),
        ({"a": [1, 1e400]}, "payload.a.1", "finite number"),
        ({"list": {"str": "a\u0000b"}}, "payload.list.str", "must not contain NUL characters"),
        (["ok", {"dict": [1e400]}], "payload.1.dict.0", "finite number"),
        ([{"k\u0000": 1}], "payload.0.k\u0000", "must not contain NUL characters"),
    ],
)
def test_field_paths_name_only_the_clients_fields(client, admin, db, payload, field: str, detail: str) -> None:
    raw = json.dumps({"type": "x", "payload": payload}).replace("Infinity", "1e400")
    response = client.post("/api/admin/jobs", headers=admin, data=raw, content_type="application/json")
    body = assert_problem(response, 422, "validation")
    assert [(e["field"], e["in"]) for e in body["errors"]] == [(field, "body")], body
    assert detail in body["errors"][0]["detail"]
    assert body["detail"] == f"Fix these fields and try again: {field}."
    for word in ("list[", "dict[", "union", "nullable", "function-", "constrained", "json-or-python"):
        assert word not in response.get_data(as_text=True), body
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


@pytest.mark.parametrize(
    "payload",
    [
        {"x": 1.2345678901234567e25},
        {"x": 1e16, "y": [2.5e300, -0.0, 1e-7]},
        {"b": True, "n": None, "s": "é😀", "nested": {"z": 1, "a": [1.0, 2]}},
    ],
)
def test_repeating_an_idempotent_enqueue_with_the_same_payload_is_200(client, admin, db, payload) -> None:
    headers = {**admin, "Idempotency-Key": "same-body"}
    first = client.post("/api/admin/jobs", headers=headers, json={"type": "f", "payload": payload})
    again = client.post("/api/admin/jobs", headers=headers, json={"type": "f", "payload": payload})
    assert (first.status_code, again.status_code) == (201, 200), again.get_json()
    assert first.get_json()["id"] == again.get_json()["id"]
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1


@pytest.mark.parametrize(
    ("stored", "sent"),
    [
        ({"x": 1}, {"x": True}),
        ({"x": 1}, {"x": 1.0}),
        ({"x": 1.2345678901234567e25}, {"x": 1.2345678901234568e25}),
        ({"x": [1, 2]}, {"x": [2, 1]}),
        ({"x": 0}, {"x": None}),
    ],
)
def test_a_different_payload_under_a_used_key_is_still_409(client, admin, db, stored, sent) -> None:
    headers = {**admin, "Idempotency-Key": "other-body"}
    assert client.post("/api/admin/jobs", headers=headers, json={"type": "f", "payload": stored}).status_code == 201
    clash = client.post("/api/admin/jobs", headers=headers, json={"type": "f", "payload": sent})
    assert_problem(clash, 409, "idempotency-key-reused")
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1


def test_far_future_jobs_read_back_whatever_the_servers_time_zone(make_app, admin, relay: Relay, monkeypatch) -> None:
    """9999-12-31 20:00 UTC is year 10000 in Tokyo: a web session in that zone could not list the job."""
    job_id = relay.enqueue("far_future", run_at=datetime(9999, 12, 31, 20, 0, tzinfo=UTC))
    monkeypatch.setenv("PGOPTIONS", "-c TimeZone=Asia/Tokyo")  # read by libpq when the new app's pool connects
    tokyo = make_app().test_client()
    listing = tokyo.get("/api/admin/jobs", headers=admin)
    assert listing.status_code == 200, listing.get_json()
    assert [job["run_at"] for job in listing.get_json()["jobs"] if job["id"] == job_id] == ["9999-12-31T20:00:00Z"]
    assert tokyo.get(f"/api/admin/jobs/{job_id}", headers=admin).status_code == 200


def test_a_null_payload_is_stored_as_an_empty_one_and_repeats_as_200(client, admin, db) -> None:
    """relay_core stores a None payload as {}; a repeat of the same request must not call that another job."""
    headers = {**admin, "Idempotency-Key": "null-body"}
    first = client.post("/api/admin/jobs", headers=headers, json={"type": "f", "payload": None})
    again = client.post("/api/admin/jobs", headers=headers, json={"type": "f", "payload": None})
    assert (first.status_code, again.status_code) == (201, 200), again.get_json()
    assert first.get_json()["id"] == again.get_json()["id"]
    assert first.get_json()["payload"] == {}
    omitted = client.post("/api/admin/jobs", headers=headers, json={"type": "f"})
    assert omitted.status_code == 200 and omitted.get_json()["id"] == first.get_json()["id"]
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1
