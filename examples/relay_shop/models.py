"""The shop's tables, in their own ``shop`` schema next to Relay's ``relay`` schema.

Relay lives inside the application's database, so an order and the jobs it
causes can commit in one transaction. The shop keeps to its own schema, and
creates it itself (:func:`create_schema`): Relay's migrations never touch
application tables.
"""

from __future__ import annotations

from datetime import date, datetime
from functools import lru_cache

import psycopg
from sqlalchemy import (
    BigInteger,
    Date,
    Engine,
    ForeignKey,
    Identity,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from .settings import dsn

SCHEMA = "shop"


class Base(DeclarativeBase):
    """Every shop table lives in the ``shop`` schema."""

    metadata = MetaData(schema=SCHEMA)


class Order(Base):
    """An order as the customer placed it."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    customer_name: Mapped[str] = mapped_column(Text)
    customer_email: Mapped[str] = mapped_column(Text)
    street: Mapped[str] = mapped_column(Text)
    postcode: Mapped[str] = mapped_column(Text)
    country: Mapped[str] = mapped_column(String(2))
    total_cents: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3), default="EUR")
    #: ``placed`` or ``cancelled`` (the customer changed their mind).
    status: Mapped[str] = mapped_column(Text, default="placed", server_default="placed")
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    lines: Mapped[list[OrderLine]] = relationship(back_populates="order", cascade="all, delete-orphan")


class OrderLine(Base):
    """One product on an order, with the price it was sold at."""

    __tablename__ = "order_lines"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id", ondelete="CASCADE"), index=True)
    sku: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    quantity: Mapped[int] = mapped_column(Integer)
    unit_price_cents: Mapped[int] = mapped_column(BigInteger)
    order: Mapped[Order] = relationship(back_populates="lines")


class SentEmail(Base):
    """Every email the shop sent: what makes the mail handlers idempotent.

    One row per (order, kind); a re-run of a job finds its row and sends nothing.
    """

    __tablename__ = "sent_emails"
    __table_args__ = (UniqueConstraint("order_id", "kind"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(Text)
    recipient: Mapped[str] = mapped_column(Text)
    message_id: Mapped[str] = mapped_column(Text)
    sent_at: Mapped[datetime] = mapped_column(server_default=func.now())


class Shipment(Base):
    """A shipping label bought from the carrier; one per order."""

    __tablename__ = "shipments"

    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id", ondelete="CASCADE"), primary_key=True)
    carrier: Mapped[str] = mapped_column(Text)
    tracking_number: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class SettlementReport(Base):
    """What the shop sold in one month, for the accountants; recomputed, never duplicated."""

    __tablename__ = "settlement_reports"

    month: Mapped[date] = mapped_column(Date, primary_key=True)
    orders: Mapped[int] = mapped_column(Integer)
    gross_cents: Mapped[int] = mapped_column(BigInteger)
    computed_at: Mapped[datetime] = mapped_column(server_default=func.now())


def make_engine(url: str | None = None) -> Engine:
    """A SQLAlchemy engine on Relay's database.

    Connections come from psycopg itself, so any DSN Relay accepts works here
    too (URLs, ``key=value`` strings, Unix sockets of an embedded server).
    Each is checked as it leaves the pool (``pool_pre_ping``): one that a
    database restart closed is replaced instead of failing an order or a job.
    """
    target = url or dsn()
    return create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(target), pool_size=2, pool_pre_ping=True
    )


@lru_cache(maxsize=4)
def shared_engine(url: str | None = None) -> Engine:
    """One engine per process and database."""
    return make_engine(url)


def create_schema(engine: Engine) -> None:
    """Create the ``shop`` schema and its tables if they are missing.

    Safe to run from many processes at once: an advisory lock lets one create
    while the others wait, then find everything in place.
    """
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('relay_shop.create_schema'))"))
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        Base.metadata.create_all(conn, checkfirst=True)


_created: set[str] = set()


def ensure_schema(url: str | None = None) -> None:
    """:func:`create_schema` once per process (handlers call it before touching shop tables)."""
    target = url or dsn()
    if target not in _created:
        create_schema(shared_engine(target))
        _created.add(target)
