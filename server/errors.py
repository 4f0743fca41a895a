"""One JSON error shape for every failure: {"error": {"message", "type", "code"}} (DESIGN.md §9)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import (
    AdapterError,
    AdapterNotFoundError,
    AdapterNotLoadedError,
    AdapterPathForbiddenError,
    ErrorKind,
    ModelNotFoundError,
    OverloadedError,
    RequestError,
)
from server.openai_protocol import format_validation_errors

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}

# Most specific first: the first matching class decides the status.
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (AdapterPathForbiddenError, 403),
    (AdapterNotFoundError, 404),
    (AdapterNotLoadedError, 404),
    (ModelNotFoundError, 404),
    (AdapterError, 400),
    (RequestError, 400),
    (OverloadedError, 503),
)


class ApiError(Exception):
    """An error the server decides itself (status + message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    return next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)


def output_error_status(kind: ErrorKind) -> int:
    """A request that ended in "error": 400 when its adapter's files are at fault, else 500."""
    return 400 if kind == "adapter" else 500


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "code": status}}


class _AsciiJSONResponse(JSONResponse):
    """Escapes non-ASCII: an error message may quote client input, and a character that cannot be
    encoded as UTF-8 (a lone surrogate from a "\\ud800" escape) must not turn the error into a crash."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(status, message), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI clients expect 400.
        return error_response(400, format_validation_errors(list(exc.errors())))

    async def http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keep the exception's headers: a 405 must say which methods are allowed (Allow, RFC 9110).
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    async def known(_: Request, exc: Exception) -> JSONResponse:
        return error_response(status_of(exc), str(exc))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(RequestValidationError, validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http)  # type: ignore[arg-type]
    for cls in (ApiError, *(c for c, _ in _STATUS)):
        app.add_exception_handler(cls, known)
    app.add_exception_handler(Exception, unexpected)
