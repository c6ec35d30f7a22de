"""Where the shop's mail and webhooks go, and its database: all from the environment.

Twelve-factor, like Relay itself: ``relay demo`` points these at the local
SMTP sink and webhook endpoint it starts; a deployment points them at a real
mail relay and a partner's URL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from relay_core.settings import database_url


@dataclass(frozen=True)
class ShopSettings:
    """The shop's outside world."""

    smtp_host: str
    smtp_port: int
    webhook_url: str | None
    review_delay_seconds: float
    mail_from: str = "Relay Shop <orders@relay-shop.example>"

    @classmethod
    def from_env(cls) -> ShopSettings:
        """Read ``SHOP_*`` variables, with defaults that suit one machine."""
        return cls(
            smtp_host=os.environ.get("SHOP_SMTP_HOST", "127.0.0.1"),
            smtp_port=int(os.environ.get("SHOP_SMTP_PORT", "8025")),
            webhook_url=os.environ.get("SHOP_WEBHOOK_URL") or None,
            review_delay_seconds=float(os.environ.get("SHOP_REVIEW_DELAY_SECONDS", "60")),
        )


def dsn() -> str:
    """The shop shares Relay's database: RELAY_DATABASE_URL, else DATABASE_URL."""
    return database_url()
