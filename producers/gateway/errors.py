"""Every error the gateway answers, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Routes raise :class:`ApiError`; the handlers below also translate FastAPI's validation errors (which would be
422 in FastAPI's own shape), unknown routes and methods, and anything unexpected, so that no client ever sees
a body of another shape.
"""

from __future__ import annotations

import logging
from typing import Any

from cassandra import DriverException, RequestExecutionException
from cassandra.cluster import NoHostAvailable
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

#: Overload or outage of the stores the gateway reads before accepting a request (keys, suspensions, limits).
DEPENDENCY_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, NoHostAvailable, RequestExecutionException, DriverException,
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str, code: str | None = "invalid_api_key") -> ApiError:
    return ApiError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="service_unavailable")


def from_validation(exc: ValidationError | RequestValidationError) -> ApiError:
    """One problem pydantic found, with the JSON path of the offending field as ``param``. For a union (content
    may be a string or a list of parts) the deepest error is the one about the branch the client meant."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    path = _param_path(first.get("loc", ()))
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{path}'."
    elif path:
        message = f"Invalid value for '{path}': {message}"
    return bad_request(message, param=path or None, code="invalid_value" if first.get("type") != "missing" else
                       "missing_required_parameter")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """``("body", "messages", 0, "content", "str")`` → ``messages.0.content``: pydantic also names the union
    branch it tried ("str", "list[TextPart]"), which is no part of the client's JSON."""
    parts: list[str] = []
    for part in loc:
        text = str(part)
        if text in ("body", "query") and not parts:
            continue
        if isinstance(part, str) and ("[" in text or text in _UNION_TAGS):
            continue
        parts.append(text)
    return ".".join(parts)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return ApiError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).response()

    async def _dependency_down(request: Request, exc: Exception) -> JSONResponse:
        # Redis or Cassandra overloaded or unreachable: the request was not accepted (nothing produced), so the
        # client may retry; a 503 says so, a 500 would not.
        log.warning("dependency unavailable", extra={"path": request.url.path, "error": repr(exc)})
        return unavailable("A backing service is unavailable; retry shortly.").response()

    for dependency_error in DEPENDENCY_ERRORS:
        app.add_exception_handler(dependency_error, _dependency_down)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path})
        return ApiError(500, "The server had an error while processing your request.", type="server_error",
                        code="internal_error").response()
