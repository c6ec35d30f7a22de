"""Every dashboard page: content, filters, pages of jobs, partials for htmx, escaping and headers."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta

import psycopg
import pytest
from psycopg.types.json import Jsonb

from relay_core import Relay
from relay_core.worker import periodic

from ..helpers import read_while_truncating
from .conftest import TRACEBACK, DashboardClient, Jobs
from .support import PASSWORD

PAGES = ["/", "/jobs", "/jobs?state=dead", "/dead", "/queues", "/workers", "/schedules"]
SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"


def _text(response) -> str:
    return response.get_data(as_text=True)


def _rows(html: str) -> list[int]:
    return [int(n) for n in re.findall(r'<a (?:id="row-\d+" )?class="row" href="/jobs/(\d+)">', html)]


@pytest.fixture
def busy(jobs: Jobs) -> dict[str, int]:
    """A few jobs in every state, two queues."""
    return {
        "queued": jobs.add("send_email", queue="mail"),
        "claimed": jobs.claimed(jobs.add("resize_image", queue="media")),
        "dead": jobs.dead(jobs.add("send_email", queue="mail"), "ConnectionError: SMTP refused\nsecond line"),
        "succeeded": jobs.succeeded(jobs.add("resize_image", queue="media"), {"thumbnails": 3}),
    }


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders_with_csp_and_no_caching(viewer: DashboardClient, busy: dict[str, int], path: str) -> None:
    response = viewer.get(path)
    assert response.status_code == 200
    assert response.mimetype == "text/html"
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["Cache-Control"] == "no-store"
    assert "HX-Request" in response.headers["Vary"]
    html = _text(response)
    assert "<!doctype html>" in html
    # No inline script, no inline style, no inline handler, nothing from another origin.
    assert not re.search(r"<script(?![^>]*\bsrc=)", html)
    assert " style=" not in html and "<style" not in html
    assert not re.search(r"\son[a-z]+=", html)
    assert not re.search(r'(src|href)="(https?:)?//', html)


@pytest.mark.parametrize("path", PAGES)
def test_htmx_requests_get_the_partial_alone(viewer: DashboardClient, busy: dict[str, int], path: str) -> None:
    response = viewer.get(path, htmx=True)
    assert response.status_code == 200
    html = _text(response)
    assert "<html" not in html and '<nav class="tabs"' not in html
    assert html.strip()


def test_htmx_asking_for_a_job_part_or_the_login_form_never_gets_a_missing_template(
    viewer: DashboardClient, anonymous: DashboardClient, relay: Relay
) -> None:
    """An htmx request for a part of a job's page other than the two it polls, or for the login
    form (which has no partial), rendered a template that does not exist: a 500."""
    job_id = relay.enqueue("t")
    for part in ("evil", "", "job"):
        response = viewer.get(f"/jobs/{job_id}?part={part}", htmx=True)
        assert response.status_code == 200, part
        assert 'class="panel status-card"' in _text(response)
        assert "<html" not in _text(response)
    assert anonymous.get("/login", htmx=True).status_code == 200
    assert "<form" in _text(anonymous.get("/login", htmx=True))
    wrong = anonymous.client.post("/login", data={"username": "nobody", "password": "x"}, headers={"HX-Request": "1"})
    assert wrong.status_code == 401 and "Wrong username or password." in _text(wrong)


def test_history_restore_gets_the_whole_page(viewer: DashboardClient) -> None:
    response = viewer.client.get("/jobs", headers={"HX-Request": "true", "HX-History-Restore-Request": "true"})
    assert "<html" in _text(response)


def test_overview_counts_states_and_queues_and_lists_the_newest_dead(
    viewer: DashboardClient, busy: dict[str, int]
) -> None:
    html = _text(viewer.get("/"))
    assert re.search(r'<span class="card-n">1</span><span class="card-l">dead</span>', html)
    assert re.search(r'<span class="card-n">1</span><span class="card-l">queued</span>', html)
    assert re.search(r'<span class="card-n">1</span><span class="card-l">running</span>', html)
    assert re.search(r'<span class="card-n">0</span><span class="card-l">workers alive</span>', html)
    assert '<a id="depth-mail" class="cell-link" href="/jobs?queue=mail">mail</a>' in html
    assert '<a id="depth-media" class="cell-link" href="/jobs?queue=media">media</a>' in html
    assert _rows(html) == [busy["dead"]]  # newest dead jobs, one tap from landing
    assert "ConnectionError: SMTP refused" in html and "second line" not in html
    assert '<svg class="chart"' in html
    assert 'hx-trigger="every 5s"' in html


def test_overview_chart_draws_the_last_hours_outcomes(viewer: DashboardClient, relay: Relay) -> None:
    @relay.handler("flaky", max_attempts=1)
    def flaky(job) -> None:
        if job.payload["fail"]:
            raise RuntimeError("nope")

    from tests.helpers import running_worker, wait_for

    ids = [relay.enqueue("flaky", {"fail": n % 3 == 0}) for n in range(6)]
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: all(relay.get_job(i).status in ("succeeded", "dead") for i in ids), 20, what="jobs to finish")
    html = _text(viewer.get("/"))
    assert "4 succeeded" in html and "2 failed ·" in html and "2 died" in html
    assert 'class="bar-ok"' in html and 'class="bar-fail"' in html
    assert "4 succeeded, 2 failed</title>" in html


def test_jobs_list_rows_show_type_state_attempts_age_and_error(viewer: DashboardClient, busy: dict[str, int]) -> None:
    html = _text(viewer.get("/jobs"))
    assert _rows(html) == sorted(busy.values(), reverse=True)
    assert '<span class="badge s-dead">dead</span>' in html
    assert "attempt 1/20" in html
    assert '<span class="row-error">ConnectionError: SMTP refused</span>' in html
    assert "<time datetime=" in html


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=dead", ["dead"]),
        ("state=queued", ["queued"]),
        ("queue=media", ["succeeded", "claimed"]),
        ("type=send_email", ["dead", "queued"]),
        ("state=dead&type=send_email", ["dead"]),
        ("q=smtp", ["dead"]),
        ("q=RESIZE", ["succeeded", "claimed"]),
        ("state=succeeded&queue=mail", []),
    ],
)
def test_jobs_filters_live_in_the_url(
    viewer: DashboardClient, busy: dict[str, int], query: str, expected: list[str]
) -> None:
    html = _text(viewer.get(f"/jobs?{query}"))
    assert _rows(html) == [busy[name] for name in expected]


def test_a_type_ending_in_a_space_is_its_own_filter_from_the_dead_view(
    viewer: DashboardClient, relay: Relay, db: psycopg.Connection
) -> None:
    """A job type such as ``"mail "`` (stored before enqueues refused it, or written with SQL):
    the dead view links to its jobs by type, and the jobs list trimmed the filter: it listed
    the dead jobs of ``mail`` instead."""
    (spaced,) = db.execute("INSERT INTO relay.jobs (type) VALUES ('mail ') RETURNING id").fetchone()
    plain = relay.enqueue("mail")
    db.execute("UPDATE relay.jobs SET status = 'dead', finished_at = now(), last_error = 'boom'")
    links = sorted(set(re.findall(r'href="(/jobs\?state=dead&amp;type=mail[^"]*)"', _text(viewer.get("/dead")))))
    assert links == ["/jobs?state=dead&amp;type=mail", "/jobs?state=dead&amp;type=mail+"]
    assert _rows(_text(viewer.get("/jobs?state=dead&type=mail+"))) == [spaced]
    assert _rows(_text(viewer.get("/jobs?state=dead&type=mail"))) == [plain]
    assert _rows(_text(viewer.get("/jobs?q=%20boom%20"))) == [plain, spaced]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("state=exploded", "unknown status"),
        # The pages call a claimed job running; the URL's word for it was nowhere on the error page.
        ("state=running", "one of queued, claimed (shown as running), succeeded, dead, cancelled"),
        ("queue=Not%20A%20Queue", "queue"),
        ("before=abc", "cursor"),
        ("before=99999999999999999999", "cursor"),
        # Digits only to str.isdigit(): superscript two, circled one, Arabic-Indic five.
        ("before=%C2%B2", "cursor"),
        ("before=%E2%91%A0", "cursor"),
        ("before=%D9%A5", "cursor"),
        ("before=1_0", "cursor"),
        ("before=010", "cursor"),
        ("before=%205", "cursor"),
        ("before=5%20", "cursor"),
        ("before=" + "9" * 5000, "cursor"),
        # Given twice, the list showed the first value's jobs and named neither.
        ("state=dead&state=queued", "the state parameter is given more than once"),
        ("q=a&q=b", "the q parameter is given more than once"),
        ("before=5&before=6", "the before parameter is given more than once"),
    ],
)
def test_bad_filters_say_what_is_wrong(viewer: DashboardClient, query: str, message: str) -> None:
    response = viewer.get(f"/jobs?{query}")
    assert response.status_code == 400
    assert message in _text(response)


def test_jobs_pages_by_keyset_and_keeps_the_filters(viewer: DashboardClient, relay: Relay) -> None:
    ids = relay.enqueue_many([{"type": "send_email", "queue": "mail"} for _ in range(57)])
    relay.enqueue("other")
    first = _text(viewer.get("/jobs?type=send_email"))
    assert _rows(first) == sorted(ids, reverse=True)[:50]
    older = re.search(r'href="(/jobs\?[^"]*before=\d+[^"]*)">Older jobs', first)
    assert older
    link = older.group(1).replace("&amp;", "&")
    assert "type=send_email" in link
    second = _text(viewer.get(link))
    assert _rows(second) == sorted(ids, reverse=True)[50:]
    assert "Older jobs" not in second
    assert "← Newest" in second


def test_job_page_shows_payload_errors_timings_lease_and_folded_tracebacks(viewer: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add("send_email", {"to": "ops@example.com", "tries": [1, 2]}), "ConnectionError: refused")
    html = _text(viewer.get(f"/jobs/{job_id}"))
    assert '<span class="badge big s-dead">dead</span>' in html
    assert "attempt 1 of 20" in html
    assert "{\n  &#34;to&#34;: &#34;ops@example.com&#34;,\n  &#34;tries&#34;: [\n    1,\n    2\n  ]\n}" in html
    assert re.search(r'<details id="trace-[^"]+-1-1" hx-preserve>\n      <summary>Traceback</summary>', html)  # folded
    assert "<details open" not in html
    assert "smtp.connect(host, port)" in html
    assert "web-1:4242:abc123" in html
    for label in ("Created", "Runs at", "Started", "Finished", "Ran for", "Worker", "Lease until", "Lease token"):
        assert f"<dt>{label}</dt>" in html
    assert "hx-trigger" not in html.split("status-card")[1].split(">")[0]  # finished: no polling


def test_a_job_page_shows_a_payload_nested_deeper_than_python_reads_as_unreadable(
    viewer: DashboardClient, db: psycopg.Connection
) -> None:
    (job_id,) = db.execute(
        "INSERT INTO relay.jobs (type, payload) VALUES ('deep', %s::jsonb) RETURNING id", ("[" * 3000 + "]" * 3000,)
    ).fetchone()
    html = _text(viewer.get(f"/jobs/{job_id}"))
    assert "(unreadable JSON: 6,000 characters nested deeper than Python reads" in html


def test_a_running_jobs_page_polls_and_shows_progress(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection
) -> None:
    job_id = jobs.claimed(jobs.add())
    progress = '{"percent": 40, "message": "page 4 of 10"}'
    db.execute("UPDATE relay.jobs SET progress = %s::jsonb WHERE id = %s", (progress, job_id))
    html = _text(viewer.get(f"/jobs/{job_id}"))
    assert f'hx-get="/jobs/{job_id}?part=status&amp;seen=claimed-1" hx-trigger="every 2s"' in html
    assert '<progress max="100" value="40">' in html and "page 4 of 10" in html
    assert "<dd>—</dd>" in html  # not finished yet


def test_a_succeeded_jobs_page_shows_its_result(viewer: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.succeeded(jobs.add(), {"sent": True})
    html = _text(viewer.get(f"/jobs/{job_id}"))
    assert "<h2>Result</h2>" in html and "&#34;sent&#34;: true" in html


def test_status_card_polls_announce_a_change_of_state(viewer: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.add()
    same = viewer.get(f"/jobs/{job_id}?part=status&seen=queued-0", htmx=True)
    assert "HX-Trigger" not in same.headers
    assert 'class="panel status-card"' in _text(same)
    jobs.claimed(job_id)
    changed = viewer.get(f"/jobs/{job_id}?part=status&seen=queued-0", htmx=True)
    assert changed.headers["HX-Trigger"] == "relay-job-changed"
    history = _text(viewer.get(f"/jobs/{job_id}?part=history", htmx=True))
    assert "<h2>Payload</h2>" in history and "status-card" not in history


def test_status_card_polls_announce_a_failed_attempt_that_left_the_state_as_it_was(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection
) -> None:
    """A retry between two polls (queued, claimed, failed, queued again) adds an error: the history reloads."""
    job_id = jobs.add(max_attempts=3)
    html = _text(viewer.get(f"/jobs/{job_id}"))
    seen = re.search(rf'hx-get="/jobs/{job_id}\?part=status&amp;seen=([^"]+)"', html)
    assert seen, html
    jobs.claimed(job_id)
    history = [{"attempt": 1, "type": "TimeoutError", "message": "TimeoutError: partner timed out"}]
    db.execute(
        "UPDATE relay.jobs SET status = 'queued', claimed_until = NULL, last_error = %s, errors = %s::jsonb "
        "WHERE id = %s",
        (history[0]["message"], json.dumps(history), job_id),
    )
    poll = viewer.get(f"/jobs/{job_id}?part=status&seen={seen.group(1)}", htmx=True)
    assert "attempt 1 of 3" in _text(poll)
    assert poll.headers.get("HX-Trigger") == "relay-job-changed"
    again = re.search(rf'hx-get="/jobs/{job_id}\?part=status&amp;seen=([^"]+)"', _text(poll))
    assert again and again.group(1) != seen.group(1)
    assert "HX-Trigger" not in viewer.get(f"/jobs/{job_id}?part=status&seen={again.group(1)}", htmx=True).headers


@pytest.mark.parametrize("at", ["last tuesday", "9999-12-31T23:59:59-05:00"])
def test_an_error_entry_written_by_hand_does_not_break_the_job_page(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection, at: str
) -> None:
    job_id = jobs.dead(jobs.add())
    history = [{"attempt": 1, "at": at, "type": "Boom", "message": "Boom: written by hand"}]
    db.execute("UPDATE relay.jobs SET errors = %s::jsonb WHERE id = %s", (json.dumps(history), job_id))
    response = viewer.get(f"/jobs/{job_id}")
    assert response.status_code == 200
    assert "Boom: written by hand" in _text(response)


def test_error_history_and_progress_values_that_are_not_text_read_as_json(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection
) -> None:
    """Written by a program with SQL: the page showed Python's spelling, {'x': [1]} and True."""
    job_id = jobs.claimed(jobs.add())
    history = [{"attempt": 1, "type": True, "message": {"x": [1]}}, ["not", "an", "entry"]]
    db.execute(
        "UPDATE relay.jobs SET errors = %s::jsonb, progress = %s::jsonb WHERE id = %s",
        (json.dumps(history), json.dumps({"message": {"a": None}}), job_id),
    )
    html = _text(viewer.get(f"/jobs/{job_id}"))
    for python in ("{&#39;x&#39;: [1]}", "[&#39;not&#39;", "{&#39;a&#39;: None}", ">True<"):
        assert python not in html
    for shown in ("{&#34;x&#34;: [1]}", "[&#34;not&#34;, &#34;an&#34;, &#34;entry&#34;]", "{&#34;a&#34;: null}"):
        assert shown in html


