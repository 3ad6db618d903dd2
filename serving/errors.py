"""Errors a request can end in, each with its HTTP status, rendered as TF-Serving's {"error": "..."} body."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)


class ServingError(Exception):
    """A request failed in a way the client can be told about; `status_code` is the HTTP status."""

    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ServingError):
    status_code = 400


class ModelNotFound(ServingError):
    status_code = 404


class PayloadTooLarge(ServingError):
    status_code = 413


class NoModelLoaded(ServingError):
    status_code = 503


def error_response(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status_code)


async def serving_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServingError)
    return error_response(exc.status_code, exc.message)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Routing errors (unknown path 404, wrong method 405) in the same JSON shape as every other error."""
    assert isinstance(exc, HTTPException)
    response = error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
    response.headers.update(exc.headers or {})
    return response


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A bug or an outage, not a bad request: logged with its traceback, answered with 500."""
    logger.error("unexpected error while handling %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(
        500, f"internal error while handling {request.method} {request.url.path}: {type(exc).__name__}: {exc}"
    )
