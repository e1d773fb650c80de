"""The OpenAPI document states the error statuses the server really sends.

FastAPI documents 422 for validation errors; this server answers them with 400 and an OpenAI
error body. `document_errors` replaces FastAPI's entry and adds every status a route can send:
400 / 404 / 413 / 408 / 429 / 500 / 503 on generation, 503 where the engine thread is asked,
401 everywhere but /health when an API key is set.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
REASONS = {
    400: "Invalid request (the message and `param` name the problem)",
    401: "Missing or invalid API key",
    404: "Unknown model",
    408: "Request body not received in time",
    413: "Request body too large",
    429: "Queue full: retry later (Retry-After)",
    500: "Generation failed (the body carries a request id; details are in the server log)",
    503: "Engine not running or not answering",
}
GENERATION = (400, 404, 408, 413, 429, 500, 503)
ENGINE_CALLS = (503,)
OPEN_PATHS = ("/health",)


def document_errors(app: FastAPI, with_auth: bool) -> None:
    """Make `app.openapi()` list the statuses each route sends (and never 422)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    _document(operation, _statuses(path, operation, with_auth))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _statuses(path: str, operation: dict, with_auth: bool) -> tuple[int, ...]:
    statuses = GENERATION if "requestBody" in operation else ()
    if path in ("/slots", "/metrics"):
        statuses = ENGINE_CALLS
    if with_auth and path not in OPEN_PATHS:
        statuses = (401, *statuses)
    return statuses


def _document(operation: dict, statuses: tuple[int, ...]) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    for status in statuses:
        responses[str(status)] = {"description": REASONS[status], "content": {
            "application/json": {"schema": ERROR_SCHEMA}}}
