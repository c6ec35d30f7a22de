"""A stream of realistic orders: ``python -m relay_shop.producer --per-minute 30``.

It stands in for the shop's web front end: every order goes through
:func:`relay_shop.orders.place_order`, one SQLAlchemy transaction each. One
customer in six typed a postcode the carrier rejects, so the demo always has
dead jobs to inspect and requeue; one order in eight is cancelled a moment
later, which cancels its scheduled review request. SIGTERM or Ctrl-C stops it between orders,
so no order is ever half placed. While the database does not answer, it waits and tries again
(an order whose transaction failed was not placed at all), as a shop's front end would. An
order whose COMMIT went unanswered may have been placed: it looks for that order before it
places another, so a database restart never places one twice.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from relay_core.signals import ShutdownSignals

from .models import create_schema, make_engine
from .orders import Customer, OrderOutcomeUnknown, PlacedOrder, Product, cancel_order, order_exists, place_order

#: One order in this many is cancelled by its customer a moment later.
CANCEL_EVERY = 8
#: Seconds to wait after the database did not answer, before the next try.
RETRY_SECONDS = 1.0

CATALOGUE = [
    Product("MUG-BLK", "Black enamel mug", 1400),
    Product("TEE-GRY-M", "Grey T-shirt, M", 2500),
    Product("NOTE-A5", "Dot-grid notebook A5", 900),
    Product("PEN-STL", "Steel pen", 3200),
    Product("BAG-CNV", "Canvas tote bag", 1800),
    Product("CAP-NVY", "Navy cap", 2200),
]

CUSTOMERS = [
    Customer("Ada Lovelace", "ada@example.com", "12 St James's Square", "SW1Y 4JH", "GB"),
    Customer("Linus Meyer", "linus@example.de", "Torstrasse 101", "10119", "DE"),
    Customer("Camille Martin", "camille@example.fr", "8 rue de Rivoli", "75004", "FR"),
    Customer("Daan de Vries", "daan@example.nl", "Prinsengracht 263", "1016 GV", "NL"),
    Customer("Giulia Rossi", "giulia@example.it", "Via del Corso 12", "00186", "IT"),
    # A typo the carrier will refuse: German postcodes have five digits.
    Customer("Grace Hopper", "grace@example.de", "Kastanienallee 7", "1043", "DE"),
]


def random_items(rng: random.Random) -> list[tuple[Product, int]]:
    """One to three different products, one or two of each."""
    return [(product, rng.choice((1, 1, 2))) for product in rng.sample(CATALOGUE, rng.randint(1, 3))]


def run(per_minute: float, limit: int | None = None) -> int:
    """Place orders until stopped (or ``limit`` orders); return how many were placed."""
    stop = threading.Event()
    signals = ShutdownSignals(lambda _signum: stop.set())
    engine = make_engine()
    create_schema(engine)
    rng = random.Random()
    interval = 60.0 / per_minute
    placed = 0
    regretted: PlacedOrder | None = None
    #: An order whose COMMIT went unanswered: it may exist, so look before placing it again.
    unsure: int | None = None
    try:
        while not stop.is_set() and (limit is None or placed < limit):
            customer = CUSTOMERS[placed % len(CUSTOMERS)]
            new: PlacedOrder | None = None
            try:
                if regretted is not None:  # the previous order's customer changed their mind
                    with Session(engine) as session:
                        cancelled = cancel_order(session, regretted)
                    print(f"order {regretted.order_id} cancelled; review request cancelled: {cancelled}", flush=True)
                    regretted = None
                if unsure is not None:
                    with Session(engine) as session:
                        committed = order_exists(session, unsure)
                    outcome = "did" if committed else "did not"
                    print(f"order {unsure} {outcome} commit before the database went away", flush=True)
                    unsure = None
                    if not committed:
                        continue  # place it again
                else:
                    with Session(engine) as session:
                        try:
                            new = place_order(session, customer, random_items(rng))
                        except OrderOutcomeUnknown as exc:
                            # Placing the order again now could place it twice: look for it first
                            # (noted here, so that an error closing the session cannot lose it).
                            unsure = exc.order_id
                            print(f"{exc}; looking for it in {RETRY_SECONDS:g} s", flush=True)
                    if unsure is not None:
                        stop.wait(RETRY_SECONDS)
                        continue
            except OperationalError as exc:
                reason = str(exc.orig).splitlines()[0] if exc.orig else str(exc)
                print(f"database unreachable ({reason}); trying again in {RETRY_SECONDS:g} s", flush=True)
                stop.wait(RETRY_SECONDS)
                if new is None:  # the transaction rolled back: nothing was placed or cancelled
                    continue
                # The order committed; only closing its session met the outage.
            if new is not None:
                print(
                    f"order {new.order_id} placed for {customer.email}: {new.lines} item(s), "
                    f"{new.total_cents / 100:.2f} {new.currency}",
                    flush=True,
                )
                if placed % CANCEL_EVERY == CANCEL_EVERY - 1:
                    regretted = new
            placed += 1
            # Poisson-like arrivals look like real traffic; the mean stays at `interval`.
            stop.wait(rng.expovariate(1.0 / interval))
    finally:
        engine.dispose()
        signals.close()
    return placed


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Place demo orders in the Relay shop.")
    parser.add_argument("--per-minute", type=float, default=30.0, help="mean orders per minute (default 30)")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many orders")
    args = parser.parse_args(argv)
    if args.per_minute <= 0:
        parser.error("--per-minute must be positive")
    placed = run(args.per_minute, args.limit)
    print(f"producer stopped after {placed} order(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
