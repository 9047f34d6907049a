"""The app's one JSON policy: what a request body (or a WebSocket message) may hold.

Python's `json` module takes more than JSON: `NaN`, `Infinity` and `-Infinity`, numbers that
overflow to infinity (`1e999`), integers of any size, and strings with lone surrogates
(`"\\ud800"`, which no UTF-8 encoder takes later on). Each of those reached the engine and
ended as a 500 (or, with the talker and code2wav, as a request left behind there). Here they
are a 400 naming where in the body they sit, before any route sees the body:

    body bytes -> json.loads (no NaN / Infinity) -> walk: every int fits 64 bits signed,
                  every float is finite, no string or key holds a lone surrogate

`StrictJSONRoute` applies it to every route of the app whose body is JSON (FastAPI then
validates what this parsed); `parse_json` is the same for the bodies a route reads itself.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

from omnistage.entrypoints.openai.errors import APIError, bad_request

INT_MIN, INT_MAX = -2**63, 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
# how a surrogate gets into parsed JSON: a \uD800-\uDFFF escape, or its UTF-8 form, which
# json.loads decodes with "surrogatepass"
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _no_constant(name: str) -> Any:
    raise bad_request(f"the request body is not valid JSON: {name} is not a JSON number",
                      code="invalid_json")


def parse_json(data: bytes | str) -> Any:
    """Parse a request body under the policy above; APIError (400) otherwise."""
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    may_hold = (b"\\u" in raw or b"\xed" in raw) and _SURROGATE_BYTES.search(raw) is not None
    check_values(value, strings=may_hold)           # (`in`: a fast pass for most bodies)
    return value


def check_values(value: Any, strings: bool = True) -> None:
    """Walk parsed JSON (without recursion: nesting depth is the client's) and refuse the
    first value outside the policy, naming its place (`messages[0].content`). A place is
    spelled out only for a container or a refusal (a prompt may be 100k token ids), and
    strings are searched for surrogates only if `strings` (the body escapes one)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list) and _all_int64(node):     # token ids: at C speed
            continue
        items = (node.items() if isinstance(node, dict) else enumerate(node)
                 if isinstance(node, list) else [(None, node)])
        for key, item in items:
            if strings and isinstance(key, str) and _SURROGATE.search(key):
                raise _refused(_join(path, key), "the key holds a lone UTF-16 surrogate (not "
                                                 "valid Unicode)")
            if isinstance(item, (dict, list)):
                stack.append((item, _join(path, key)))
            elif (why := _outside(item, strings)) is not None:
                raise _refused(_join(path, key), why)


def _all_int64(items: list[Any]) -> bool:
    """A non-empty list of ints (no bools) that all fit; False says: look item by item."""
    return (bool(items) and all(type(x) is int for x in items)
            and INT_MIN <= min(items) and max(items) <= INT_MAX)


def _join(path: str, key: str | int | None) -> str:
    if key is None:
        return path
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _outside(value: Any, strings: bool) -> str | None:
    """Why a scalar is outside the policy, or None."""
    if isinstance(value, str):
        if strings and not value.isascii() and _SURROGATE.search(value):
            return "the string holds a lone UTF-16 surrogate (not valid Unicode)"
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT_MIN <= value <= INT_MAX:
            return "integer out of range (at most 64 bits, signed)"
    elif isinstance(value, float) and not math.isfinite(value):
        return "number out of range (not a finite double)"
    return None


def _refused(path: str | None, why: str) -> APIError:
    return bad_request(f"{path}: {why}" if path else why, path or None)


def _is_json(content_type: str | None) -> bool:
    """What FastAPI parses as JSON: no content type, application/json, application/*+json."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `parse_json` before FastAPI validates it (FastAPI
    reads `request.json()`, which then returns what was parsed here): a refusal is this
    module's 400, raised where the app's error handlers see it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_first(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH") and _is_json(
                    request.headers.get("content-type")):
                body = await request.body()
                if body:
                    request._json = parse_json(body)    # Starlette's cache of request.json()
            return await handler(request)

        return parse_first
