"""The OpenAPI 3.1 document, generated from the routes' ``@endpoint`` declarations.

Parameters, bodies and responses are the JSON Schemas of the very pydantic
records the views validate with and answer in; nothing is written by hand,
so the document cannot drift from the code.
"""

from __future__ import annotations

import re
from typing import Any

from flask import Flask
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .endpoint import Endpoint
from .problems import MEDIA_TYPE as PROBLEM_MEDIA_TYPE
from .records.common import ProblemRecord

REF = "#/components/schemas/{model}"

REASONS = {
    200: "OK",
    201: "Created",
    400: "The body is not valid JSON.",
    401: "No token, or an expired, malformed or foreign one.",
    403: "The token's role may not do this.",
    404: "No such resource.",
    409: "A conflict: the job's state does not allow this (the problem names the current state), "
    "or an Idempotency-Key already used for another job.",
    413: "The body is too large.",
    415: "The body is not application/json.",
    422: "A parameter or body field is invalid; errors[] lists each one.",
    429: "Too many attempts; wait Retry-After seconds.",
    500: "An unexpected error; details are in the server log.",
    503: "The database is unreachable or the query took too long; retry later.",
}

SECURITY_SCHEMES = {
    "bearerAuth": {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "The access_token from POST /api/auth/login.",
    },
    "refreshToken": {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "The refresh_token from POST /api/auth/login.",
    },
    "metricsToken": {"type": "http", "scheme": "bearer", "description": "RELAY_METRICS_TOKEN, when set."},
}


def _openapi_path(rule: str) -> str:
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema without pydantic's ``| None`` branch: a query string has no null."""
    schema = dict(schema)
    options = schema.pop("anyOf", None)
    if options:
        kept = [o for o in options if o.get("type") != "null"]
        if len(kept) == 1:
            schema.update(kept[0])
        else:
            schema["anyOf"] = kept
    if schema.get("default", 0) is None:
        del schema["default"]
    return schema


class _Schemas:
    """Every record's JSON Schema, generated together so references resolve."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        pairs: set[tuple[type[BaseModel], str]] = {(ProblemRecord, "serialization")}
        for spec in endpoints:
            for model in (spec.path, spec.query, spec.headers, spec.body):
                if model:
                    pairs.add((model, "validation"))
            for model in spec.responses.values():
                if model:
                    pairs.add((model, "serialization"))
        ordered = sorted(pairs, key=lambda p: (p[0].__name__, p[1]))
        self.refs, defs = models_json_schema(ordered, ref_template=REF)  # type: ignore[arg-type]
        self.components: dict[str, Any] = defs.get("$defs", {})

    def ref(self, model: type[BaseModel], mode: str) -> dict[str, Any]:
        """A ``$ref`` to a record's schema."""
        return self.refs[(model, mode)]  # type: ignore[index]

    def parameters(self, model: type[BaseModel], where: str) -> list[dict[str, Any]]:
        """One OpenAPI parameter per field of a path, query or header record."""
        name = self.ref(model, "validation")["$ref"].rsplit("/", 1)[-1]
        schema = self.components[name]
        required = set(schema.get("required", []))
        params = []
        for field_name, field_schema in schema.get("properties", {}).items():
            field_schema = _not_null(field_schema)
            param: dict[str, Any] = {
                "name": field_name,
                "in": where,
                "required": where == "path" or field_name in required,
                "schema": field_schema,
            }
            if "description" in field_schema:
                param["description"] = field_schema["description"]
            params.append(param)
        return params


def _operation(spec: Endpoint, schemas: _Schemas, operation_id: str, method: str) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": spec.summary,
        "description": spec.description,
        "tags": [spec.tag],
    }
    params = []
    for model, where in ((spec.path, "path"), (spec.query, "query"), (spec.headers, "header")):
        if model:
            params.extend(schemas.parameters(model, where))
    if params:
        operation["parameters"] = params
    if spec.body:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schemas.ref(spec.body, "validation")}},
        }
    responses: dict[str, Any] = {}
    for status, model in sorted(spec.responses.items()):
        content = {spec.media_type: {"schema": schemas.ref(model, "serialization") if model else {"type": "string"}}}
        responses[str(status)] = {"description": REASONS.get(status, "OK"), "content": content}
    for status in spec.all_problems(method):
        responses[str(status)] = {
            "description": REASONS.get(status, "An error."),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": schemas.ref(ProblemRecord, "serialization")}},
        }
    for status, headers in spec.response_headers.items():
        responses[str(status)]["headers"] = {
            name: {"description": text, "schema": {"type": "string"}} for name, text in headers.items()
        }
    if "401" in responses:
        responses["401"]["headers"] = {
            "WWW-Authenticate": {"description": "The Bearer challenge.", "schema": {"type": "string"}}
        }
    operation["responses"] = responses
    security = spec.security or ("refreshToken" if spec.refresh else "bearerAuth" if spec.role else None)
    operation["security"] = [{security: []}] if security else []
    return operation


def document(app: Flask) -> dict[str, Any]:
    """The OpenAPI document of every declared route of ``app``."""
    routes = []
    for rule in app.url_map.iter_rules():
        spec = getattr(app.view_functions.get(rule.endpoint), "relay_endpoint", None)
        if spec is not None:
            routes.append((rule, spec))
    schemas = _Schemas([spec for _, spec in routes])
    paths: dict[str, dict[str, Any]] = {}
    for rule, spec in sorted(routes, key=lambda r: r[0].rule):
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            paths.setdefault(_openapi_path(rule.rule), {})[method.lower()] = _operation(
                spec, schemas, rule.endpoint.replace(".", "_"), method
            )
    if not app.config.get("RELAY_METRICS_TOKEN"):
        for operations in paths.values():
            for operation in operations.values():
                if operation["security"] == [{"metricsToken": []}]:
                    operation["security"] = []
                    operation["responses"].pop("401", None)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Relay admin API",
            "version": "1",
            "description": "Jobs, queues, workers and stats of a Relay queue. Errors are RFC 9457 problem details.",
        },
        "paths": paths,
        "components": {"schemas": schemas.components, "securitySchemes": SECURITY_SCHEMES},
    }
