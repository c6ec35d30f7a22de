"""The dashboard in a real browser at a phone's viewport, against the app and a real worker.

The on-call path: log in, open the dead jobs, open one, read its error,
requeue it, watch it become queued and then succeed once the worker runs it.
Also: a job whose error is markup renders as text and runs nothing, every
page fits 390 px without sideways scrolling, and tap targets are 44 px.
Each page is saved to test-artifacts/screenshots/.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Error as PlaywrightError

from relay_core import Relay, Worker
from relay_web.dashboard import views_system
from tests.helpers import running_worker, wait_for

from .browser import PHONE, LiveServer, screenshot
from .conftest import PASSWORD, make_user

pytestmark = pytest.mark.timeout(120)

SMTP_ERROR = "ConnectionError: SMTP server mail.example.com:587 refused the connection"
XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = "<img src=x onerror=alert(1)>"

#: Interactive elements smaller than 44x44 px (inline links inside text excepted).
SMALL_TARGETS = """
() => [...document.querySelectorAll('a, button, summary, input:not([type=hidden]), select')]
  .filter(e => e.offsetParent !== null)
  .map(e => [e, e.getBoundingClientRect()])
  .filter(([e, r]) => r.height < 44 || r.width < 44)
  .map(([e, r]) => `${e.tagName} "${e.textContent.trim().slice(0, 30)}" ${Math.round(r.width)}x${Math.round(r.height)}`)