def test_missing_jobs_are_a_404_page(viewer: DashboardClient) -> None:
    for path in ("/jobs/424242", "/jobs/99999999999999999999"):
        response = viewer.get(path)
        assert response.status_code == 404
        assert response.mimetype == "text/html"
        assert "No such page" in _text(response) or "There is no job" in _text(response)


def test_an_unknown_address_is_a_page_in_a_browser_and_a_problem_elsewhere(viewer: DashboardClient) -> None:
    """A mistyped or stale link opened on a phone reads as a page; curl and the API still get problem+json."""
    browser = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
    for path in ("/jobs/abc", "/nope"):
        response = viewer.client.get(path, headers=browser)
        assert (response.status_code, response.mimetype) == (404, "text/html"), path
        assert "No such page" in _text(response) and 'href="/">Go to the overview<' in _text(response)
        # Served outside the dashboard's routes, the page still carries the dashboard's headers.
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"], path
        assert (response.headers["X-Frame-Options"], response.headers["Cache-Control"]) == ("DENY", "no-store")
    for path, headers in (("/api/admin/nope", browser), ("/metrics/nope", browser), ("/nope", {"Accept": "*/*"})):
        response = viewer.client.get(path, headers=headers)
        assert (response.status_code, response.mimetype) == (404, "application/problem+json"), path
    assert viewer.client.get("/nope").mimetype == "application/problem+json"


