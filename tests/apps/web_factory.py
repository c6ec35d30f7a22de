"""An application's own web factory that hands Relay's app its settings itself (tests/web/test_app.py)."""

from __future__ import annotations

import os

from flask import Flask

from relay_web import create_app


def create() -> Flask:
    return create_app({"JWT_SECRET_KEY": os.environ["APP_SIGNING_SECRET"]})
