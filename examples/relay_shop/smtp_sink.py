"""A local SMTP server that accepts every message and prints a line about it.

``python -m relay_shop.smtp_sink --port 8025`` gives the mail handlers a real
SMTP conversation (``aiosmtpd``) without sending anything to anyone: point
``SHOP_SMTP_HOST``/``SHOP_SMTP_PORT`` at it. It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import sys
import threading
from email.parser import BytesHeaderParser
from typing import Any

from aiosmtpd.controller import Controller

from relay_core.signals import ShutdownSignals


class PrintingHandler:
    """Accept each message and log who it was for and what it said in its subject."""

    def __init__(self) -> None:
        self.received = 0

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        """Called by aiosmtpd once per message; the reply is the SMTP status line."""
        self.received += 1
        headers = BytesHeaderParser().parsebytes(envelope.original_content or envelope.content)
        print(
            f"mail #{self.received} to {', '.join(envelope.rcpt_tos)}: {headers.get('Subject', '')!s}"
            f" {headers.get('Message-ID', '')!s}",
            flush=True,
        )
        return "250 Message accepted for delivery"


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(description="A local SMTP sink for the Relay shop.")
    parser.add_argument("--port", type=int, default=8025)
    args = parser.parse_args(argv)
    stop = threading.Event()
    signals = ShutdownSignals(lambda _signum: stop.set())
    controller = Controller(PrintingHandler(), hostname="127.0.0.1", port=args.port)
    controller.start()
    print(f"SMTP sink listening on 127.0.0.1:{args.port}", flush=True)
    try:
        stop.wait()
    finally:
        controller.stop()
        signals.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
