"""Relay's admin surface: a Flask app with a JSON API (and, later, an HTMX dashboard).

``gunicorn 'relay_web:create_app()'`` serves it; settings come from the
environment (DATABASE_URL, JWT_SECRET_KEY or SECRET_KEY, RELAY_*).
"""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