"""


class Shop:
    """A worker app whose mail server is down until the test fixes it."""

    def __init__(self, dsn: str) -> None:
        self.relay = Relay(dsn)
        self.smtp_down = threading.Event()
        self.smtp_down.set()

        @self.relay.handler("send_email", max_attempts=1)
        def send_email(job: Any) -> dict[str, Any]:
            if self.smtp_down.is_set():
                raise ConnectionError("SMTP server mail.example.com:587 refused the connection")
            return {"sent_to": job.payload["to"]}

        @self.relay.handler("render_invoice", max_attempts=1)
        def render_invoice(job: Any) -> None:
            raise ValueError(f"{XSS_SCRIPT} {XSS_IMG}")

        @self.relay.handler("nightly_report", cron="0 3 * * *")
        def nightly_report(job: Any) -> None:
            return None


@pytest.fixture
def shop(dsn: str) -> Iterator[Shop]:
    """The worker app, with a worker running it in a thread (stopped after the test)."""
    app = Shop(dsn)
    with running_worker(app.relay, poll_interval=0.1, queues=("default", "mail")):
        yield app
    app.relay.close()


def _dead(shop: Shop, job_id: int) -> None:
    wait_for(lambda: shop.relay.get_job(job_id).status == "dead", 20, what=f"job {job_id} to die")


def _log_in(page: Any, server: LiveServer, username: str = "ops", shot: str | None = None) -> None:
    page.goto(server.at("/"))
    page.fill("#username", username)
    page.fill("#password", PASSWORD)
    if shot:
        screenshot(page, shot)
    page.click("button[type=submit]")
    page.wait_for_url(server.at("/"))


#: Elements whose right edge lies past their panel's (which the page's width alone does not show).
STICKING_OUT = """
() => [...document.querySelectorAll('.panel *')].filter(e => {
  const panel = e.closest('.panel').getBoundingClientRect();
  return e.getBoundingClientRect().right > panel.right + 0.5 && !e.closest('.table-scroll, .row-error');
}).map(e => e.tagName + '.' + e.className)
"""


def _fits_the_phone(page: Any) -> None:
    width = page.evaluate("document.scrollingElement.scrollWidth")
    assert width <= 390, f"{page.url} scrolls sideways: {width}px wide"
    out = page.evaluate(STICKING_OUT)
    assert not out, f"{page.url} has elements sticking out of their panels: {out}"
    small = page.evaluate(SMALL_TARGETS)
    assert not small, f"{page.url} has tap targets under 44px: {small}"


def test_on_call_requeues_a_dead_job_and_watches_it_succeed(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "customer@example.com"})
    _dead(shop, job_id)

    _log_in(phone, live_server, shot="login")
    dead_card = phone.locator("a.card", has_text="dead")
    assert dead_card.locator(".card-n").inner_text() == "1"
    screenshot(phone, "overview")

    dead_card.click()  # tap 1
    phone.wait_for_url(live_server.at("/dead"))
    assert SMTP_ERROR in phone.locator(".group .row-error").inner_text()
    screenshot(phone, "dead")

    phone.locator(f'.rows a.row[href="/jobs/{job_id}"]').click()  # tap 2
    phone.wait_for_url(live_server.at(f"/jobs/{job_id}"))
    card = phone.locator(".status-card")
    assert card.locator(".badge").inner_text() == "dead"
    assert SMTP_ERROR in card.locator(".error-line").inner_text()
    requeue = card.get_by_role("button", name="Requeue")
    assert requeue.is_visible()
    trace = phone.locator("details").first
    assert trace.get_attribute("open") is None  # folded
    assert not phone.locator("pre.trace").first.is_visible()
    screenshot(phone, "job-dead")

    shop.smtp_down.clear()  # the mail server is back
    requeue.click()
    assert phone.dialogs == [("confirm", f"Requeue job {job_id} (send_email)? It runs again now, with fresh attempts.")]
    # The answer is the card of the requeued job; it then refreshes itself every 2 s.
    phone.locator(".status-card .flash", has_text="Requeued").wait_for()
    # The pressed button is gone with the swap: the keyboard focus goes to the answer, not to <body>.
    assert phone.evaluate("document.activeElement.textContent").startswith("Requeued")
    phone.locator(".status-card .badge", has_text="queued").wait_for()
    phone.locator(".status-card .badge", has_text="succeeded").wait_for(timeout=20_000)
    assert shop.relay.get_job(job_id).status == "succeeded"
    phone.get_by_text('"sent_to": "customer@example.com"').wait_for()
    screenshot(phone, "job-succeeded")
    assert not [e for e in phone.console_errors if "Content Security Policy" in e], phone.console_errors


def test_a_job_carrying_markup_renders_inert(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    make_user(shop.relay.dsn, "ops", "admin")
    _log_in(phone, live_server)
    dead_count = phone.locator("a.card", has_text="dead").locator(".card-n")
    assert dead_count.inner_text() == "0"
    phone.evaluate("window.relayTestMarker = true")
    job_id = shop.relay.enqueue("render_invoice", {"note": XSS_IMG, "html": XSS_SCRIPT})
    _dead(shop, job_id)
    # The overview refreshes itself (htmx polling): the new dead job shows up without a reload.
    phone.locator("a.card", has_text="dead").locator(".card-n", has_text="1").wait_for(timeout=15_000)
    assert phone.evaluate("window.relayTestMarker") is True
    assert phone.get_by_text(XSS_SCRIPT).first.is_visible()
    for path in ("/", "/dead", "/jobs?state=dead", f"/jobs/{job_id}"):
        phone.goto(live_server.at(path))
        assert phone.get_by_text(XSS_SCRIPT).first.is_visible(), path
        assert phone.locator("img").count() == 0, path
    phone.locator("summary", has_text="Traceback").first.click()
    assert phone.locator("pre.trace").first.is_visible()
    assert XSS_IMG in phone.locator("pre.trace").first.inner_text()
    assert phone.get_by_text(f'"note": "{XSS_IMG}"').is_visible()
    screenshot(phone, "job-xss")
    phone.wait_for_timeout(300)  # give anything that would fire a moment to do so
    assert phone.dialogs == []


def test_every_page_fits_a_phone(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    make_user(shop.relay.dsn, "ops", "admin")
    long_type = "sync_customer_records_from_the_billing_provider_" + "x" * 60
    dead = shop.relay.enqueue("send_email", {"to": "a@example.com", "body": "y" * 400})
    shop.relay.enqueue(long_type, {"word": "z" * 300}, queue="a-rather-long-queue-name-for-billing-exports")
    shop.relay.enqueue("send_email", {"to": "b@example.com"}, queue="mail")
    _dead(shop, dead)
    shop.relay.pause_queue("mail")
    # A last run to lay out, with its job's link and badge (the dead job stands in for the tick's job).
    with psycopg.connect(shop.relay.dsn, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT count(*) FROM relay.schedules").fetchone()[0], what="schedule")
        conn.execute("UPDATE relay.schedules SET last_enqueued_tick = last_tick, last_job_id = %s", (dead,))
    _log_in(phone, live_server)
    for name, path in [
        ("overview", "/"),
        ("jobs", "/jobs"),
        ("jobs-filtered", "/jobs?state=dead&type=send_email"),
        ("dead", "/dead"),
        ("job", f"/jobs/{dead}"),
        ("queues", "/queues"),
        ("workers", "/workers"),
        ("schedules", "/schedules"),
    ]:
        phone.goto(live_server.at(path))
        if name == "job":
            phone.locator("summary", has_text="Traceback").first.click()
        if name == "jobs":
            phone.locator("summary", has_text="Filter").click()
        _fits_the_phone(phone)
        screenshot(phone, f"phone-{name}")
    phone.goto(live_server.at("/schedules"))
    assert phone.get_by_text("nightly_report").is_visible()
    assert phone.get_by_role("link", name=f"job #{dead}").is_visible()
    phone.goto(live_server.at("/workers"))
    assert phone.locator(".badge", has_text="alive").count() == 1
    assert not [e for e in phone.console_errors if "Content Security Policy" in e], phone.console_errors


#: Words in the overview's by-queue table that are laid out on more than one line.
BROKEN_WORDS = """
() => {
  const broken = [];
  for (const cell of document.querySelectorAll('table.grid th, table.grid td')) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const word = node.textContent.trim();
      if (!word || word.includes(' ')) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
      if (lines.size > 1) broken.push(word);
    }
  }
  return broken;
}
"""


@pytest.mark.parametrize("long_queue", [None, "webhooks_partner", "q" * 63])
def test_the_by_queue_table_keeps_its_words_whole_at_360px(
    phone: Any, live_server: LiveServer, shop: Shop, long_queue: str | None
) -> None:
    """At 360 px (many Android phones) the table's header read "Queu|e" and its queue "defau|lt".
    Kept whole, a queue name as long as ``webhooks_partner`` pushed the Waiting column out of the
    table's scroller, with nothing on screen to say a column was missing: a long name now breaks."""
    make_user(shop.relay.dsn, "ops", "admin")
    shop.relay.enqueue("send_email", {"to": "c@example.com"})
    _dead(shop, shop.relay.enqueue("send_email", {"to": "d@example.com"}, queue="mail"))
    if long_queue:
        shop.relay.enqueue("send_email", {"to": "e@example.com"}, queue=long_queue)
    phone.set_viewport_size({"width": 360, "height": 740})
    _log_in(phone, live_server)
    phone.locator("table.grid").wait_for()
    assert phone.locator("table.grid td", has_text="default").count() == 1
    assert phone.evaluate(BROKEN_WORDS) == ([long_queue] if long_queue else [])
    assert phone.evaluate("document.scrollingElement.scrollWidth") <= 360
    # All five columns in view, no swipe within the table's own scroller either.
    assert phone.evaluate("(s => s.scrollWidth <= s.clientWidth)(document.querySelector('.table-scroll'))")
    _fits_the_phone(phone)  # tap targets still 44 px, nothing sticking out of its panel
    screenshot(phone, "phone-360-overview")