def test_a_button_only_address_opened_in_a_browser_is_a_page_saying_so(viewer: DashboardClient) -> None:
    """/logout typed by hand answered raw problem+json; the API's POST-only URLs still do."""
    browser = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
    for path in ("/logout", "/jobs/1/requeue", "/dead/requeue"):
        response = viewer.client.get(path, headers=browser)
        assert (response.status_code, response.mimetype) == (405, "text/html"), path
        assert "opening it does nothing" in _text(response) and "POST" in response.headers["Allow"]
        assert "script-src 'self'" in response.headers["Content-Security-Policy"], path
    api = viewer.client.get("/api/admin/jobs/requeue", headers=browser)
    assert (api.status_code, api.mimetype) == (405, "application/problem+json")


#: What a job's polling status card sends (htmx, and the header saying its answer replaces it).
CARD_POLL = {"HX-Request": "true", "Relay-Poll-Replaced": "true"}


def test_a_database_outage_page_retries_as_it_says(make_app, admin: DashboardClient, jobs: Jobs) -> None:
    # The same session on a web process whose database has gone away.
    job_id = jobs.add()
    outage = make_app(RELAY_DATABASE_URL="postgresql://postgres@127.0.0.1:1/nowhere", RELAY_DB_WAIT_SECONDS=1)
    client = DashboardClient(outage.test_client(), admin.dsn)
    client.client.set_cookie("access_token_cookie", admin.client.get_cookie("access_token_cookie").value)
    client.csrf = admin.csrf

    # The status card of a requeued job, polling: the answer replaces the card, so it must poll on.
    card = client.client.get(f"/jobs/{job_id}?part=status&seen=queued", headers=CARD_POLL)
    assert card.status_code == 503
    html = _text(card)
    assert "Database unreachable" in html
    assert "Log in" not in html  # the session is fine; the database is what is missing
    assert f'hx-get="/jobs/{job_id}?part=status&amp;seen=queued"' in html
    assert re.search(r'hx-trigger="every \d+s"', html) and 'hx-swap="outerHTML"' in html
    assert "Relay-Poll-Replaced" in html, "its own retries say so too, or the second one would stop polling"
    # The overview's part is polled by a wrapper that stays: its error adds no second poll.
    overview = client.get("/", htmx=True)
    assert overview.status_code == 503 and "hx-get" not in _text(overview)

    # A page opened during the outage reloads itself.
    full = client.get(f"/jobs/{job_id}")
    assert full.status_code == 503
    assert re.search(r'<meta http-equiv="refresh" content="\d+">', _text(full))
    assert "hx-get" not in _text(full)

    # An action is never repeated by itself, and the page does not promise it will be.
    action = client.post(f"/jobs/{job_id}/cancel")
    assert action.status_code == 503
    assert "hx-get" not in _text(action) and "refresh" not in _text(action)
    assert "will retry" not in _text(action) and "try again" in _text(action)
    assert jobs.status(job_id) == "queued"


