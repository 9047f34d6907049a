"""One exception type for every client-visible failure, and OpenAI's error JSON for it.

    {"error": {"message": "temperature: must be >= 0", "type": "invalid_request_error",
               "param": "temperature", "code": null}}

Route code raises `APIError` (or lets a `ValueError` from the engine's input checks through,
which the routes turn into a 400). FastAPI's `RequestValidationError` becomes a 400 whose
`param` is the offending field written the way a client spells it (`messages[0].content`),
with pydantic's union-member tags taken out. Anything else that escapes a route is the
server's fault: a 500 with no internals in the message, logged here with its traceback.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.errors import InputError

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("omnistage.requests")   # log_lines.py's: one line a request

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error",
          504: "server_error"}
_HTTP_CODES = {413: "request_too_large"}
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


class APIError(Exception):
    """A failure the client sees: HTTP status, message, and OpenAI's type/param/code."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, dict[str, Any]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def check_model(model: str | None, served: str) -> None:
    """A request naming another model than the one served: 404, as OpenAI answers."""
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist (this server serves "
                            f"`{served}`)", param="model", code="model_not_found")


def from_value_error(exc: ValueError, param: str | None = None) -> APIError:
    """The engine's input checks raise ValueError naming the field: an InputError carries it
    (it wins over `param`, the caller's guess), else the message may start with it. A 400
    with that message."""
    message = str(exc) or type(exc).__name__
    named = exc.param if isinstance(exc, InputError) else None
    return APIError(400, message, param=named or param or _param_in(message))


def _param_in(message: str) -> str | None:
    """`SamplingParams.temperature=-1: ...` or `sampling_params_list[0].top_p: ...` -> param."""
    m = re.match(r"(?:SamplingParams\.|DiffusionParams\.)?([A-Za-z_][\w.\[\]]*)[=:]", message)
    return m.group(1) if m else None


def param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'list[tagged-union[...]]', 0, 'image_url',
    'image_url', 'url') -> 'messages[0].content[0].image_url.url'."""
    parts: list[str] = []
    last: int | str | None = None
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            last = item
            continue
        if not _FIELD.fullmatch(item) or item in _TYPE_TAGS:
            continue                      # a union member's tag, not a field
        if item == last:                  # a tagged union's tag followed by the same field
            continue
        parts.append(item)
        last = item
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    return invalid(list(exc.errors()))


def invalid(errors: list[Any]) -> APIError:
    """The 400 for pydantic's errors about a request body (a JSON body, or a form's fields)."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}",
                           code="invalid_json")
    # unions report one error per member; the deepest one says most about what went wrong
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    param = param_from_loc(tuple(err.get("loc", ())))
    message = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        message = "unknown field (not part of this API)"
    elif err.get("type") == "missing":
        message = "required field is missing"
    if param is None and err.get("type") in ("model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object", code="invalid_body")
    return bad_request(f"{param}: {message}" if param else message, param)


def refused(request: Request, err: APIError) -> JSONResponse:
    """The error's response, and for a client error one log line with its reason (uvicorn's
    access line says only `400`). The message is cut short and repr'd: it may quote input."""
    if 400 <= err.status < 500 and err.status != 404:
        message = err.message if len(err.message) <= 200 else err.message[:200] + "..."
        request_logger.info("refused %s %s: %d %s: %r", request.method, request.url.path,
                            err.status, err.code or "-", message)
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return refused(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        code = _HTTP_CODES.get(exc.status_code) or HTTPStatus(exc.status_code).phrase.lower()
        return APIError(exc.status_code, message, code=code.replace(" ", "_"),
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()
