"""A partner's webhook endpoint that fails now and then.

``python -m relay_shop.webhook_endpoint --port 8026 --failure-rate 0.35``
listens on 127.0.0.1 and answers ``POST /hooks/orders``: usually ``204``,
but a share of requests get ``503`` (a deploy in progress, an overloaded
backend) so ``deliver_webhook`` jobs visibly retry with growing gaps. It
remembers the ``Idempotency-Key`` of every event it accepted and answers a
repeat with ``200`` without processing it again: the receiving half of
at-least-once delivery.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from relay_core.signals import ShutdownSignals

PATH = "/hooks/orders"


class PartnerEndpoint(ThreadingHTTPServer):
    """The server, with the state its handlers share."""

    daemon_threads = True

    def __init__(self, port: int, failure_rate: float) -> None:
        super().__init__(("127.0.0.1", port), WebhookHandler)
        self.failure_rate = failure_rate
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.rng = random.Random()


class WebhookHandler(BaseHTTPRequestHandler):
    """One request to the partner."""

    server: PartnerEndpoint

    def _answer(self, status: int, body: dict[str, object] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        """Accept, refuse or (sometimes) fail an event."""
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path != PATH:
            self._answer(404, {"error": f"no webhook at {self.path}"})
            return
        key = self.headers.get("Idempotency-Key") or ""
        try:
            event = json.loads(raw)
        except ValueError:
            self._answer(400, {"error": "body is not JSON"})
            return
        with self.server.lock:
            if key and key in self.server.seen:
                self._answer(200, {"duplicate": True})
                print(f"event {key}: repeat, ignored", flush=True)
                return
            failing = self.server.rng.random() < self.server.failure_rate
            if not failing and key:
                self.server.seen.add(key)
        if failing:
            self._answer(503, {"error": "partner backend busy, try again later"})
            print(f"event {key}: answered 503", flush=True)
            return
        self._answer(204)
        print(f"event {key}: accepted {event.get('type', '?')} for order {event.get('order_id', '?')}", flush=True)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: do_POST prints one line per event instead of an access log."""


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(description="A flaky webhook endpoint for the Relay shop.")
    parser.add_argument("--port", type=int, default=8026)
    parser.add_argument("--failure-rate", type=float, default=0.35, help="share of requests answered 503")
    args = parser.parse_args(argv)
    server = PartnerEndpoint(args.port, args.failure_rate)
    signals = ShutdownSignals(lambda _signum: server.shutdown())  # called on the watcher's thread
    print(f"webhook endpoint listening on http://127.0.0.1:{args.port}{PATH}", flush=True)
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    signals.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