def test_a_page_the_statement_timeout_ended_retries_unless_it_is_a_filtered_listing(
    make_app, admin: DashboardClient, jobs: Jobs, dsn: str
) -> None:
    """A polled status card whose query outlasted the statement timeout (a lock held on relay.jobs) was
    replaced by an answer that polled nothing: the card of a requeued job stopped updating for good."""
    job_id = jobs.add()
    slow = make_app(RELAY_STATEMENT_TIMEOUT_MS=300)
    client = DashboardClient(slow.test_client(), admin.dsn)
    client.client.set_cookie("access_token_cookie", admin.client.get_cookie("access_token_cookie").value)
    client.csrf = admin.csrf
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK relay.jobs IN ACCESS EXCLUSIVE MODE")
        card = client.client.get(f"/jobs/{job_id}?part=status&seen=queued", headers=CARD_POLL)
        full = client.get(f"/jobs/{job_id}")
        listing = client.get("/jobs?state=queued")
        overview = client.get("/", htmx=True)
    assert (card.status_code, full.status_code, listing.status_code) == (503, 503, 503)
    html = _text(card)
    assert "Query took too long" in html and "tries again every" in html
    assert f'hx-get="/jobs/{job_id}?part=status&amp;seen=queued"' in html
    assert re.search(r'hx-trigger="every \d+s"', html) and 'hx-swap="outerHTML"' in html
    assert re.search(r'<meta http-equiv="refresh" content="\d+">', _text(full))
    # A filtered listing would be as slow the next time: it asks for narrower filters, and waits for them.
    assert "narrow the filters" in _text(listing)
    assert "refresh" not in _text(listing) and "hx-get" not in _text(listing).split("<main", 1)[-1]
    # A part polled by a wrapper that stays is polled again by it: a poll of its own would make two
    # requests where one is due, each holding a thread and a connection through the timeout.
    assert overview.status_code == 503 and "hx-get" not in _text(overview)
    assert client.get(f"/jobs/{job_id}?part=status&seen=queued", htmx=True).status_code == 200


def test_job_ids_in_urls_are_read_only_as_relay_writes_them(viewer: DashboardClient, relay: Relay) -> None:
    assert relay.enqueue_many([{"type": "t"} for _ in range(22)])[-1] == 22
    assert viewer.get("/jobs/22").status_code == 200
    for spelling in ("022", "%D9%A2%D9%A2", "%EF%BC%92%EF%BC%92", "+22", "22.0", "9" * 5000):
        assert viewer.get(f"/jobs/{spelling}").status_code == 404, spelling[:30]


