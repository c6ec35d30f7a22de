"""The app factory: ``create_app(config=None)``.

``gunicorn 'relay_web:create_app()'`` serves it with settings from the
environment; tests and the demo pass a dict. The JSON API lives under
``/api``; health and metrics at the root; the server-rendered dashboard
(``relay_web.dashboard.bp``) at the root too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flask import Flask, Response, request
from werkzeug.middleware.proxy_fix import ProxyFix

from . import api, auth, config, dashboard, db, errors, health, metrics

log = logging.getLogger("relay.web")


def _trust_proxies(app: Flask) -> None:
    """Believe X-Forwarded-For/-Proto only as far as RELAY_PROXY_HOPS proxies we run.

    With one hop (Render, Railway, Heroku), the client address is the entry
    the platform's proxy appended, the last one; anything a client wrote in
    the header itself sits to its left and is ignored, so a forged header
    cannot dodge the login throttle.
    """
    hops = app.config["RELAY_PROXY_HOPS"]
    if hops:
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=0, x_port=0, x_prefix=0)  # type: ignore[method-assign]


#: A year of HTTPS only, once a browser has reached the app over HTTPS.
HSTS = "max-age=31536000"


def _no_sniffing_no_caching(response: Response) -> Response:
    """API answers carry tokens and job data: never cached, never content-sniffed.

    Over HTTPS (said by the proxies RELAY_PROXY_HOPS trusts, on a platform)
    the browser is also told to use nothing else: a later ``http://`` link
    would otherwise send the dashboard's login form in clear before any
    redirect. Over plain HTTP the header is meaningless and not sent.
    """
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    if request.is_secure:
        response.headers.setdefault("Strict-Transport-Security", HSTS)
    if request.path.startswith("/api/"):
        response.headers.setdefault("Cache-Control", "no-store")
    return response


def create_app(config_overrides: Mapping[str, Any] | None = None) -> Flask:
    """Build the Relay admin app; raises ConfigurationError when a required setting is missing."""
    app = Flask(__package__)
    app.config.update(config.load(config_overrides))
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.url_map.strict_slashes = True
    # No redirect from a path with an empty segment to the one without it: Werkzeug would
    # send POST /api/admin/jobs//cancel (a script whose job id came out empty) to the bulk
    # action POST /api/admin/jobs/cancel with a 308, which clients follow, method, body and
    # credentials included: one job's cancel would cancel every queued job. Such a path is a 404.
    app.url_map.merge_slashes = False
    errors.register(app)
    auth.init_app(app)
    database = db.init_app(app)
    app.register_blueprint(api.blueprint())
    app.register_blueprint(health.bp)
    app.register_blueprint(metrics.bp)
    app.register_blueprint(dashboard.bp)
    app.after_request(_no_sniffing_no_caching)
    _trust_proxies(app)
    app.wsgi_app = auth.AnyCaseBearer(app.wsgi_app)  # type: ignore[method-assign]
    app.extensions["relay.close"] = database.close
    return app
