"""Edge adapters: registered functions that turn an upstream stage's output (or one chunk of it)
into the downstream stage's input. YAML names them by registry key (`adapter: thinker_to_talker`).
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

ADAPTERS: dict[str, Callable] = {}


def register_adapter(name: str) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        if name in ADAPTERS and ADAPTERS[name] is not fn:
            raise ValueError(f"adapter {name!r} is registered twice")
        ADAPTERS[name] = fn
        return fn
    return wrap


def get_adapter(name: str) -> Callable:
    try:
        return ADAPTERS[name]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS)) or "none"
        raise ValueError(f"adapter {name!r} is not registered (known: {known})") from None
