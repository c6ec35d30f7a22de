"""Sending the shop's email over real SMTP (the standard library's ``smtplib``).

Nothing here knows about jobs: a handler decides whether to send (it checks
``shop.sent_emails`` first), this module only builds and delivers a message.
The Message-ID is derived from the order and the kind of mail, so even the
rare duplicate that at-least-once delivery allows (the worker dies after the
SMTP server accepted the message, before the job recorded success) carries the
same Message-ID, which mail clients use to fold duplicates together.
"""

from __future__ import annotations

import smtplib
from email.message import EmailMessage

from .settings import ShopSettings


def message_id(order_id: int, kind: str) -> str:
    """The same Message-ID for every attempt at one email."""
    return f"<order-{order_id}.{kind}@relay-shop.example>"


def build(settings: ShopSettings, to: str, subject: str, body: str, *, order_id: int, kind: str) -> EmailMessage:
    """A plain-text email from the shop."""
    msg = EmailMessage()
    msg["From"] = settings.mail_from
    msg["To"] = to
    msg["Subject"] = subject
    msg["Message-ID"] = message_id(order_id, kind)
    msg.set_content(body)
    return msg


def send(settings: ShopSettings, msg: EmailMessage) -> None:
    """Hand ``msg`` to the SMTP server; raises if it is not accepted (the job then retries)."""
    with smtplib.SMTP(settings.smtp_host, settings.smtp_port, timeout=10) as smtp:
        smtp.send_message(msg)
