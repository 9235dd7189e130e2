"""Every error the gateway answers, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Routes raise :class:`ApiError`; the handlers below also translate FastAPI's validation errors (which would be
422 in FastAPI's own shape), unknown routes and methods, and anything unexpected, so that no client ever sees
a body of another shape.
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.errors import KafkaError
from cassandra import DriverException, RequestExecutionException
from cassandra.cluster import NoHostAvailable
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from producers.tenancy.admin import TenancyError

log = logging.getLogger(__name__)

#: Overload or outage of the stores the gateway reads before accepting a request (suspensions, limits) or writes
#: an admin change to (the registry topics). Redis full (``maxmemory`` with ``noeviction``: writes are refused, never
#: evicted) is answered as Redis down.
DEPENDENCY_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, RedisOutOfMemoryError, NoHostAvailable, RequestExecutionException,
    DriverException,
    KafkaError,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error, for ``/openapi.json`` (:meth:`ApiError.body` writes it)."""

    error: ErrorDetail


def error_responses(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for its error statuses: each one OpenAI's error body, with what it means."""
    return {status: {"model": ErrorResponse, "description": text} for status, text in described.items()}


#: What every operation behind an API key may answer before it runs (``deps.authenticate``): a router's ``responses=``
CALLER_ERRORS = error_responses({
    401: "No API key, or an unknown, revoked or expired one.",
    403: "The API key is suspended, or is an admin key (which works on the admin API only).",
    503: "A backing service is unavailable; nothing changed, retry shortly.",
})
#: What a list read or a stream resume may answer besides (``Admission.admit_read``)
READ_LIMITED = error_responses({
    429: "The reads per minute of the key or its organization were reached (`rate_limit_exceeded`); `Retry-After` "
         "says when to retry.",
})


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


def model_not_allowed(model: str) -> ApiError:
    return ApiError(403, f"This API key is not allowed to use the model `{model}`.", type="permission_error",
                    param="model", code="model_not_allowed")


def unrecognized(names: list[str]) -> ApiError:
    """OpenAI's answer to a field it does not know (its wording, with the field as ``param``)."""
    plural = "s" if len(names) > 1 else ""
    return bad_request(f"Unrecognized request argument{plural} supplied: {', '.join(names)}", param=names[0],
                       code="unknown_parameter")


def stream_not_found(request_id: str) -> ApiError:
    """Unknown, expired, or another org's: one answer for all three, so that an id reveals nothing."""
    return ApiError(404, f"No stream with id '{request_id}' can be resumed: it does not exist, it belongs to another "
                         "organization, or its resume window has passed.", code="not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="service_unavailable")


def from_validation(exc: ValidationError | RequestValidationError) -> ApiError:
    """One problem pydantic found, with the JSON path of the offending field as ``param``, as OpenAI writes it
    (``messages[1].content``). For a union (content may be a string or a list of parts) the deepest error is the one
    about the branch the client meant."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    # Argument names are checked before values, as OpenAI does: every unknown field is named at once, at any depth.
    unknown = [_param_path(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        return unrecognized(list(dict.fromkeys(unknown)))
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    path = _param_path(first.get("loc", ()))
    # Our own validators (PydanticCustomError) name the parameter and the OpenAI code in the error's context; one of
    # a message or a part names it relative to where it is (``tool_calls`` of ``messages[1]``).
    context = first.get("ctx") or {}
    if "code" in context:
        message = first.get("msg", "invalid value")
        param = context.get("param")
        if param and path and not str(param).startswith(path):
            message = message.replace(f"'{param}'", f"'{path}.{param}'", 1)
            param = f"{path}.{param}"
        return bad_request(message, param=param or path or None, code=str(context["code"]))
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{path}'."
    elif path:
        message = f"Invalid value for '{path}': {message}"
    return bad_request(message, param=path or None, code="invalid_value" if first.get("type") != "missing" else
                       "missing_required_parameter")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """``("body", "messages", 0, "content", "list[TextPart]", 1, "type")`` → ``messages[0].content[1].type``: pydantic
    also names the union branch it tried ("str", "list[TextPart]", "constrained-str"), which is no part of the
    client's JSON."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        text = str(part)
        if text in ("body", "query") and not path:
            continue
        if "[" in text or text in _UNION_TAGS or text.startswith("constrained-") or text[:1].isupper():
            continue  # a union branch: a type's name, never a field of ours (they are snake_case)
        path = f"{path}.{text}" if path else text
    return path


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(TenancyError)
    async def _tenancy(_request: Request, exc: TenancyError) -> JSONResponse:
        kind = "permission_error" if exc.status == 403 else "invalid_request_error"
        return ApiError(exc.status, exc.message, type=kind, param=exc.param, code=exc.code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        # Starlette's headers matter: a 405 must say which methods are allowed (``Allow``, RFC 9110) — those of
        # every route of the path (Starlette names only the first route's, and a path may have several).
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:
            allowed = sorted({m for route in request.app.routes if isinstance(route, Route)
                              and route.path_regex.match(request.url.path) for m in route.methods or ()})
            headers["Allow"] = ", ".join(allowed) or headers.get("Allow", "")
        return ApiError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code),
                        headers=headers or None).response()

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
