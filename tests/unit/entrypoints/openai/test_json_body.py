"""The app's JSON policy (json_body.py): what Python's json module takes beyond JSON, or what
no later step can handle, is a 400 naming where it sits in the body."""

from __future__ import annotations

import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.json_body import parse_json


@pytest.mark.parametrize("body, param, code", [
    (b'{"temperature": NaN}', None, "invalid_json"),
    (b'{"temperature": Infinity}', None, "invalid_json"),
    (b'{"a": [1, -Infinity]}', None, "invalid_json"),
    (b'{"top_p": 1e999}', "top_p", None),
    (b'{"max_tokens": 18446744073709551616}', "max_tokens", None),
    (b'{"seed": -9223372036854775809}', "seed", None),
    (b'{"stop_token_ids": [1, 2, 18446744073709551616]}', "stop_token_ids[2]", None),
    (b'{"messages": [{"content": "\\ud800"}]}', "messages[0].content", None),
    (b'{"model": "a\\udfffb"}', "model", None),
    (b'{"extra": {"\\ud800": 1}}', "extra.\ud800", None),
    (b'{"raw": "\xed\xa0\x80"}', "raw", None),          # its UTF-8 form, not escaped
    ('{"text": "\ud800"}', "text", None),                # a WebSocket message, as text
    (b'{"a": 1', None, "invalid_json"),
    (b'[' * 100_000, None, "invalid_json"),
])
def test_outside_the_policy_is_a_400_naming_the_place(body: bytes, param: str | None,
                                                      code: str | None) -> None:
    with pytest.raises(APIError) as err:
        parse_json(body)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


def test_what_the_policy_takes() -> None:
    body = (b'{"a": [9223372036854775807, -9223372036854775808, 1.5e308, "\\ud83d\\ude00", '
            b'null, true], "b": {"c": "\\u0000"}}')
    assert parse_json(body) == {"a": [2**63 - 1, -2**63, 1.5e308, "\U0001F600", None, True],
                                "b": {"c": "\x00"}}
    nested = b"[" * 500 + b"]" * 500
    assert parse_json(nested) is not None              # deep but within the parser: walked
