"""OpenAI fields parsed from text: sizes take ASCII digits only (Python's int() and a
regex's `\\d` also take fullwidth, Arabic-Indic and other Unicode digits)."""

from __future__ import annotations

import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.params import parse_size


@pytest.mark.parametrize("size", [
    "\uff19\uff16x\uff19\uff16",     # fullwidth ９６x９６
    "\u0669\u0666x\u0669\u0666",     # Arabic-Indic ٩٦x٩٦
    "96x\u09ef\u09ec",               # Bengali digits for the height
    "\U0001d7d7\U0001d7d4x96",       # mathematical bold 𝟗𝟔
    "96\uff5896",                    # a fullwidth x
    "+96x96", "96x-96", "9_6x96", "96 x 96", "0x96", "96x16385",
])
def test_sizes_in_other_digits_or_forms_are_400(size: str) -> None:
    with pytest.raises(APIError) as err:
        parse_size(size)
    assert err.value.status == 400 and err.value.param == "size", err.value.body()


@pytest.mark.parametrize("size, expected", [
    ("96x80", (80, 96)), (" 96x80 ", (80, 96)), ("16384x1", (1, 16384)), ("auto", (None, None)),
    (None, (None, None)),
])
def test_ascii_sizes_parse(size: str | None, expected: tuple) -> None:
    assert parse_size(size) == expected