def test_everything_a_job_carries_is_escaped(viewer: DashboardClient, jobs: Jobs) -> None:
    nasty = f"{SCRIPT}\n{IMG}"
    job_id = jobs.dead(
        jobs.add(IMG, {"html": SCRIPT, IMG: [IMG]}, idempotency_key=SCRIPT),
        message=f"ValueError: {SCRIPT} {IMG}",
        traceback=f"Traceback (most recent call last):\n{nasty}",
    )
    for path in ("/", "/jobs", "/jobs?state=dead", f"/jobs/{job_id}", "/dead"):
        html = _text(viewer.get(path))
        assert "<script>alert" not in html, path
        assert "<img src=x" not in html, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path
        assert "&lt;img src=x onerror=alert(1)&gt;" in html, path


def test_a_number_too_long_for_int_is_shown_as_its_digits(
    viewer: DashboardClient, anonymous: DashboardClient, db: psycopg.Connection, dsn: str
) -> None:
    """A job a program wrote with SQL may hold a number of over 4,300 digits (jsonb writes 1e5000
    out in full); Python reads no such integer from text, and the job's pages answered 500."""
    (job_id,) = db.execute(
        "INSERT INTO relay.jobs (type, payload, status, finished_at, result) "
        """VALUES ('big', '{"n": 1e5000}', 'succeeded', now(), '{"r": -1e4400}') RETURNING id"""
    ).fetchone()
    digits = "1" + "0" * 5000
    page = viewer.get(f"/jobs/{job_id}")
    assert page.status_code == 200 and digits in _text(page)
    token = anonymous.client.post("/api/auth/login", json={"username": "viewer", "password": PASSWORD})
    headers = {"Authorization": f"Bearer {token.get_json()['access_token']}"}
    job = anonymous.client.get(f"/api/admin/jobs/{job_id}", headers=headers)
    assert job.status_code == 200, job.get_json()
    assert (job.get_json()["payload"], job.get_json()["result"]) == ({"n": digits}, {"r": "-1" + "0" * 4400})


def test_a_fraction_past_a_floats_range_is_shown_as_its_digits(
    viewer: DashboardClient, anonymous: DashboardClient, db: psycopg.Connection
) -> None:
    """jsonb holds fractions exactly; read as floats, one past a float's range became inf, which the
    API wrote as the bare token Infinity (no strict JSON parser reads it) and the page showed, and
    1e-400 became 0.0. They are shown as jsonb writes them."""
    huge = "1" + "0" * 400 + ".5"
    (job_id,) = db.execute(
        "INSERT INTO relay.jobs (type, payload, status, finished_at, result) VALUES ('odd', %s, 'succeeded', now(), %s)"
        " RETURNING id",
        (f'{{"huge": {huge}, "tiny": 1e-400, "plain": 0.25}}', huge),
    ).fetchone()
    tiny = "0." + "0" * 399 + "1"
    page = _text(viewer.get(f"/jobs/{job_id}"))
    assert huge in page and tiny in page and "Infinity" not in page
    token = anonymous.client.post("/api/auth/login", json={"username": "viewer", "password": PASSWORD})
    headers = {"Authorization": f"Bearer {token.get_json()['access_token']}"}
    response = anonymous.client.get(f"/api/admin/jobs/{job_id}", headers=headers)
    assert response.status_code == 200

    def not_json(token: str) -> None:
        raise AssertionError(f"the body holds {token}, which is not JSON")

    job = json.loads(response.get_data(as_text=True), parse_constant=not_json)
    assert job["payload"] == {"huge": huge, "tiny": tiny, "plain": 0.25}
    assert job["result"] == huge


def test_a_job_holding_what_a_program_wrote_with_sql_is_listed_and_shown(
    viewer: DashboardClient, anonymous: DashboardClient, db: psycopg.Connection
) -> None:
    """Times no datetime holds ('-infinity', a year BC, 'infinity'), an error history that is not an
    array and a progress percent too large for a float each made the pages that read them answer 500:
    the job lists (every page holding the job), the job's own page, the queues and /metrics."""
    odd = db.execute(
        "INSERT INTO relay.jobs (type, status, run_at, created_at) VALUES"
        " ('odd', 'queued', '-infinity', '0044-03-15 00:00:00+00 BC'),"
        " ('odd', 'queued', 'infinity', now())"
        " RETURNING id"
    ).fetchall()
    (dead,) = db.execute(
        "INSERT INTO relay.jobs (type, status, attempts, finished_at, errors, last_error, progress)"
        " VALUES ('odd', 'dead', 1, 'infinity', '5', 'X: y', %s) RETURNING id",
        ('{"percent": 1' + "0" * 400 + ', "message": "nearly"}',),
    ).fetchone()
    token = anonymous.client.post("/api/auth/login", json={"username": "viewer", "password": PASSWORD})
    headers = {"Authorization": f"Bearer {token.get_json()['access_token']}"}
    for path in ("/api/admin/jobs", "/api/admin/jobs?status=dead", "/api/admin/queues", "/api/admin/stats"):
        answer = anonymous.client.get(path, headers=headers)
        assert answer.status_code == 200, (path, answer.get_json())
    listed = anonymous.client.get("/api/admin/jobs", headers=headers).get_json()["jobs"]
    assert sorted(job["id"] for job in listed) == sorted([dead, *(row[0] for row in odd)])
    first = anonymous.client.get(f"/api/admin/jobs/{odd[0][0]}", headers=headers).get_json()
    assert (first["run_at"], first["created_at"]) == ("0001-01-02T00:00:00Z", "0001-01-02T00:00:00Z")
    last = anonymous.client.get(f"/api/admin/jobs/{dead}", headers=headers).get_json()
    assert last["finished_at"] == "9999-12-30T00:00:00Z"
    assert [entry["message"] for entry in last["errors"]] == ["5"]
    for path in ("/", "/jobs", "/dead", "/queues", "/metrics", *(f"/jobs/{row[0]}" for row in odd), f"/jobs/{dead}"):
        assert viewer.get(path).status_code == 200, path
    assert "100%" in _text(viewer.get(f"/jobs/{dead}"))


