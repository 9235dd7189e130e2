"""What ``/openapi.json`` says beyond what FastAPI derives from the routes: the links from each create operation to
the operations that read, cancel or delete what it created (OpenAPI ``links``, which schemathesis's stateful phase
follows), and our error answers where FastAPI documents its own.

FastAPI documents a 422 (its validation error body) on every operation with parameters; the gateway never answers
one: ``errors.install`` turns every validation error into a 400 in OpenAI's shape. :func:`install` writes the
document accordingly. Routes declare their links with :func:`links`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

#: the response header every create answers with: the id of what it created (a completion, a response), streamed or
#: not; links read it there because a stream's body is not JSON
REQUEST_ID = "x-request-id"
REQUEST_ID_HEADER = {REQUEST_ID: {"description": "The id of the completion or response created (`chatcmpl-…`, "
                                                 "`resp_…`), as in its body.",
                                  "schema": {"type": "string"}}}
#: a runtime expression: the id a create answered with
CREATED_ID = f"$response.header.{REQUEST_ID}"
_ERROR_BODY = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


def links(**targets: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """A response's ``links``: name → (operationId, the target's parameters as values or runtime expressions)."""
    return {"links": {name: {"operationId": operation, "parameters": parameters}
                      for name, (operation, parameters) in targets.items()}}


def install(app: FastAPI) -> None:
    """``app.openapi()`` answers FastAPI's document with our error statuses in place of its 422s."""
    derive = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = derive()
            _errors_are_400(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _errors_are_400(document: dict[str, Any]) -> None:
    """Every 422 FastAPI declared becomes the 400 the gateway answers (when the route did not declare its own 400,
    and it can send one: a malformed query parameter or body; a path segment is any string), and FastAPI's
    validation-error schemas go. An operation with a body may also be refused a body too large (``BodySizeLimit``)."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if "requestBody" in operation:
                responses.setdefault("413", {"description": "The request body is larger than the gateway accepts.",
                                             "content": _ERROR_BODY})
            if responses.pop("422", None) is None or "400" in responses:
                continue
            parameters = [p for p in operation.get("parameters", []) if p.get("in") != "path"]
            if parameters or "requestBody" in operation:
                responses["400"] = {"description": "A malformed parameter.", "content": _ERROR_BODY}
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
