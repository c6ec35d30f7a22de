"""A database that stops answering, rather than refusing: the web app still answers, with 503.

A stalled server, a network path that drops packets or a pooler queueing
clients keeps the TCP connection open and sends nothing back. No server-side
timeout can fire then, so only the client can give up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from psycopg import conninfo

from ..helpers import TcpProxy
from .helpers import assert_problem


@pytest.fixture
def proxy(dsn: str) -> Iterator[TcpProxy]:
    params = conninfo.conninfo_to_dict(dsn)
    stalling = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    yield stalling
    stalling.close()


def _get(client, path: str, within: float) -> tuple[object, float]:
    """GET ``path`` on a thread; fail if no answer comes within ``within`` seconds."""
    answer: list[object] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: answer.append(client.get(path)), daemon=True)
    thread.start()
    thread.join(within)
    assert answer, f"GET {path} had no answer after {within} s"
    return answer[0], time.monotonic() - started


@pytest.mark.parametrize("path", ["/readyz", "/metrics"])
def test_a_stalled_database_is_a_503_within_the_timeouts_and_the_app_recovers(
    make_app, dsn: str, proxy: TcpProxy, path: str
) -> None:
    stalled_dsn = conninfo.make_conninfo(dsn, host="127.0.0.1", port=proxy.port)
    app = make_app(RELAY_DATABASE_URL=stalled_dsn, RELAY_DB_WAIT_SECONDS=1, RELAY_STATEMENT_TIMEOUT_MS=1000)
    client = app.test_client()
    response, _ = _get(client, path, within=10)
    assert response.status_code == 200
    proxy.flowing.clear()
    try:
        response, took = _get(client, path, within=15)
        assert_problem(response, 503, "unavailable")
        assert took < 5, f"answered after {took:.1f} s"
        assert client.get("/healthz").status_code == 200
    finally:
        proxy.flowing.set()
    # The connections that stalled are dropped; fresh ones serve the next request.
    response, _ = _get(client, path, within=10)
    assert response.status_code == 200