def test_dead_view_groups_by_type_with_counts(viewer: DashboardClient, jobs: Jobs) -> None:
    for _ in range(3):
        jobs.dead(jobs.add("send_email"), "ConnectionError: refused")
    jobs.dead(jobs.add("resize_image"), "MemoryError")
    html = _text(viewer.get("/dead"))
    assert "4 dead jobs, by type" in html
    assert '<span class="type">send_email</span><span class="count">3 dead</span>' in html
    assert '<span class="type">resize_image</span><span class="count">1 dead</span>' in html
    assert html.index("send_email</span><span") < html.index("resize_image</span><span")
    assert 'href="/jobs?state=dead&amp;type=send_email"' in html


def test_the_dead_view_and_overview_show_the_jobs_that_died_last(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection, monkeypatch
) -> None:
    """Read newest id first, a job enqueued long ago that died a moment ago sat behind every dead job
    enqueued after it: with more dead jobs than the view counts, its type was in no group, no list and
    no Requeue all, though it was the one failing now."""
    from relay_web.dashboard import views_dead

    monkeypatch.setattr(views_dead, "SCAN_LIMIT", 3)
    charge = jobs.add("charge_card")
    emails = [jobs.add("send_email") for _ in range(6)]
    for job_id in emails:
        jobs.dead(job_id, "ConnectionError: refused")
    jobs.dead(charge, "CardDeclined: do not honour")
    db.execute("UPDATE relay.jobs SET finished_at = finished_at + interval '1 minute' WHERE id = %s", (charge,))
    dead_page = _text(viewer.get("/dead"))
    assert '<span class="type">charge_card</span><span class="count">1+ dead</span>' in dead_page
    assert _rows(dead_page) == [charge, emails[-1], emails[-2]]
    assert _rows(_text(viewer.get("/")))[0] == charge


def test_dead_view_says_at_least_when_there_are_too_many_to_count(
    viewer: DashboardClient, jobs: Jobs, monkeypatch
) -> None:
    from relay_web.dashboard import views_dead

    monkeypatch.setattr(views_dead, "SCAN_LIMIT", 2)
    for _ in range(3):
        jobs.dead(jobs.add("send_email"))
    html = _text(viewer.get("/dead"))
    assert "More than 2 dead jobs" in html
    assert "2+ dead" in html


def test_queues_page_shows_depth_wait_paused_and_lapsed_leases(
    viewer: DashboardClient, busy: dict[str, int], jobs: Jobs, relay: Relay
) -> None:
    relay.pause_queue("media")
    relay.pause_queue("idle")
    html = _text(viewer.get("/queues"))
    for queue in ("idle", "mail", "media"):
        assert f'href="/jobs?queue={queue}">{queue}</a>' in html
    assert html.count('<span class="badge s-paused">paused</span>') == 2
    assert re.search(
        r'<a id="queue:mail:dead" class="tile hot" href="/jobs\?queue=mail&amp;state=dead">\s*'
        r'<span class="tile-n">1</span>',
        html,
    )
    assert "oldest waits" in html
    # mail has a job queued and no live worker serves it; media's only job is running.
    assert "No live worker serves mail" in html and "No live worker serves media" not in html
    assert re.search(r'<div class="tile hot"><span class="tile-n">0</span><span class="tile-l">workers</span>', html)
    overview = _text(viewer.get("/"))
    assert overview.count(">no worker</span>") == 1
    # media's running job holds a live lease; once it lapses, the page says nothing runs it.
    assert "lost its worker" not in html
    lapse = "UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s"
    jobs.db.execute(lapse, (busy["claimed"],))
    html = _text(viewer.get("/queues"))
    assert "1 running job of media lost its worker (the lease ran out)" in html


def test_workers_page_lists_the_registry(viewer: DashboardClient, relay: Relay) -> None:
    from tests.helpers import running_worker

    with running_worker(relay, queues=("mail", "media"), concurrency=3) as worker:
        from tests.helpers import wait_for

        wait_for(lambda: worker.id in _text(viewer.get("/workers")), 10, what="worker registered")
        html = _text(viewer.get("/workers"))
    assert "1 alive" in html
    assert '<span class="badge s-alive">alive</span>' in html
    assert "mail, media" in html and "<dt>Slots</dt><dd>3</dd>" in html


def test_a_workers_claimed_jobs_are_read_from_the_jobs_it_holds_now(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection
) -> None:
    """The page showed the count the worker reported at its last heartbeat, prefetched jobs included:
    "Running 7 of 4 slots" while it held one job, and a killed worker kept its last count for good."""
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, in_flight, last_seen_at) VALUES"
        " ('alive-1', 'h', 1, '{default}', 4, 7, now()),"
        " ('gone-1', 'h', 2, '{default}', 2, 4, now() - interval '1 hour')"
    )
    jobs.claimed(jobs.add(), worker="alive-1")
    for _ in range(2):
        jobs.claimed(jobs.add(), worker="gone-1")
    html = _text(viewer.get("/workers"))
    alive, gone = html.split('<span class="mono type">alive-1</span>')[1].split('<span class="mono type">gone-1</span>')
    assert "<dt>Slots</dt><dd>4</dd>" in alive and "<dt>Jobs claimed</dt><dd>1</dd>" in alive
    assert "<dt>Jobs claimed</dt><dd>2 (back to the queue as their leases run out)</dd>" in gone


