"""One voice key for every speaking stage: `voice`, with `speaker` as the same key; other keys
a stage does not read are refused."""

from __future__ import annotations

import pytest

from omnistage.errors import InputError
from omnistage.stages.voice import requested_voice, voice_of


@pytest.mark.parametrize("extra, voice", [({}, None), ({"voice": "Ethan"}, "Ethan"),
                                          ({"speaker": "ethan"}, "ethan"),
                                          ({"voice": "Ethan", "speaker": "ethan"}, "Ethan"),
                                          ({"voice": None, "speaker": "chelsie"}, "chelsie")])
def test_voice_or_speaker_is_one_key(extra: dict, voice: str | None) -> None:
    assert requested_voice(extra) == voice == voice_of(extra)


def test_two_different_voices_are_refused() -> None:
    with pytest.raises(InputError, match="name different voices") as e:
        requested_voice({"voice": "ethan", "speaker": "chelsie"})
    assert e.value.param == "voice"


def test_a_key_the_stage_does_not_read_is_refused() -> None:
    with pytest.raises(InputError, match=r"unknown keys \['speakr'\]") as e:
        requested_voice({"speakr": "ethan"})
    assert e.value.param == "speakr"
    assert requested_voice({"voice": "a", "language": "en"}, takes=("language",)) == "a"
    with pytest.raises(InputError, match=r"takes voice, speaker, language"):
        requested_voice({"voice": "a", "lang": "en"}, takes=("language",))
