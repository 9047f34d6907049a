"""POST /v1/audio/voices answers in the shape of the form it was sent in: vLLM-Omni's form
(the clip as `audio_sample`, examples/online_serving/qwen3_tts/README.md's curl) gets
vLLM-Omni's answer, `{"success": true, "voice": {name, consent, created_at, mime_type,
file_size, ref_text and speaker_description when given}}`; ours (`audio`) our voice card.
Errors are OpenAI's error JSON either way. The toy TTS model (omnistage/testing/toy_tts.py)
speaks each character as a 10 ms tone of the voice's pitch; a clone's pitch comes from the
clip's loudness."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from omnistage.testing.toy_tts import expected_wave
from tests.system.entrypoints.openai.test_speech_vllm_fields import (LSB, TEXT, TOY, clone_pitch,
                                                                     error_of, speak, tone_wav)

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    from omnistage.testing.toy_tts import build_toy_tts

    toy: tuple[Path, Path] = build_toy_tts(tmp_path_factory.mktemp("toy_tts"))
    return start_server([str(toy[0]), "--stage-config", str(toy[1]), "--served-model-name",
                         TOY, "--voices-dir", str(tmp_path_factory.mktemp("voices"))])


def test_the_readme_s_upload_gets_vllm_omni_s_answer(server: Server) -> None:
    """The README's curl: audio_sample, consent id, name, ref_text, speaker_description; read
    as its response example reads, then the voice by name in a Base request."""
    clip = tone_wav(amp=0.45)
    r = server.post("/v1/audio/voices", data={
        "consent": "user_consent_id", "name": "custom_voice_1",
        "ref_text": "The exact transcript of the audio sample.",
        "speaker_description": "warm narrator"},
        files={"audio_sample": ("voice_sample.wav", clip, "audio/wav")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and set(body) == {"success", "voice"}
    voice = body["voice"]
    assert voice == {"name": "custom_voice_1", "consent": "user_consent_id",
                     "created_at": voice["created_at"], "mime_type": "audio/wav",
                     "file_size": len(clip),
                     "ref_text": "The exact transcript of the audio sample.",
                     "speaker_description": "warm narrator"}
    assert isinstance(voice["created_at"], int) and voice["created_at"] > 1_600_000_000
    listed = server.get("/v1/audio/voices").json()
    assert "custom_voice_1" in listed["voices"]
    np.testing.assert_allclose(speak(server, voice="custom_voice_1", task_type="Base"),
                               expected_wave(TEXT, clone_pitch(clip)), atol=LSB)


def test_optional_fields_are_left_out_when_not_sent(server: Server) -> None:
    """"Fields ref_text and speaker_description are omitted when not provided"."""
    clip = tone_wav(amp=0.2)
    r = server.post("/v1/audio/voices", data={"consent": "c-42", "name": "plain_voice"},
                    files={"audio_sample": ("sample.wav", clip, "audio/wav")})
    assert r.status_code == 200, r.text
    voice = r.json()["voice"]
    assert set(voice) == {"name", "consent", "created_at", "mime_type", "file_size"}
    assert voice["consent"] == "c-42" and voice["file_size"] == len(clip)


def test_our_form_keeps_our_voice_card(server: Server) -> None:
    r = server.post("/v1/audio/voices", data={"name": "narrator", "consent": "true",
                                              "transcript": "a tone"},
                    files={"audio": ("clip.wav", tone_wav(), "audio/wav")})
    assert r.status_code == 200, r.text
    card = r.json()
    assert "success" not in card
    assert (card["name"], card["type"], card["transcript"]) == ("narrator", "uploaded", "a tone")
    assert card["duration_s"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("data, param, code", [
    ({"consent": "", "name": "v_no_consent"}, "consent", "consent_required"),
    ({"consent": "id-1", "name": "alto"}, "name", "voice_is_preset"),
    ({"consent": "id-1", "name": "../escape"}, "name", None),
])
def test_refusals_in_vllm_omni_s_form_are_openai_errors(server: Server, data: dict,
                                                        param: str, code: str | None) -> None:
    r = server.post("/v1/audio/voices", data=data,
                    files={"audio_sample": ("sample.wav", tone_wav(), "audio/wav")})
    err = error_of(r, 400)
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert "success" not in r.json()
