"""Dashboard actions: requeue, cancel, request stop, bulk requeue by type, pause and resume."""

from __future__ import annotations

import re

import psycopg
import pytest
from flask import Flask

from relay_core import IllegalTransition, Relay

from .conftest import DashboardClient, Jobs, _logged_in


def _text(response) -> str:
    return response.get_data(as_text=True)


def _buttons(html: str) -> list[str]:
    return [
        b
        for b in re.findall(r'<button (?:id="[^"]*" )?class="btn[^"]*" type="submit">([^<]*)</button>', html)
        if b != "Log out"
    ]


@pytest.mark.parametrize(
    ("state", "offered"),
    [
        ("dead", ["Requeue"]),
        ("cancelled", ["Requeue"]),
        ("queued", ["Cancel"]),
        ("claimed", ["Request stop"]),
        ("succeeded", []),
    ],
)
def test_only_legal_actions_are_offered(
    admin: DashboardClient, jobs: Jobs, admin_cancel, state: str, offered: list[str]
) -> None:
    job_id = jobs.add()
    if state == "dead":
        jobs.dead(job_id)
    elif state == "cancelled":
        admin_cancel(job_id)
    elif state == "claimed":
        jobs.claimed(job_id)
    elif state == "succeeded":
        jobs.succeeded(job_id)
    assert _buttons(_text(admin.get(f"/jobs/{job_id}"))) == offered


@pytest.fixture
def admin_cancel(relay: Relay):
    """Cancel a job the way an admin does (relay_core.admin.cancel)."""
    return relay.cancel