def test_a_long_username_leaves_the_phone_header_whole(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    """An e-mail address as username wrapped "Relay" into "Rel|ay" and "Log out" onto two lines, and pushed
    the role out of sight: whether one is an admin was not on screen."""
    name = "oncall.engineer.with.a.very.long.name@example-company.com"
    make_user(shop.relay.dsn, name, "admin")
    phone.set_viewport_size({"width": 390, "height": 844})
    _log_in(phone, live_server, name)
    for selector in (".brand", ".btn-header"):
        box = phone.locator(selector).bounding_box()
        text_lines = phone.locator(selector).evaluate(
            "e => { const r = document.createRange(); r.selectNodeContents(e);"
            " return new Set([...r.getClientRects()].map(x => Math.round(x.top))).size; }"
        )
        assert text_lines == 1, selector
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, selector
    role, holder = phone.locator(".who-role").bounding_box(), phone.locator(".who-name").bounding_box()
    assert role is not None and holder is not None and role["width"] > 0
    assert role["x"] + role["width"] <= min(390, holder["x"] + holder["width"])  # not clipped by its ellipsis
    assert phone.locator(".who-role").inner_text() == "admin"
    assert phone.evaluate("document.scrollingElement.scrollWidth") <= 390
    screenshot(phone, "phone-long-username")


def test_a_queue_is_paused_and_resumed_from_the_phone(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    make_user(shop.relay.dsn, "ops", "admin")
    _dead(shop, shop.relay.enqueue("send_email", {"to": "d@example.com"}, queue="mail"))
    _log_in(phone, live_server)
    phone.goto(live_server.at("/queues"))
    phone.get_by_role("button", name="Pause mail").click()
    phone.get_by_text("Paused mail: workers claim nothing").wait_for()
    assert shop.relay.paused_queues() == ["mail"]
    phone.get_by_role("button", name="Resume mail").click()
    phone.get_by_text("Resumed mail.").wait_for()
    assert shop.relay.paused_queues() == []


def test_a_viewer_sees_no_buttons_and_desktop_width_works(browser: Any, live_server: LiveServer, shop: Shop) -> None:
    make_user(shop.relay.dsn, "watcher", "viewer")
    job_id = shop.relay.enqueue("send_email", {"to": "c@example.com"})
    _dead(shop, job_id)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(15_000)
    try:
        page = context.new_page()
        _log_in(page, live_server, "watcher")
        screenshot(page, "desktop-overview")
        page.goto(live_server.at(f"/jobs/{job_id}"))
        assert page.locator(".status-card .badge").inner_text() == "dead"
        assert page.locator("main button").count() == 0
        assert page.evaluate("document.scrollingElement.scrollWidth") <= 1280
        screenshot(page, "desktop-job-viewer")
        page.goto(live_server.at("/dead"))
        assert page.locator("main button").count() == 0
    finally:
        context.close()


@pytest.mark.parametrize("width", [820, 1280])
def test_the_dead_page_fits_a_tablet_or_desktop_with_long_errors(
    browser: Any, live_server: LiveServer, shop: Shop, width: int
) -> None:
    """Two columns of groups: a long error line widened its column past the window, and the second
    type, with its Requeue-all button, lay off screen."""
    make_user(shop.relay.dsn, "ops", "admin")
    with psycopg.connect(shop.relay.dsn, autocommit=True) as conn:
        for job_type in ("charge_card", "sync_ledger"):
            conn.execute(
                "INSERT INTO relay.jobs (type, status, attempts, last_error, finished_at)"
                " VALUES (%s, 'dead', 1, %s, now())",
                (job_type, "PaymentGatewayError: " + "the gateway refused the request; " * 10),
            )
    context = browser.new_context(viewport={"width": width, "height": 900})
    context.set_default_timeout(15_000)
    try:
        page = context.new_page()
        _log_in(page, live_server)
        page.goto(live_server.at("/dead"))
        assert page.evaluate("document.scrollingElement.scrollWidth") <= width
        for button in page.get_by_role("button", name=re.compile("^Requeue all")).all():
            assert button.bounding_box()["x"] + button.bounding_box()["width"] <= width
    finally:
        context.close()


def test_worker_type_is_the_public_one() -> None:
    assert Worker.__module__.startswith("relay_core")


#: Resolves after the next htmx swap settles, with what then has the focus.
FOCUS_AFTER_NEXT_SWAP = """
() => new Promise(resolve => document.body.addEventListener('htmx:afterSettle', () => {
  const e = document.activeElement;
  resolve(e === document.body ? 'body' : `${e.tagName} ${e.getAttribute('href') || e.textContent.trim()}`);
}, {once: true}))
"""


def test_polling_keeps_the_keyboard_focus(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    """Someone tabbing through a page that refreshes itself stays where they were, not back at the top."""
    make_user(shop.relay.dsn, "ops", "admin")
    later = datetime.now(UTC) + timedelta(days=1)
    shop.relay.enqueue("send_email", {"to": "e@example.com"}, queue="billing")
    waiting = shop.relay.enqueue("send_email", {"to": "f@example.com"}, run_at=later)
    _log_in(phone, live_server)

    phone.locator("a.card", has_text="queued").focus()  # the overview refreshes every 5 s
    assert phone.evaluate(FOCUS_AFTER_NEXT_SWAP) == "A /jobs?state=queued"

    phone.goto(live_server.at(f"/jobs/{waiting}"))  # a queued job's card refreshes every 2 s
    phone.get_by_role("button", name="Cancel").focus()
    assert phone.evaluate(FOCUS_AFTER_NEXT_SWAP) == "BUTTON Cancel"

    phone.goto(live_server.at("/queues"))  # every 10 s
    phone.get_by_role("button", name="Pause billing").focus()
    assert phone.evaluate(FOCUS_AFTER_NEXT_SWAP) == "BUTTON Pause billing"
    phone.keyboard.press("Enter")  # pause it from the keyboard: the focus moves to its Resume button
    phone.get_by_text("Paused billing").wait_for()
    assert phone.evaluate("document.activeElement.textContent.trim()") == "Resume billing"


#: The contrast ratio (WCAG 2) of an element's text against its own background colour.
CONTRAST = """
e => {
  const rgb = c => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const lum = c => rgb(c).map(v => v / 255).map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const style = getComputedStyle(e);
  const [a, b] = [lum(style.color), lum(style.backgroundColor)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}
"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_primary_buttons_are_readable_in_both_colour_schemes(
    browser: Any, live_server: LiveServer, shop: Shop, scheme: str
) -> None:
    """Requeue and Log in are 16 px text: WCAG AA asks 4.5:1, on a phone set to dark at night too."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "g@example.com"})
    _dead(shop, job_id)
    context = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True, color_scheme=scheme)
    context.set_default_timeout(15_000)
    try:
        page = context.new_page()
        page.goto(live_server.at("/login"))
        assert page.locator("button", has_text="Log in").evaluate(CONTRAST) >= 4.5
        _log_in(page, live_server)
        page.goto(live_server.at(f"/jobs/{job_id}"))
        assert page.get_by_role("button", name="Requeue").evaluate(CONTRAST) >= 4.5
    finally:
        context.close()


def test_an_action_pressed_while_the_card_refreshes_shows_its_own_answer(
    phone: Any, live_server: LiveServer, shop: Shop
) -> None:
    """A refresh that answered while a Cancel was on its way replaced the card, and the Cancel's answer was
    dropped: the page went on saying "queued" with its Cancel button, though the job was cancelled."""
    make_user(shop.relay.dsn, "ops", "admin")
    waiting = shop.relay.enqueue("send_email", {"to": "g@example.com"}, run_at=datetime.now(UTC) + timedelta(days=1))
    _log_in(phone, live_server)
    held: dict[str, Any] = {}

    def hold(name: str) -> Any:
        def handler(route: Any) -> None:
            if name in held:
                route.continue_()
            else:
                held[name] = route

        return handler

    phone.route(re.compile(r".*[?&]part=status.*"), hold("refresh"))
    phone.route(re.compile(r".*/cancel$"), hold("cancel"))
    phone.goto(live_server.at(f"/jobs/{waiting}"))
    wait_for(lambda: phone.wait_for_timeout(50) or "refresh" in held, 10, what="the card's refresh")
    phone.get_by_role("button", name="Cancel").click()
    wait_for(lambda: phone.wait_for_timeout(50) or "cancel" in held, 10, what="the cancel")
    with contextlib.suppress(PlaywrightError):  # the browser may have given the refresh up
        held["refresh"].continue_()
    phone.wait_for_timeout(500)  # a refresh answered now would replace the card the cancel is for
    held["cancel"].continue_()

    phone.locator(".status-card .flash", has_text="Cancelled: it will not run.").wait_for(timeout=5_000)
    assert phone.locator(".status-card .badge").inner_text() == "cancelled"
    assert shop.relay.get_job(waiting).status == "cancelled"


def _press_while_held(phone: Any, button: Any, held: list[Any]) -> None:
    """Press ``button``, whose request ``held`` keeps back: it is disabled on its way; a second tap sends nothing."""
    button.click()
    wait_for(lambda: phone.wait_for_timeout(50) or held, 10, what="the action to be sent")
    assert button.is_disabled()
    with contextlib.suppress(PlaywrightError):
        button.click(timeout=500)  # a second tap: the button takes none
    phone.wait_for_timeout(300)
    assert len(held) == 1


def _queues_page_of_mail(phone: Any, live_server: LiveServer, shop: Shop, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logged in as an admin on the Queues page, which refreshes every second, with the queue mail on it."""
    monkeypatch.setattr(views_system, "REFRESH_SECONDS", 1)
    make_user(shop.relay.dsn, "ops", "admin")
    _dead(shop, shop.relay.enqueue("send_email", {"to": "k@example.com"}, queue="mail"))
    _log_in(phone, live_server)
    phone.goto(live_server.at("/queues"))


def test_a_second_press_while_a_requeue_is_on_its_way_sends_nothing(
    phone: Any, live_server: LiveServer, shop: Shop
) -> None:
    """A second press replaced the first in the card's request queue: the browser dropped the first's answer after
    the server had requeued the job, and the page showed only the second's "Nothing done: it has run again"."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "h@example.com"})
    _dead(shop, job_id)
    _log_in(phone, live_server)
    held: list[Any] = []
    phone.route(re.compile(r".*/requeue$"), lambda route: held.append(route))
    phone.goto(live_server.at(f"/jobs/{job_id}"))
    _press_while_held(phone, phone.get_by_role("button", name="Requeue"), held)
    assert len(phone.dialogs) == 1
    held[0].continue_()
    phone.locator("#job-notice", has_text="Requeued").wait_for(timeout=5_000)
    # The answer stays through the card's next refreshes (every 2 s); it was gone after the first.
    phone.wait_for_timeout(4_500)
    assert phone.locator("#job-notice").inner_text().startswith("Requeued")
    assert phone.locator("#job-notice").is_visible()


def test_a_pause_on_its_way_disables_its_button_and_its_answer_outlasts_the_refreshes(
    phone: Any, live_server: LiveServer, shop: Shop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The button stayed pressable with nothing on screen for as long as the POST took (5 s against a
    database that had gone), and the queues view's next refresh wiped the answer, a 503's "try again" too."""
    held: list[Any] = []
    phone.route(re.compile(r".*/queues/mail/pause$"), lambda route: held.append(route))
    _queues_page_of_mail(phone, live_server, shop, monkeypatch)
    _press_while_held(phone, phone.get_by_role("button", name="Pause mail"), held)
    held[0].continue_()
    notice = phone.get_by_text("Paused mail: workers claim nothing")
    notice.wait_for(timeout=5_000)
    phone.wait_for_timeout(2_500)  # two of the view's refreshes
    assert notice.is_visible()
    assert phone.get_by_role("button", name="Resume mail").is_visible()
    assert shop.relay.paused_queues() == ["mail"]


def test_a_pause_the_database_could_not_take_says_so_through_the_views_refreshes(
    phone: Any, live_server: LiveServer, shop: Shop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 503's "reload the page in a moment and try again" was wiped by the queues view's next refresh:
    its fragment had no element of the kept answer's id."""
    _queues_page_of_mail(phone, live_server, shop, monkeypatch)

    def database_gone(queue: str, paused: bool) -> Any:
        raise psycopg.OperationalError("connection failed: the database went away")

    monkeypatch.setattr(views_system, "_set_paused", database_gone)
    phone.get_by_role("button", name="Pause mail").click()
    answer = phone.get_by_text("reload the page in a moment and try again")
    answer.wait_for(timeout=10_000)
    phone.wait_for_timeout(2_500)  # two of the view's refreshes
    assert answer.is_visible()
    assert phone.get_by_role("button", name="Pause mail").is_visible()  # the view itself is back
    assert shop.relay.paused_queues() == []


def test_a_pause_that_got_no_answer_leaves_no_focus_to_move_in_a_later_refresh(
    phone: Any, live_server: LiveServer, shop: Shop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pressed button's id outlived an action that got no answer, and the view's first refresh once the
    network was back moved the focus (and the page) to that button."""
    _queues_page_of_mail(phone, live_server, shop, monkeypatch)
    phone.context.set_offline(True)
    try:
        phone.get_by_role("button", name="Pause mail").focus()
        phone.keyboard.press("Enter")
        phone.get_by_role("alert").wait_for(timeout=5_000)
    finally:
        phone.context.set_offline(False)
    phone.wait_for_timeout(2_500)  # the view refreshes: the note goes, and the focus with it
    assert phone.get_by_role("alert").count() == 0
    assert phone.evaluate("document.activeElement.id") != "queue:mail:toggle"


def test_a_requeue_all_on_its_way_disables_its_button(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    make_user(shop.relay.dsn, "ops", "admin")
    _dead(shop, shop.relay.enqueue("send_email", {"to": "l@example.com"}))
    _log_in(phone, live_server)
    held: list[Any] = []
    phone.route(re.compile(r".*/dead/requeue$"), lambda route: held.append(route))
    phone.goto(live_server.at("/dead"))
    _press_while_held(phone, phone.get_by_role("button", name=re.compile("^Requeue all")), held)
    held[0].continue_()
    phone.locator(".dead-view .flash").wait_for(timeout=5_000)


def _claimed_elsewhere(shop: Shop, job_id: int) -> None:
    """Mark the job claimed, for an hour, by a worker the test does not run: nothing here finishes it."""
    with psycopg.connect(shop.relay.dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE relay.jobs SET status = 'claimed', attempts = 1, claimed_by = 'elsewhere',"
            " claimed_until = now() + interval '1 hour', started_at = now() WHERE id = %s",
            (job_id,),
        )


def test_a_stop_request_is_said_once_through_the_cards_refreshes(
    phone: Any, live_server: LiveServer, shop: Shop
) -> None:
    """From the card's first refresh on, the kept answer ("Stop requested: the worker stops the job ...") and
    the card's own line ("Stop requested 31s ago; ...") stood one above the other."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "m@example.com"}, run_at=datetime.now(UTC) + timedelta(days=1))
    _claimed_elsewhere(shop, job_id)  # running on a worker of its own
    _log_in(phone, live_server)
    phone.goto(live_server.at(f"/jobs/{job_id}"))
    phone.get_by_role("button", name="Request stop").click()
    said = phone.locator(".status-card .flash", has_text="Stop requested")
    said.first.wait_for(timeout=5_000)
    phone.wait_for_timeout(4_500)  # two of the card's refreshes
    visible = [said.nth(i).inner_text() for i in range(said.count()) if said.nth(i).is_visible()]
    assert visible == ["Stop requested: the worker stops the job at its next heartbeat."]


def test_a_stop_requested_elsewhere_is_said_under_another_kept_answer(
    phone: Any, live_server: LiveServer, shop: Shop
) -> None:
    """The card hid its "Stop requested ... ago" line behind whatever answer it kept: after a Requeue, a stop
    another admin then asked for was not on the card at all."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "o@example.com"}, queue="parked")  # no worker serves it
    with psycopg.connect(shop.relay.dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE relay.jobs SET status = 'dead', attempts = 1, finished_at = now(), last_error = 'boom'"
            " WHERE id = %s",
            (job_id,),
        )
    _log_in(phone, live_server)
    phone.goto(live_server.at(f"/jobs/{job_id}"))
    phone.get_by_role("button", name="Requeue").click()
    phone.locator("#job-notice", has_text="Requeued").wait_for(timeout=5_000)
    _claimed_elsewhere(shop, job_id)  # a worker of its own takes it
    shop.relay.cancel(job_id)  # another admin asks it to stop
    phone.locator(".stop-requested").wait_for(timeout=10_000)
    assert phone.locator(".stop-requested").is_visible()


def test_an_action_that_gets_no_answer_says_so(phone: Any, live_server: LiveServer, shop: Shop) -> None:
    """Pressed with no network, Requeue did nothing and said nothing; the page still looked current."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "i@example.com"})
    _dead(shop, job_id)
    waiting = shop.relay.enqueue("send_email", {"to": "j@example.com"}, run_at=datetime.now(UTC) + timedelta(days=1))
    _log_in(phone, live_server)
    phone.goto(live_server.at(f"/jobs/{job_id}"))
    phone.context.set_offline(True)
    try:
        phone.get_by_role("button", name="Requeue").click()
        note = phone.get_by_role("alert")
        note.wait_for(timeout=5_000)
        assert note.inner_text().startswith("No answer from Relay (is the network down?). It may or may not have")
        assert phone.get_by_role("button", name="Requeue").is_enabled()
    finally:
        phone.context.set_offline(False)
    assert shop.relay.get_job(job_id).status == "dead"

    # A page whose refreshes get no answer says it may be out of date, and stops saying so once one is answered.
    phone.goto(live_server.at(f"/jobs/{waiting}"))  # its card refreshes every 2 s
    banner = phone.locator("#no-answer")
    assert banner.is_hidden()
    phone.context.set_offline(True)
    try:
        banner.wait_for(state="visible", timeout=6_000)
        assert re.fullmatch(
            r"No answer from Relay since .+: what this page shows may be out of date\. It keeps trying\.",
            banner.inner_text(),
        )
    finally:
        phone.context.set_offline(False)
    banner.wait_for(state="hidden", timeout=6_000)


def test_an_open_traceback_stays_open_when_the_history_refreshes(
    phone: Any, live_server: LiveServer, shop: Shop
) -> None:
    """Every new error reloads the history; the traceback being read snapped shut."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "k@example.com"})
    _dead(shop, job_id)
    _log_in(phone, live_server)
    phone.goto(live_server.at(f"/jobs/{job_id}"))
    phone.locator(".attempt summary", has_text="Traceback").first.click()
    assert phone.locator(".attempt details[open]").count() == 1
    phone.get_by_role("button", name="Requeue").click()  # the mail server is still down: it dies again
    phone.get_by_role("heading", name="Errors (2)").wait_for(timeout=20_000)
    opened = phone.locator(".attempt details[open]")
    assert opened.count() == 1
    # The one opened is the first attempt's, now second in the list; the new one is folded.
    assert phone.locator(".attempt").nth(1).locator("details[open]").count() == 1


def test_an_actions_answer_takes_the_focus_once_not_at_every_refresh(
    phone: Any, live_server: LiveServer, shop: Shop
) -> None:
    """The answer is kept through the card's refreshes, and with it its autofocus, which htmx honoured in
    each: every 2 s the page jumped back to it, and the errors and payload below could not be read."""
    make_user(shop.relay.dsn, "ops", "admin")
    job_id = shop.relay.enqueue("send_email", {"to": "h@example.com", "body": "y" * 3000})
    _dead(shop, job_id)
    shop.relay.pause_queue("default")  # requeued, it stays queued: the card goes on refreshing
    _log_in(phone, live_server)
    phone.goto(live_server.at(f"/jobs/{job_id}"))
    phone.get_by_role("button", name="Requeue").click()
    phone.locator(".status-card .flash", has_text="Requeued").wait_for()
    assert phone.evaluate("document.activeElement.id") == "job-notice"  # the answer's own swap
    phone.evaluate("window.scrollTo(0, document.scrollingElement.scrollHeight); document.activeElement.blur()")
    below = phone.evaluate("window.scrollY")
    assert below > 0
    for _ in range(2):
        assert phone.evaluate(FOCUS_AFTER_NEXT_SWAP) == "body"
        assert phone.evaluate("window.scrollY") == below
    assert phone.locator("#job-notice").inner_text().startswith("Requeued")  # still said, in its place
