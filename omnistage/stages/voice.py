"""The voice a request asks a speaking stage for, under one name whatever the family:
`SamplingParams.extra["voice"]` (OpenAI's word, Qwen3-TTS's), with `"speaker"` (Qwen-Omni's
older word) taken as the same key. A speaking stage names the other `extra` keys it reads; any
key it does not read is refused, so a misspelt option fails instead of being ignored."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from omnistage.errors import InputError

VOICE_KEYS = ("voice", "speaker")


def requested_voice(extra: Mapping[str, object], takes: Iterable[str] = ()) -> str | None:
    """The voice named in `extra` (None: none named); InputError for a key outside
    VOICE_KEYS + `takes`, or for `voice` and `speaker` naming different voices."""
    takes = tuple(takes)
    unknown = set(extra) - set(takes) - set(VOICE_KEYS)
    if unknown:
        raise InputError(f"extra: unknown keys {sorted(unknown)} (this model's speaking stage "
                         f"takes "
                         f"{', '.join((*VOICE_KEYS, *takes))})", param=min(unknown))
    return voice_of(extra)


def voice_of(extra: Mapping[str, object]) -> str | None:
    """The voice named in `extra` (None: none), checking only that `voice` and `speaker`, if
    both are given, agree (the front door's check: every stage's params carry it)."""
    given = [str(extra[k]) for k in VOICE_KEYS if extra.get(k) is not None]
    if len({g.lower() for g in given}) > 1:
        raise InputError(f"voice {given[0]!r} and speaker {given[1]!r} name different voices "
                         "(they are one key: give one)", param="voice")
    return given[0] if given else None
