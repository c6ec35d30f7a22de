"""Placing an order: the row and its follow-up jobs commit in ONE transaction.

This is the reason to keep a job queue in the application's own database.
With a separate broker, "save the order, then publish the email job" has two
failure windows: the order commits and the publish fails (a customer never
hears from you), or the publish succeeds and the order rolls back (an email
about an order that does not exist). Here ``relay.enqueue(..., conn=session)``
inserts the job through the SQLAlchemy session's own connection, so the order
and its jobs are committed together by ``session.commit()`` or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from relay_core import IllegalTransition

from .jobs import relay
from .models import Order, OrderLine
from .settings import ShopSettings


@dataclass(frozen=True)
class Product:
    """Something the shop sells."""

    sku: str
    name: str
    price_cents: int


@dataclass(frozen=True)
class Customer:
    """Who orders, and where it ships."""

    name: str
    email: str
    street: str
    postcode: str
    country: str


class OrderOutcomeUnknown(Exception):
    """The connection broke while the order's COMMIT was in flight.

    The server may have committed the order (and its jobs) before the answer
    was lost, or not: only a look at ``shop.orders`` for :attr:`order_id`,
    once the database answers again, tells which. Placing the order again
    without that look would place it twice.
    """

    def __init__(self, order_id: int) -> None:
        super().__init__(f"the database went away while order {order_id} was committing")
        self.order_id = order_id


@dataclass(frozen=True)
class PlacedOrder:
    """An order that committed, and the ids of the jobs that committed with it.

    Plain values read before the commit: the ORM object expires at commit,
    and reading it again afterwards is a query that can fail on its own.
    """

    order_id: int
    lines: int
    total_cents: int
    currency: str
    jobs: dict[str, int]


def place_order(
    session: Session,
    customer: Customer,
    items: list[tuple[Product, int]],
    *,
    settings: ShopSettings | None = None,
) -> PlacedOrder:
    """Save an order and enqueue everything it sets off; commit once.

    If anything raises before ``commit`` (a bad item, a refused job, the
    database going away), the session rolls back: no order and no jobs.
    If the database goes away during the commit itself, the order may have
    committed: :class:`OrderOutcomeUnknown` says so, with the order's id.
    """
    if not items:
        raise ValueError("an order needs at least one item")
    settings = settings or ShopSettings.from_env()
    order = Order(
        customer_name=customer.name,
        customer_email=customer.email,
        street=customer.street,
        postcode=customer.postcode,
        country=customer.country,
        total_cents=sum(product.price_cents * quantity for product, quantity in items),
        lines=[OrderLine(sku=p.sku, name=p.name, quantity=n, unit_price_cents=p.price_cents) for p, n in items],
    )
    session.add(order)
    session.flush()  # assigns order.id inside the still-open transaction

    key = f"order-{order.id}"
    ids = {"order_id": order.id}
    jobs: dict[str, int] = {}
    jobs["send_confirmation_email"] = relay.enqueue(
        "send_confirmation_email", ids, conn=session, idempotency_key=f"{key}:confirmation"
    )
    jobs["print_shipping_label"] = relay.enqueue(
        "print_shipping_label", ids, conn=session, idempotency_key=f"{key}:label"
    )
    jobs["request_review"] = relay.enqueue(
        "request_review",
        ids,
        conn=session,
        run_at=datetime.now(UTC) + timedelta(seconds=settings.review_delay_seconds),
        idempotency_key=f"{key}:review",
    )
    if settings.webhook_url:
        event = {
            "type": "order.placed",
            "order_id": order.id,
            "total_cents": order.total_cents,
            "currency": order.currency,
            "items": [{"sku": p.sku, "quantity": q} for p, q in items],
        }
        jobs["deliver_webhook"] = relay.enqueue(
            "deliver_webhook",
            {"event": event, "idempotency_key": f"{key}:order.placed"},
            conn=session,
            idempotency_key=f"{key}:webhook",
        )
    placed = PlacedOrder(order.id, len(order.lines), order.total_cents, order.currency, jobs)
    try:
        session.commit()
    except OperationalError as exc:
        raise OrderOutcomeUnknown(order.id) from exc
    return placed


def order_exists(session: Session, order_id: int) -> bool:
    """Whether an order committed: the check after :class:`OrderOutcomeUnknown`."""
    return session.get(Order, order_id) is not None


def cancel_order(session: Session, placed: PlacedOrder) -> bool:
    """The customer changed their mind: mark the order cancelled and cancel its review request.

    The order commits first; cancelling the job is a second step, because a
    job that already started cannot be un-run. ``request_review`` checks the
    order's status too, so a review request never goes out for a cancelled
    order whichever step wins the race. Returns whether the job was cancelled.
    """
    order = session.get(Order, placed.order_id, with_for_update=True)
    if order is None:
        return False
    order.status = "cancelled"
    session.commit()
    try:
        relay.cancel(placed.jobs["request_review"])
    except IllegalTransition:  # it ran already (or was cancelled by someone else)
        return False
    return True
