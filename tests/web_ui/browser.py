"""Browser fixtures: Debian's Chromium driven by Playwright, the app served on 127.0.0.1.

``playwright install`` cannot download browsers on the CI machines, so the
tests launch /usr/bin/chromium (``apt-get install -y chromium``) and skip,
saying so, where it is missing. The app runs in a werkzeug server thread
that each test stops; pages open at a phone's viewport (390x844).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import make_server

from relay_web import create_app

from .support import base_config

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
#: Longest wait of any browser step (ms); the machine is small and shared.
STEP_TIMEOUT_MS = 15_000


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session."""
    if not CHROMIUM.exists():
        pytest.skip("browser tests need Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser tests need playwright (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class LiveServer:
    """The dashboard served over HTTP on 127.0.0.1."""

    url: str

    def at(self, path: str) -> str:
        """An absolute URL on this server."""
        return self.url + path


@pytest.fixture
def live_server(dsn: str) -> Iterator[LiveServer]:
    """The app on a free port, in a thread; stopped (and its pool closed) after the test."""
    app = create_app(base_config(dsn))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield LiveServer(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()
        app.extensions["relay.close"]()


@pytest.fixture
def phone(browser: Any) -> Iterator[Any]:
    """A fresh page at a phone's viewport, with touch; confirmation dialogs are accepted and recorded."""
    context = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True, device_scale_factor=1)
    context.set_default_timeout(STEP_TIMEOUT_MS)
    page = context.new_page()
    page.dialogs = []  # type: ignore[attr-defined]
    page.console_errors = []  # type: ignore[attr-defined]

    def on_dialog(dialog: Any) -> None:
        page.dialogs.append((dialog.type, dialog.message))  # type: ignore[attr-defined]
        dialog.accept()

    page.on("dialog", on_dialog)
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        context.close()


def screenshot(page: Any, name: str) -> Path:
    """Save the whole page as test-artifacts/screenshots/<name>.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
