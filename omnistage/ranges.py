"""The one range check every numeric field of a request's parameters goes through.

A params struct (SamplingParams, DiffusionParams) declares a `Range` for each numeric field,
and its `validate` calls `check_ranges`: a value of the wrong kind (a bool, a string, a float
for an integer), a non-finite float, or one outside its range is an InputError naming the
field. The OpenAI fields and the per-stage overrides (`sampling_params_list`) both end in the
struct, so a limit set here holds for both; and every integer is bounded, so nothing past 64
bits reaches a tensor, a message or a device (2**64 in `top_k` once failed a whole batch).

    _RANGES = {"top_p": Range(0.0, 1.0, lo_open=True), "top_k": Range(-1, MAX_INT32, True)}
    check_ranges("SamplingParams", self, _RANGES)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omnistage.errors import InputError

MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Range:
    """[lo, hi] (an end open where said); `integer`: the value must be an int. A tuple field
    is checked item by item. None (the field unset) always passes."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"must be {kind} in {left}{_show(self.lo)}, {_show(self.hi)}{right}"

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below


def _show(bound: float) -> str:
    """2**31 - 1 and 2**63 - 1 as a reader knows them."""
    names = {MAX_INT32: "2**31 - 1", MAX_SEED: "2**63 - 1"}
    return names.get(bound, f"{bound:g}" if isinstance(bound, float) else str(bound))


def check_ranges(owner: str, params: object, ranges: dict[str, Range]) -> None:
    """InputError naming the first field of `params` outside its range (see above)."""
    for name, rng in ranges.items():
        value = getattr(params, name)
        if value is None:
            continue
        items = value if isinstance(value, tuple) else (value,)
        if not all(rng.holds(v) for v in items):
            shown = value if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
            raise InputError(f"{owner}.{name}={shown!r}: {rng.describe()}", name)


def numeric_fields(cls: type) -> set[str]:
    """The fields of a params dataclass holding numbers (int, float, or tuples of them): what
    its range table must cover (each struct asserts it where it declares the table)."""
    assert is_dataclass(cls), cls
    return {f.name for f in fields(cls) if re.search(r"\b(int|float)\b", str(f.type))}
