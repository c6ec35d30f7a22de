"""The shop's background jobs: ``relay worker --app relay_shop.jobs:relay`` runs them.

Each handler shows one thing a real application needs from a job queue:

- ``send_confirmation_email`` / ``request_review``: real SMTP, made idempotent
  by recording each sent mail in the same transaction that marks the job
  succeeded (a transactional handler, ``def h(job, conn)``). A re-run finds
  the record and sends nothing.
- ``deliver_webhook``: a flaky partner endpoint; failures retry with growing
  gaps (2 s, 4 s, 8 s, ...), at most four deliveries at once across workers.
- ``print_shipping_label``: fails for good, with an error a person can act on,
  when an order's address cannot be shipped to. The job goes dead; fix the
  address and requeue it from the dashboard, and it succeeds.
- ``settlement_report``: a periodic month-end job (cron), exactly once per tick
  however many workers run.

Relay delivers every job at least once, so every handler here is safe to run twice.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

import psycopg

from relay_core import Backoff, Job, PermanentFailure, Relay

from . import mail, models, webhooks
from .settings import ShopSettings

relay = Relay()

#: What the carrier accepts as a postcode, per destination country.
POSTCODES = {
    "DE": (re.compile(r"^\d{5}$"), "5 digits, e.g. 10115"),
    "FR": (re.compile(r"^\d{5}$"), "5 digits, e.g. 75001"),
    "IT": (re.compile(r"^\d{5}$"), "5 digits, e.g. 00184"),
    "NL": (re.compile(r"^\d{4} ?[A-Z]{2}$"), "4 digits and 2 letters, e.g. 1012 AB"),
    "GB": (re.compile(r"^[A-Z]{1,2}\d[A-Z\d]? ?\d[A-Z]{2}$"), "a UK postcode, e.g. SW1A 1AA"),
}


@dataclass(frozen=True)
class OrderRow:
    """What the handlers need to know about an order."""

    id: int
    name: str
    email: str
    postcode: str
    country: str
    total_cents: int
    status: str


def _order(conn: psycopg.Connection, order_id: int, *, lock: bool = True) -> OrderRow:
    """Read an order, by default locking its row until the job's transaction ends.

    The row lock makes two runs of the same job (a stale worker and its
    successor) take turns, so the second sees what the first recorded.
    """
    models.ensure_schema(relay.dsn)
    row = conn.execute(
        "SELECT id, customer_name, customer_email, postcode, country, total_cents, status"
        " FROM shop.orders WHERE id = %s" + (" FOR UPDATE" if lock else ""),
        (order_id,),
    ).fetchone()
    if row is None:
        raise PermanentFailure(f"order {order_id} does not exist (was it deleted?)")
    return OrderRow(*row)


def _send_once(conn: psycopg.Connection, order_id: int, kind: str, subject: str, body: str, to: str) -> dict[str, Any]:
    """Send one email unless ``shop.sent_emails`` says it went out already."""
    settings = ShopSettings.from_env()
    sent = conn.execute(
        "SELECT message_id FROM shop.sent_emails WHERE order_id = %s AND kind = %s", (order_id, kind)
    ).fetchone()
    if sent:
        return {"skipped": "already sent", "message_id": sent[0]}
    msg = mail.build(settings, to, subject, body, order_id=order_id, kind=kind)
    mail.send(settings, msg)
    conn.execute(
        "INSERT INTO shop.sent_emails (order_id, kind, recipient, message_id) VALUES (%s, %s, %s, %s)",
        (order_id, kind, to, msg["Message-ID"]),
    )
    return {"sent_to": to, "message_id": msg["Message-ID"]}


@relay.handler("send_confirmation_email", max_attempts=10, timeout=30, rate_limit=(20, 1.0))
def send_confirmation_email(job: Job, conn: psycopg.Connection) -> dict[str, Any]:
    """Email the customer that their order is confirmed (at most 20 mails a second)."""
    order = _order(conn, int(job.payload["order_id"]))
    body = (
        f"Hello {order.name},\n\nthank you for your order #{order.id} of {order.total_cents / 100:.2f} EUR.\n"
        "We will email you again when it ships.\n\nRelay Shop\n"
    )
    return _send_once(conn, order.id, "confirmation", f"Your order #{order.id} is confirmed", body, order.email)


@relay.handler("request_review", max_attempts=10, timeout=30)
def request_review(job: Job, conn: psycopg.Connection) -> dict[str, Any]:
    """Ask for a review once the order has had time to arrive (scheduled with ``run_at``)."""
    order = _order(conn, int(job.payload["order_id"]))
    if order.status == "cancelled":  # cancelling the order also cancels this job; this covers a race
        return {"skipped": "order cancelled"}
    body = (
        f"Hello {order.name},\n\nhow do you like what you ordered (#{order.id})? Tell us in one click.\n\nRelay Shop\n"
    )
    return _send_once(conn, order.id, "review_request", f"How was order #{order.id}?", body, order.email)


@relay.handler(
    "deliver_webhook", max_attempts=8, timeout=15, concurrency=4, backoff=Backoff(base=2.0, factor=2.0, cap=120.0)
)
def deliver_webhook(job: Job) -> dict[str, Any]:
    """POST an order event to the partner's endpoint; retried with growing gaps while it fails.

    The URL is read when the job runs, not stored in the job: a partner that
    moves its endpoint gets the events still waiting at its new address.
    """
    url = ShopSettings.from_env().webhook_url
    if not url:
        raise PermanentFailure("SHOP_WEBHOOK_URL is not set on this worker: nowhere to deliver; set it, then requeue")
    key = job.payload.get("idempotency_key") or f"relay-job-{job.id}"
    try:
        status = webhooks.post_event(url, job.payload["event"], idempotency_key=key)
    except webhooks.DeliveryRefused as exc:
        raise PermanentFailure(str(exc)) from None
    return {"status": status, "attempt": job.attempt}


@relay.handler("print_shipping_label", max_attempts=5, timeout=30)
def print_shipping_label(job: Job, conn: psycopg.Connection) -> dict[str, Any]:
    """Buy a shipping label from the carrier; an address it cannot ship to is a permanent failure."""
    order = _order(conn, int(job.payload["order_id"]), lock=False)  # no lock held across the carrier call
    existing = conn.execute("SELECT tracking_number FROM shop.shipments WHERE order_id = %s", (order.id,)).fetchone()
    if existing:
        return {"skipped": "label exists", "tracking_number": existing[0]}
    tracking = buy_label(order)
    # A concurrent run may have bought one too (at-least-once): the first recorded label wins.
    row = conn.execute(
        "INSERT INTO shop.shipments (order_id, carrier, tracking_number) VALUES (%s, 'RelayPost', %s)"
        " ON CONFLICT (order_id) DO UPDATE SET order_id = excluded.order_id RETURNING tracking_number",
        (order.id, tracking),
    ).fetchone()
    return {"carrier": "RelayPost", "tracking_number": row[0]}


def buy_label(order: OrderRow) -> str:
    """The carrier's API, simulated here: it checks the postcode and takes a second or two.

    The pause makes running jobs visible on the dashboard, as a real carrier's
    latency would.
    """
    rule = POSTCODES.get(order.country)
    if rule is None:
        raise PermanentFailure(f"carrier does not ship to country {order.country!r} (order {order.id})")
    pattern, expected = rule
    if not pattern.match(order.postcode.upper()):
        raise PermanentFailure(
            f"carrier rejected the shipping address of order {order.id}: postcode {order.postcode!r} is not valid "
            f"for {order.country} (expected {expected}). Correct it (UPDATE shop.orders SET postcode = '...' "
            f"WHERE id = {order.id}), then requeue this job."
        )
    time.sleep(random.uniform(0.5, 2.0))
    return "RS" + hashlib.sha256(f"order-{order.id}".encode()).hexdigest()[:10].upper()


def _report_month(payload: dict[str, Any]) -> date | None:
    """The month to report: ``month`` ("2026-10"), else the month before the cron tick, else None."""
    if payload.get("month"):
        year, month = str(payload["month"]).split("-")[:2]
        return date(int(year), int(month), 1)
    if payload.get("scheduled_for"):
        tick = datetime.fromisoformat(str(payload["scheduled_for"]))
        return (tick.date().replace(day=1) - timedelta(days=1)).replace(day=1)
    return None


@relay.handler("settlement_report", cron="0 0 1 * *", timezone="UTC", catch_up=True, timeout=300)
def settlement_report(job: Job, conn: psycopg.Connection) -> dict[str, Any]:
    """Total last month's orders at 00:00 UTC on the 1st; recomputing a month overwrites it."""
    models.ensure_schema(relay.dsn)
    month = _report_month(job.payload or {})
    if month is None:  # enqueued by hand without a month: last month, by the database's clock
        last_month = "SELECT (date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date"
        month = conn.execute(last_month).fetchone()[0]
    row = conn.execute(
        """
        INSERT INTO shop.settlement_reports (month, orders, gross_cents)
        SELECT %(month)s, count(*), coalesce(sum(total_cents), 0) FROM shop.orders
        WHERE created_at >= %(month)s::timestamp AT TIME ZONE 'UTC'
          AND created_at < (%(month)s + interval '1 month') AT TIME ZONE 'UTC'
        ON CONFLICT (month) DO UPDATE
        SET orders = excluded.orders, gross_cents = excluded.gross_cents, computed_at = now()
        RETURNING orders, gross_cents
        """,
        {"month": month},
    ).fetchone()
    return {"month": month.isoformat()[:7], "orders": row[0], "gross_eur": round(row[1] / 100, 2)}