def test_requeue_answers_the_new_status_card_in_place(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    response = admin.post(f"/jobs/{job_id}/requeue")
    assert response.status_code == 200
    html = _text(response)
    assert "<html" not in html
    assert '<span class="badge big s-queued">queued</span>' in html
    assert "Requeued: it runs again now, with fresh attempts." in html
    assert f'hx-get="/jobs/{job_id}?part=status&amp;seen=queued-0" hx-trigger="every 2s"' in html
    assert _buttons(html) == ["Cancel"]
    assert response.headers["HX-Trigger"] == "relay-job-changed"
    assert jobs.status(job_id) == "queued"


def test_a_second_requeue_of_a_job_that_ran_again_since_changes_nothing(admin: DashboardClient, jobs: Jobs) -> None:
    """Two tabs on one dead job: the first Requeue ran it and it died again; the second ran it once more."""
    job_id = jobs.dead(jobs.add())
    page = _text(admin.get(f"/jobs/{job_id}"))
    shown = re.search(r'name="seen" value="(\d+)"', page)
    assert shown is not None, page
    assert admin.post(f"/jobs/{job_id}/requeue", {"seen": shown[1]}).status_code == 200  # the first tab
    jobs.dead(job_id)  # it ran again and died again
    runs = jobs.db.execute("SELECT lease_token FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0]

    response = admin.post(
        f"/jobs/{job_id}/requeue", {"seen": shown[1]}
    )  # the second tab, still showing the first death
    assert response.status_code == 409
    assert "Nothing done: the job has run again since this page showed it, and is dead now." in _text(response)
    assert jobs.status(job_id) == "dead"
    assert jobs.db.execute("SELECT lease_token FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] == runs
    # The card it answers shows the second death: its Requeue button requeues.
    again = re.search(r'name="seen" value="(\d+)"', _text(response))
    assert again is not None and int(again[1]) == runs
    assert admin.post(f"/jobs/{job_id}/requeue", {"seen": again[1]}).status_code == 200
    assert jobs.status(job_id) == "queued"


@pytest.mark.parametrize("seen", ["x", "-1", "1.0", "12345678901", "\u0661"])
def test_a_requeue_whose_seen_is_no_lease_token_is_refused_and_changes_nothing(
    admin: DashboardClient, jobs: Jobs, seen: str
) -> None:
    job_id = jobs.dead(jobs.add())
    response = admin.post(f"/jobs/{job_id}/requeue", {"seen": seen})
    assert response.status_code == 400
    assert "seen must be the job&#39;s lease token" in _text(response)
    assert jobs.status(job_id) == "dead"


def test_requeue_of_a_job_no_longer_dead_shows_its_state_and_changes_nothing(
    admin: DashboardClient, jobs: Jobs
) -> None:
    job_id = jobs.succeeded(jobs.add())
    response = admin.post(f"/jobs/{job_id}/requeue")
    assert response.status_code == 409
    html = _text(response)
    assert "Nothing done: the job is succeeded now." in html
    assert '<span class="badge big s-succeeded">succeeded</span>' in html
    assert _buttons(html) == []
    assert jobs.status(job_id) == "succeeded"


def test_cancel_of_a_queued_job(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.add()
    html = _text(admin.post(f"/jobs/{job_id}/cancel"))
    assert '<span class="badge big s-cancelled">cancelled</span>' in html
    assert "Cancelled: it will not run." in html
    assert _buttons(html) == ["Requeue"]
    assert jobs.status(job_id) == "cancelled"


def test_cancel_of_a_running_job_requests_a_stop(admin: DashboardClient, jobs: Jobs, db: psycopg.Connection) -> None:
    job_id = jobs.claimed(jobs.add())
    html = _text(admin.post(f"/jobs/{job_id}/cancel"))
    assert "Stop requested: the worker stops the job at its next heartbeat." in html
    assert html.count("Stop requested") == 1, "said once, not again by the card's own line"
    assert '<span class="badge big s-claimed">claimed</span>' in html
    assert _buttons(html) == []  # asked once; nothing more to offer
    assert jobs.status(job_id) == "claimed"
    row = db.execute("SELECT cancel_requested_at FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None and row[0] is not None
    again = admin.get(f"/jobs/{job_id}")
    assert "Stop requested" in _text(again)
    pressed_again = admin.post(f"/jobs/{job_id}/cancel")  # a stale page, or a double tap
    assert pressed_again.status_code == 200 and "Stop requested" in _text(pressed_again)


def test_a_cancel_confirmed_for_a_queued_job_that_started_since_stops_nothing(
    admin: DashboardClient, jobs: Jobs, db: psycopg.Connection
) -> None:
    """The page said "It will not run"; a worker claimed the job while the confirm dialog was open.

    Before, the press asked the running job to stop: more than the page showed.
    """
    job_id = jobs.add()
    page = _text(admin.get(f"/jobs/{job_id}"))
    assert '<input type="hidden" name="seen" value="queued">' in page
    jobs.claimed(job_id)
    for htmx in (True, False):
        pressed = admin.post(f"/jobs/{job_id}/cancel", {"seen": "queued"}, htmx=htmx)
        if htmx:
            assert pressed.status_code == 409
            assert "Nothing done: the job is claimed now." in _text(pressed)
            assert "Request stop" in _buttons(_text(pressed))  # the button for what it is now
    row = db.execute("SELECT status::text, cancel_requested_at FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("claimed", None)
    running = _text(admin.get(f"/jobs/{job_id}"))
    assert '<input type="hidden" name="seen" value="claimed">' in running
    stopped = admin.post(f"/jobs/{job_id}/cancel", {"seen": "claimed"})
    assert "Stop requested" in _text(stopped)
    assert admin.post(f"/jobs/{job_id}/cancel", {"seen": "succeeded"}).status_code == 400


def test_actions_on_missing_jobs_are_404(admin: DashboardClient) -> None:
    assert admin.post("/jobs/424242/requeue").status_code == 404
    assert admin.post("/jobs/424242/cancel").status_code == 404


def test_actions_on_non_canonical_job_ids_are_404_and_change_nothing(admin: DashboardClient, jobs: Jobs) -> None:
    ids = [jobs.add() for _ in range(22)]
    jobs.dead(ids[-1])
    for spelling in ("022", "%D9%A2%D9%A2", "%EF%BC%92%EF%BC%92"):
        assert admin.post(f"/jobs/{spelling}/requeue").status_code == 404, spelling
        assert admin.post(f"/jobs/{spelling}/cancel").status_code == 404, spelling
    assert jobs.status(22) == "dead"


@pytest.mark.parametrize(
    ("action", "allowed", "sentence"),
    [
        ("requeue", ("dead", "cancelled"), "only dead or cancelled jobs can be requeued."),
        ("cancel", ("queued", "claimed"), "only queued or claimed jobs can be cancelled."),
    ],
)
def test_an_illegal_transition_page_names_the_action_right(
    app: Flask, action: str, allowed: tuple[str, ...], sentence: str
) -> None:
    # The dashboard's own actions answer a 409 status card; this page is the
    # blueprint's safety net for any other view the state machine refuses.
    handler = app.error_handler_spec["dashboard"][None][IllegalTransition]
    with app.test_request_context("/jobs/7"):
        response = handler(IllegalTransition(7, "succeeded", action, allowed))
    assert response.status_code == 409
    assert f"Job 7 is succeeded; {sentence}" in response.get_data(as_text=True)


def test_actions_are_never_gets(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    for path in (f"/jobs/{job_id}/requeue", f"/jobs/{job_id}/cancel", "/dead/requeue", "/queues/default/pause"):
        assert admin.client.get(path).status_code == 405, path
    assert jobs.status(job_id) == "dead"


def test_a_requeue_into_a_paused_queue_says_it_waits_for_the_queue(
    admin: DashboardClient, jobs: Jobs, relay: Relay
) -> None:
    """It said "it runs again now" while the job sat queued behind a pause nothing on the page named."""
    job_id = jobs.dead(jobs.add(queue="reports"))
    other = jobs.dead(jobs.add())
    relay.pause_queue("reports")
    html = _text(admin.post(f"/jobs/{job_id}/requeue"))
    assert "Requeued, with fresh attempts; its queue reports is paused, so it runs once the queue is resumed." in html
    assert "runs again now" not in html
    assert jobs.status(job_id) == "queued"
    assert "Requeued: it runs again now, with fresh attempts." in _text(admin.post(f"/jobs/{other}/requeue"))
    jobs.dead(jobs.add("send_email", queue="reports"))
    html = _text(admin.post("/dead/requeue", {"type": "send_email"}))
    assert "Requeued 1 dead send_email job; it runs again now, but in a paused queue (reports) only once" in html
    jobs.dead(jobs.add("resize_image"))  # in the default queue: the paused one is no concern of it
    html = _text(admin.post("/dead/requeue", {"type": "resize_image"}))
    assert "Requeued 1 dead resize_image job; it runs again now." in html


def test_dead_view_offers_requeue_all_of_a_type_and_does_it(admin: DashboardClient, jobs: Jobs) -> None:
    mails = [jobs.dead(jobs.add("send_email")) for _ in range(3)]
    image = jobs.dead(jobs.add("resize_image"))
    page = _text(admin.get("/dead"))
    assert "Requeue all 3 dead send_email jobs" in page
    assert "Requeue all 1 dead resize_image job<" in page
    assert 'hx-confirm="Requeue all 3 dead send_email jobs? They run again now, with fresh attempts."' in page
    response = admin.post("/dead/requeue", {"type": "send_email"})
    assert response.status_code == 200
    html = _text(response)
    assert "Requeued 3 dead send_email jobs; they run again now." in html
    assert "<html" not in html
    assert "Requeue all 1 dead resize_image job<" in html
    assert "send_email</span><span" not in html
    assert [jobs.status(i) for i in mails] == ["queued"] * 3
    assert jobs.status(image) == "dead"


def test_requeue_all_of_a_type_with_one_dead_job_says_job_throughout(admin: DashboardClient, jobs: Jobs) -> None:
    image = jobs.dead(jobs.add("resize_image"))
    page = _text(admin.get("/dead"))
    assert "Requeue all 1 dead resize_image job<" in page
    assert 'hx-confirm="Requeue all 1 dead resize_image job? It runs again now, with fresh attempts."' in page
    html = _text(admin.post("/dead/requeue", {"type": "resize_image"}))
    assert "Requeued 1 dead resize_image job; it runs again now." in html
    assert jobs.status(image) == "queued"


def test_a_form_field_given_twice_is_refused_and_changes_nothing(admin: DashboardClient, jobs: Jobs) -> None:
    """Requeue all with two types requeued the first type's jobs and named only it."""
    mail, image = jobs.dead(jobs.add("send_email")), jobs.dead(jobs.add("resize_image"))
    response = admin.post("/dead/requeue", {"type": ["send_email", "resize_image"]})  # type: ignore[dict-item]
    assert response.status_code == 400
    assert "the form field &#39;type&#39; is given more than once" in _text(response)
    assert admin.post(f"/jobs/{mail}/requeue", {"seen": ["1", "1"]}).status_code == 400  # type: ignore[dict-item]
    assert [jobs.status(mail), jobs.status(image)] == ["dead", "dead"]


def test_requeue_all_leaves_the_jobs_that_died_after_the_page_was_read(admin: DashboardClient, jobs: Jobs) -> None:
    """The confirmation said "Requeue all 1 dead resize_image job?" and the answer was "Requeued 4": jobs
    that died since the page was read ran again without the admin having seen them."""
    shown = jobs.dead(jobs.add("resize_image"))
    page = _text(admin.get("/dead"))
    assert "Requeue all 1 dead resize_image job<" in page
    (read_at,) = re.findall(r'name="finished_by" value="([^"]+)"', page)
    later = jobs.dead(jobs.add("resize_image"))
    html = _text(admin.post("/dead/requeue", {"type": "resize_image", "finished_by": read_at}))
    assert "Requeued 1 dead resize_image job; it runs again now." in html
    assert (jobs.status(shown), jobs.status(later)) == ("queued", "dead")


@pytest.mark.parametrize("finished_by", ["yesterday", "2030-01-01T00:00:00"])
def test_requeue_all_with_a_page_time_that_is_not_one_changes_nothing(
    admin: DashboardClient, jobs: Jobs, finished_by: str
) -> None:
    image = jobs.dead(jobs.add("resize_image"))
    response = admin.post("/dead/requeue", {"type": "resize_image", "finished_by": finished_by})
    assert response.status_code == 400
    assert jobs.status(image) == "dead"


def test_requeue_all_that_finds_nothing_left_says_so(admin: DashboardClient, jobs: Jobs) -> None:
    """A second admin (or a stale tab) presses requeue-all after the first: nothing is claimed to run again."""
    image = jobs.dead(jobs.add("resize_image"))
    admin.post("/dead/requeue", {"type": "resize_image"})
    html = _text(admin.post("/dead/requeue", {"type": "resize_image"}))
    assert "Nothing requeued: no dead resize_image jobs are left." in html
    assert "Requeued 0" not in html and "again now" not in html
    assert jobs.status(image) == "queued"


def test_a_requeue_all_cut_off_part_way_says_how_many_it_requeued(make_app, dsn: str, relay: Relay) -> None:
    """The first 1,000 dead jobs are requeued; the next batch waits on a held row until the statement timeout."""
    # Long enough for a batch of 1,000 on a busy machine: only the batch that meets the held row times out.
    admin = _logged_in(make_app(RELAY_STATEMENT_TIMEOUT_MS=2000), dsn, "admin")
    ids = relay.enqueue_many([{"type": "resize_image"} for _ in range(1200)])
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(
            "UPDATE relay.jobs SET status = 'dead', attempts = 1, finished_at = now() WHERE id = ANY(%s)", (ids,)
        )
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT id FROM relay.jobs WHERE id = %s FOR UPDATE", (ids[-1],))
        html = _text(admin.post("/dead/requeue", {"type": "resize_image"}))
    assert "Requeued 1,000 dead resize_image jobs, then the database gave up; the rest are still dead." in html
    assert relay.get_job(ids[0]).status == "queued" and relay.get_job(ids[-1]).status == "dead"
    assert "Requeued 200 dead resize_image jobs; they run again now." in _text(
        admin.post("/dead/requeue", {"type": "resize_image"})
    )


def test_a_cancel_held_up_by_a_lock_says_so(make_app, dsn: str, relay: Relay) -> None:
    """It said "Narrow the filters (state, queue, type)" on a job's own page, which has none."""
    admin = _logged_in(make_app(RELAY_STATEMENT_TIMEOUT_MS=300), dsn, "admin")
    job_id = relay.enqueue("resize_image")
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM relay.jobs WHERE id = %s FOR UPDATE", (job_id,))
        response = admin.post(f"/jobs/{job_id}/cancel")
    assert response.status_code == 503
    html = _text(response)
    assert "another transaction holds what this needs" in html and "filters" not in html
    assert relay.get_job(job_id).status == "queued"


def test_bulk_requeue_needs_a_type(admin: DashboardClient) -> None:
    response = admin.post("/dead/requeue", {})
    assert response.status_code == 400
    assert "which type" in _text(response)


def test_pause_and_resume_a_queue(admin: DashboardClient, jobs: Jobs, relay: Relay) -> None:
    jobs.add(queue="mail")
    assert "Pause mail</button>" in _text(admin.get("/queues"))
    paused = _text(admin.post("/queues/mail/pause"))
    assert "Paused mail: workers claim nothing from it until it is resumed." in paused
    assert "Resume mail</button>" in paused
    assert relay.paused_queues() == ["mail"]
    resumed = _text(admin.post("/queues/mail/resume"))
    assert "Resumed mail." in resumed and "Pause mail</button>" in resumed
    assert relay.paused_queues() == []


@pytest.mark.parametrize("name", ["Bad%20Name", "mail%0A"])
def test_pausing_a_badly_named_queue_is_refused(admin: DashboardClient, relay: Relay, name: str) -> None:
    response = admin.post(f"/queues/{name}/pause")
    assert response.status_code == 400
    assert relay.paused_queues() == []


def test_plain_form_actions_redirect_back_and_say_what_they_did_once(
    admin: DashboardClient, jobs: Jobs, relay: Relay
) -> None:
    """Without JavaScript a form posts and is redirected (a reload does not post it again);
    the page it lands on says what the action did, as the htmx answer does, and only once."""
    jobs.dead(jobs.add())
    response = admin.post("/dead/requeue", {"type": "send_email"}, htmx=False)
    assert (response.status_code, response.headers["Location"]) == (303, "/dead")
    assert "Requeued 1 dead send_email job; it runs again now." in _text(admin.get("/dead"))
    assert "Requeued 1" not in _text(admin.get("/dead"))
    response = admin.post("/queues/default/pause", htmx=False)
    assert (response.status_code, response.headers["Location"]) == (303, "/queues")
    assert "Paused default: workers claim nothing from it until it is resumed." in _text(admin.get("/queues"))
    assert relay.paused_queues() == ["default"]


def test_a_plain_form_job_action_says_what_it_did_or_why_it_did_nothing(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    response = admin.post(f"/jobs/{job_id}/requeue", htmx=False)
    assert (response.status_code, response.headers["Location"]) == (303, f"/jobs/{job_id}")
    assert "Requeued: it runs again now, with fresh attempts." in _text(admin.get(f"/jobs/{job_id}"))
    response = admin.post(f"/jobs/{job_id}/requeue", htmx=False)  # queued now: refused
    assert response.status_code == 303
    page = _text(admin.get(f"/jobs/{job_id}"))
    assert "Nothing done: the job is queued now." in page
    assert "Nothing done" not in _text(admin.get(f"/jobs/{job_id}"))
    assert jobs.status(job_id) == "queued"


def test_requeue_all_of_a_type_holding_a_nul_is_refused_and_changes_nothing(admin: DashboardClient, jobs: Jobs) -> None:
    """The read of the paused queues ran before the type was checked: the database's refusal was a 500."""
    image = jobs.dead(jobs.add("resize_image"))
    response = admin.post("/dead/requeue", {"type": "resize\x00image"})
    assert response.status_code == 400, _text(response)[:300]
    assert "NUL" in _text(response)
    assert jobs.status(image) == "dead"
