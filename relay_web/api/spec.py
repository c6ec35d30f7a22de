"""``/api/openapi.json``: the API's own description, built from its routes."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, json

from ..endpoint import unknown_query_parameters
from ..openapi import document
from ..problems import validation_problem

bp = Blueprint("spec", __name__)


@bp.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3.1 document of this app (public: it holds no data, only shapes).

    It takes no query parameters and refuses any, as every API endpoint does.
    """
    unknown = unknown_query_parameters()
    if unknown:
        raise validation_problem(unknown)
    cache = current_app.extensions.setdefault("relay.openapi", {})
    if "body" not in cache:
        cache["body"] = json.dumps(document(current_app))
    return Response(cache["body"], mimetype="application/json")