@pytest.mark.parametrize("heartbeat", ["NaN", "1e300", "Infinity"])
def test_a_worker_row_with_an_impossible_heartbeat_interval_breaks_no_page(
    viewer: DashboardClient, db: psycopg.Connection, heartbeat: str
) -> None:
    """The registry is a table SQL can write: the overview, workers and queues pages answered 500."""
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, heartbeat_seconds, last_seen_at)"
        " VALUES ('odd', 'h', 1, '{default}', 1, %s::float8, now() - interval '1 hour')",
        (heartbeat,),
    )
    for page in ("/", "/workers", "/queues"):
        response = viewer.get(page)
        assert response.status_code == 200, (page, response.status_code)
    assert "odd" in _text(viewer.get("/workers"))


def test_schedules_page_shows_the_next_run(viewer: DashboardClient, relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("nightly_report", cron="0 3 * * *", queue="reports")
    def nightly(job) -> None:
        pass

    from relay_core.worker.maintenance import register

    periodic.publish(db, relay.handlers.values())
    # It checks the schedules of every queue, this one's in "reports" too.
    register(db, "w1", ("default",), 8, 10.0, periodic.checked_schedule_definitions(relay.handlers.values()))
    html = _text(viewer.get("/schedules"))
    assert 'href="/jobs?type=nightly_report">nightly_report</a>' in html
    assert "0 3 * * *" in html and "<dt>Next run</dt>" in html and "03:00:00 UTC" in html
    # No running worker checks it (its handler is gone, or no worker runs): no tick will come.
    db.execute("UPDATE relay.workers SET stopped_at = now()")
    db.commit()
    html = _text(viewer.get("/schedules"))
    assert "<dt>Next run</dt><dd>none: no running worker checks this schedule</dd>" in html
    assert "03:00:00 UTC" not in html


def _last_run(html: str) -> str:
    return re.search(r"<dt>Last run</dt><dd>(.*?)</dd>", html, re.S).group(1)  # type: ignore[union-attr]


def _times(html: str) -> list[datetime]:
    return [datetime.fromisoformat(t) for t in re.findall(r'<time datetime="([^"]+)"', html)]


def test_schedules_page_shows_the_last_tick_that_enqueued_a_job(
    viewer: DashboardClient, relay: Relay, db: psycopg.Connection, jobs: Jobs
) -> None:
    """Not the tick before registration, not a tick skipped as missed: the last one that enqueued a job."""

    @relay.handler("nightly_report", cron="0 3 * * *", queue="reports")
    def nightly(job) -> None:
        pass

    specs = list(relay.handlers.values())
    periodic.publish(db, specs)
    assert _last_run(_text(viewer.get("/schedules"))) == "never"

    # Yesterday's tick, checked on time, enqueues a job; today's falls due while no worker runs and is skipped.
    (today,) = db.execute("SELECT last_tick FROM relay.schedules").fetchone()
    yesterday = today - timedelta(days=1)
    db.execute("UPDATE relay.schedules SET last_tick = %s", (yesterday - timedelta(days=1),))
    assert periodic.enqueue_due(db, specs, clock=yesterday + timedelta(seconds=10)) != []
    assert periodic.enqueue_due(db, specs, clock=today + timedelta(hours=1)) == []
    (job_id,) = db.execute("SELECT id FROM relay.jobs").fetchone()
    last_run = _last_run(_text(viewer.get("/schedules")))
    assert _times(last_run) == [yesterday]
    assert f'<a class="cell-link" href="/jobs/{job_id}">job #{job_id}</a>' in last_run
    assert '<span class="badge s-queued">queued</span>' in last_run

    jobs.dead(job_id)
    assert '<span class="badge s-dead">dead</span>' in _last_run(_text(viewer.get("/schedules")))

    # Retention pruned the job: the run is still shown, without a link to a job that no longer exists.
    db.execute("DELETE FROM relay.jobs")
    last_run = _last_run(_text(viewer.get("/schedules")))
    assert _times(last_run) == [yesterday]
    assert "href=" not in last_run and f"#{job_id}" in last_run and "removed by retention" in last_run

    # A schedule older than Relay's record of runs, with no job left to read its last run from.
    db.execute("UPDATE relay.schedules SET last_enqueued_tick = NULL, last_job_id = NULL, runs_recorded_since = now()")
    last_run = _last_run(_text(viewer.get("/schedules")))
    assert last_run.startswith("none since <time") and "not recorded" in last_run


def test_schedules_page_shows_type_limits(viewer: DashboardClient, relay: Relay, db: psycopg.Connection) -> None:
    from relay_core.worker import limits

    @relay.handler("send_email", concurrency=3, rate_limit=(100, 60))
    def send(job) -> None:
        pass

    limits.publish(db, relay.handlers.values())
    html = _text(viewer.get("/schedules"))
    assert 'href="/jobs?type=send_email">send_email</a>' in html
    assert "at most 3" in html and "at most 100 per 1m" in html and "0 running" in html


def test_static_files_are_vendored(viewer: DashboardClient) -> None:
    htmx = viewer.client.get("/static/htmx.min.js")
    assert htmx.status_code == 200
    assert htmx.get_data(as_text=True).startswith("/* htmx 2.0.11 ")
    css = viewer.client.get("/static/dashboard.css")
    assert css.status_code == 200 and "min-height: 44px" in css.get_data(as_text=True)
    htmx.close()
    css.close()


def test_the_api_still_answers_problems(anonymous: DashboardClient) -> None:
    response = anonymous.client.get("/api/admin/jobs")
    assert response.status_code == 401
    assert response.mimetype == "application/problem+json"


def test_traceback_constant_is_a_real_one() -> None:
    assert TRACEBACK.startswith("Traceback (most recent call last):")


@pytest.mark.parametrize("path", ["/", "/queues"])
def test_truncating_the_jobs_while_a_page_reads_the_counters_deadlocks_nothing(
    path: str, viewer: DashboardClient, jobs: Jobs, dsn: str, db: psycopg.Connection
) -> None:
    """The overview and the queues page held the counters while they went on to read relay.jobs: with
    TRUNCATE relay.jobs between the two, one of them was cancelled as a deadlock."""
    jobs.add(queue="mail")
    page, truncate_error = read_while_truncating(dsn, db, lambda: viewer.get(path))
    assert truncate_error is None
    assert page.status_code == 200, _text(page)
    assert db.execute("SELECT coalesce(sum(n), 0) FROM relay.job_counts").fetchone()[0] == 0


def test_a_login_while_the_database_is_down_shows_the_form_again_with_the_name_kept(make_app, dsn: str) -> None:
    """It answered with an error page whose reload sent the form again, the name typed lost."""
    outage = make_app(RELAY_DATABASE_URL="postgresql://postgres@127.0.0.1:1/nowhere", RELAY_DB_WAIT_SECONDS=1)
    response = DashboardClient(outage.test_client(), dsn).login("ops")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    html = _text(response)
    assert "Relay cannot reach its database right now, so nobody can log in. Try again in a moment." in html
    assert '<form method="post" action="/login">' in html and 'value="ops"' in html


def test_a_job_page_shows_its_times_not_only_in_a_title(viewer: DashboardClient, jobs: Jobs) -> None:
    """A phone has no hover: a time only in a title attribute cannot be read there."""
    job_id = jobs.dead(jobs.add())
    html = _text(viewer.get(f"/jobs/{job_id}"))
    created = re.search(
        r'<dt>Created</dt><dd><time datetime="[^"]+" title="([^"]+)">[^<]+</time> <span class="stamp">([^<]+)</span>',
        html,
    )
    assert created and created[1] == created[2] and created[2].endswith(" UTC"), html
    attempt = html.split('class="attempt-head"')[1].split("</p>")[0]
    assert re.search(r'<span class="stamp">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</span>', attempt), attempt


def test_a_long_error_history_shows_the_newest_ten_and_folds_the_rest(
    viewer: DashboardClient, jobs: Jobs, db: psycopg.Connection
) -> None:
    job_id = jobs.add()
    errors = [
        {"attempt": n, "message": f"failure number {n}", "at": f"2026-12-06T10:{n:02d}:00+00:00"} for n in range(1, 26)
    ]
    db.execute("UPDATE relay.jobs SET errors = %s WHERE id = %s", (Jsonb(errors), job_id))
    html = _text(viewer.get(f"/jobs/{job_id}"))
    assert "<h2>Errors (25)</h2>" in html
    shown, folded = html.split('<details class="older"><summary>15 older attempts</summary>')
    assert [int(n) for n in re.findall(r"failure number (\d+)", shown)] == list(range(25, 15, -1))
    assert [int(n) for n in re.findall(r"failure number (\d+)", folded)] == list(range(15, 0, -1))


def test_a_type_filter_with_a_space_at_its_end_says_why_nothing_matches(viewer: DashboardClient, jobs: Jobs) -> None:
    """A phone's keyboard adds a space after a word it completed; the page said only "No jobs match"."""
    jobs.add("send_email")
    assert "send_email" in _text(viewer.get("/jobs?type=send_email"))
    html = _text(viewer.get("/jobs?type=send_email+"))
    assert "No jobs match. The type starts or ends with a space, and a type is matched exactly as written." in html
    assert "starts or ends with a space" not in _text(viewer.get("/jobs?type=nothing"))


def test_direction_controls_a_job_carries_are_written_out_not_obeyed(viewer: DashboardClient, jobs: Jobs) -> None:
    """A right-to-left override in an error drew "gnp.exe" as "exe.png" and reordered the payload around it."""
    override = "\u202e"
    job_id = jobs.dead(
        jobs.add("send_email", {"file": f"invoice{override}gnp.exe"}), f"ValueError: bad {override}gnp.exe"
    )
    for page in (f"/jobs/{job_id}", "/dead", "/jobs"):
        html = _text(viewer.get(page))
        assert override not in html, page
        assert "[U+202E]gnp.exe" in html, page
    assert "invoice[U+202E]gnp.exe" in _text(viewer.get(f"/jobs/{job_id}"))
    assert jobs.status(job_id) == "dead"


def test_a_type_holding_a_direction_control_goes_back_to_the_server_as_it_is(
    admin: DashboardClient, jobs: Jobs
) -> None:
    """Written out in the dead page's form, the type came back from "Requeue all" as another type:
    "Nothing requeued: no dead report[U+202E]FDP jobs are left", and the job stayed dead."""
    job_type = "report\u202efdp"
    job_id = jobs.dead(jobs.add(job_type))
    page = _text(admin.get("/dead"))
    assert f'<input type="hidden" name="type" value="{job_type}">' in page
    assert "report[U+202E]fdp" in page  # shown written out
    read_at = re.search(r'name="finished_by" value="([^"]+)"', page)
    assert read_at, page
    response = admin.post("/dead/requeue", {"type": job_type, "finished_by": read_at[1]})
    assert response.status_code == 200, _text(response)
    assert jobs.status(job_id) == "queued"
    listing = _text(admin.get("/jobs", query_string={"type": job_type}))
    assert f'<input name="type" value="{job_type}"' in listing


def test_a_job_that_succeeded_after_failing_lists_without_its_old_error(viewer: DashboardClient, jobs: Jobs) -> None:
    """Its row showed the last failure in red beside "succeeded", where its own page shows no error."""
    retried = jobs.succeeded(jobs.dead(jobs.add("retry_ok"), message="TimeoutError: smtp timed out"))
    failing = jobs.dead(jobs.add("retry_ok"), message="TimeoutError: smtp down")
    html = _text(viewer.get("/jobs?type=retry_ok"))
    assert _rows(html) == [failing, retried]
    assert "smtp timed out" not in html
    assert '<span class="row-error">TimeoutError: smtp down</span>' in html
