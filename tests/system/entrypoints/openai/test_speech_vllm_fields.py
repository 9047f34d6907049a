"""/v1/audio/speech and /v1/audio/voices as vLLM-Omni's clients use them: the requests of its
qwen3_tts examples (openai_speech_client.py: always a `voice`, `task_type`, `max_new_tokens`,
`ref_audio` as a data URL with `ref_text`, `x_vector_only_mode`; the Gradio demos' voice list
read from `voices`) and of its e2e test (tests/e2e/online_serving/test_qwen3_tts.py: wav by
default, `audio/wav`, RIFF/WAVE; `voices` names the presets), sent as those clients send them
and read as they read the answers.

The tiny Qwen3-TTS checkpoints (built by the `qwen-tts` reference) are served as a vLLM-Omni
user starts them (`serve MODEL --omni`), greedy (a stage override) so that the audio can be
compared with the reference's on the same request; the toy TTS model (omnistage/testing/
toy_tts.py: each character a 10 ms tone of the voice's pitch) covers the rest quickly."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import openai
import pytest
import soundfile

from omnistage.testing.toy_tts import RATE, expected_wave, voice_pitch
from omnistage.utils.audio import decode_audio, encode_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

TOY = "toy-tts"
TEXT = "Hello there, how are you?"
LSB = 1 / 32767 + 1e-6
WAV_ATOL = 1e-4 + LSB                  # the goldens' tolerance, plus 16-bit rounding


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def is_wav(content: bytes) -> bool:
    """vLLM-Omni's e2e test's check."""
    return len(content) >= 44 and content[:4] == b"RIFF" and content[8:12] == b"WAVE"


def data_url(wav: bytes) -> str:
    """How openai_speech_client.py sends a local reference file."""
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


# ---- the toy model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from omnistage.testing.toy_tts import build_toy_tts

    return build_toy_tts(tmp_path_factory.mktemp("toy_tts"))


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], toy: tuple[Path, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    """Started as omnistage's own users start it: OpenAI's answers where a request cannot tell."""
    return start_server([str(toy[0]), "--stage-config", str(toy[1]), "--served-model-name",
                         TOY, "--voices-dir", str(tmp_path_factory.mktemp("voices"))])


def tone_wav(seconds: float = 1.0, amp: float = 0.3, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return encode_audio((amp * np.sin(2 * np.pi * 330 * t)).astype(np.float32), rate, "wav")


def clone_pitch(wav: bytes) -> int:
    wave, _ = decode_audio(wav)
    return voice_pitch({"ref_audio": {"samples": wave.mean(axis=0).astype("<f4").tobytes()}})


def speak(server: Server, **body: object) -> np.ndarray:
    r = server.post("/v1/audio/speech", json={"input": TEXT, **body})
    assert r.status_code == 200, r.text
    return decode_audio(r.content)[0][0]


def test_the_default_format_is_openai_s_unless_the_request_is_vllm_omni_s(server: Server
                                                                          ) -> None:
    plain = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "alto"})
    assert plain.headers["content-type"] == "audio/mpeg"
    for field in ({"task_type": "CustomVoice"}, {"max_new_tokens": 100}):
        r = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "alto", **field})
        assert r.headers["content-type"] == "audio/wav" and is_wav(r.content), field
    asked = server.post("/v1/audio/speech", json={"input": TEXT, "task_type": "CustomVoice",
                                                  "response_format": "flac"})
    assert asked.headers["content-type"] == "audio/flac"


def test_vllm_omni_s_stream_switch(server: Server) -> None:
    """Its e2e tests send `stream: true` with `stream_format: audio` (raw bytes); `stream: true`
    alone asks for its SSE events."""
    body = {"input": TEXT, "voice": "bass", "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={**body, "stream_format": "audio", "response_format": "wav"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        wav = b"".join(r.iter_bytes())
    assert is_wav(wav)
    np.testing.assert_allclose(decode_audio(wav)[0][0], expected_wave(TEXT, 1), atol=LSB)
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={**body, "response_format": "pcm"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    np.testing.assert_allclose(decode_audio(pcm, "pcm16", RATE)[0][0], expected_wave(TEXT, 1),
                               atol=LSB)


def test_a_vllm_omni_server_answers_wav_by_default(start_server: Callable[..., Server],
                                                   toy: tuple[Path, Path]) -> None:
    vllm = start_server([str(toy[0]), "--stage-config", str(toy[1]), "--served-model-name",
                         TOY, "--api-dialect", "vllm-omni"])
    r = vllm.post("/v1/audio/speech", json={"input": TEXT, "voice": "bass"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert is_wav(r.content)
    np.testing.assert_allclose(decode_audio(r.content)[0][0], expected_wave(TEXT, 1), atol=LSB)


def test_the_openai_sdk_custom_voice_object(server: Server) -> None:
    client = server.openai()
    wav = client.audio.speech.create(model=TOY, voice={"id": "bass"}, input=TEXT,
                                     response_format="wav").content
    np.testing.assert_allclose(decode_audio(wav)[0][0], expected_wave(TEXT, 1), atol=LSB)
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model=TOY, voice={"id": "nobody"}, input=TEXT)
    assert err.value.body["param"] == "voice" and err.value.body["code"] == "voice_not_found"
    r = server.post("/v1/audio/speech", json={"input": TEXT, "voice": {"id": "bass", "x": 1}})
    assert error_of(r, 400)["param"] == "voice"


def test_ref_audio_wins_over_the_voice_sent_along(server: Server) -> None:
    """openai_speech_client.py sends its default voice with every clone."""
    clip = tone_wav(amp=0.6)
    expected = expected_wave(TEXT, clone_pitch(clip))
    for extra in ({}, {"task_type": "Base"}, {"task_type": "Base", "x_vector_only_mode": True}):
        got = speak(server, voice="alto", ref_audio=data_url(clip), ref_text="a tone",
                    response_format="wav", **extra)
        np.testing.assert_allclose(got, expected, atol=LSB)
    np.testing.assert_allclose(speak(server, voice="bass", task_type="CustomVoice",
                                     response_format="wav"), expected_wave(TEXT, 1), atol=LSB)


def test_voices_list_vllm_omni_s_names_beside_ours(server: Server) -> None:
    r = server.post("/v1/audio/voices", data={"name": "narrator", "consent": "true",
                                              "transcript": "a tone"},
                    files={"audio": ("clip.wav", tone_wav(), "audio/wav")})
    assert r.status_code == 200, r.text
    listed = server.get("/v1/audio/voices").json()
    assert listed["object"] == "list"
    assert [(v["name"], v["type"]) for v in listed["data"]] == [
        ("alto", "preset"), ("bass", "preset"), ("narrator", "uploaded")]
    assert listed["voices"] == ["alto", "bass", "narrator"]          # what the Gradio demo reads
    (uploaded,) = listed["uploaded_voices"]
    assert uploaded["name"] == "narrator" and uploaded["ref_text"] == "a tone"
    # an upload in x-vector mode: its transcript unused; as Base, no ref_audio needed
    for extra in ({"x_vector_only_mode": True}, {"task_type": "Base"}):
        assert speak(server, voice="narrator", **extra).size > 0


def test_the_upload_form_of_vllm_omni_s_readme(server: Server) -> None:
    """`curl -F audio_sample=@... -F consent=ID -F name=... -F ref_text=... -F
    speaker_description=...`, then the voice in a Base request."""
    clip = tone_wav(amp=0.45)
    r = server.post("/v1/audio/voices", data={
        "consent": "user_consent_id", "name": "custom_voice_1", "ref_text": "a tone",
        "speaker_description": "warm narrator"},
        files={"audio_sample": ("voice_sample.wav", clip, "audio/wav")})
    assert r.status_code == 200, r.text
    listed = server.get("/v1/audio/voices").json()
    assert "custom_voice_1" in listed["voices"]
    assert {"name": "custom_voice_1", "ref_text": "a tone"}.items() <= next(
        v for v in listed["uploaded_voices"] if v["name"] == "custom_voice_1").items()
    np.testing.assert_allclose(speak(server, voice="custom_voice_1", task_type="Base"),
                               expected_wave(TEXT, clone_pitch(clip)), atol=LSB)
    r = server.post("/v1/audio/voices", data={"consent": "", "name": "custom_voice_2"},
                    files={"audio_sample": ("voice_sample.wav", clip, "audio/wav")})
    assert error_of(r, 400)["code"] == "consent_required"
    r = server.post("/v1/audio/voices", data={"consent": "true", "name": "custom_voice_3",
                                              "ref_text": "a", "transcript": "b"},
                    files={"audio": ("voice_sample.wav", clip, "audio/wav")})
    assert error_of(r, 400)["param"] == "transcript"


@pytest.mark.parametrize("body, param, code", [
    ({"task_type": "VoiceDesign", "instructions": "deep"}, "task_type", "unsupported_task_type"),
    ({"task_type": "Dubbing"}, "task_type", None),
    ({"task_type": "CustomVoice", "ref_audio": data_url(tone_wav())}, "ref_audio", None),
    ({"task_type": "Base", "voice": "alto"}, "voice", None),
    ({"task_type": "Base", "voice": None}, "ref_audio", "voice_required"),
    ({"x_vector_only_mode": True}, "x_vector_only_mode", None),
    ({"voice": None, "ref_audio": data_url(tone_wav()), "x_vector_only_mode": False},
     "ref_text", "ref_text_required"),
    ({"max_new_tokens": 0}, "max_new_tokens", None),
    ({"max_new_tokens": "100"}, "max_new_tokens", None),
    ({"x_vector_only_mode": "yes"}, "x_vector_only_mode", None),
])
def test_contradictions_are_400s_naming_the_field(server: Server, body: dict, param: str,
                                                   code: str | None) -> None:
    r = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "alto", **body})
    err = error_of(r, 400)
    assert err["param"] == param and (code is None or err["code"] == code), err


def test_batch_items_take_the_fields_too(server: Server) -> None:
    clip = tone_wav(amp=0.6)
    r = server.post("/v1/audio/speech/batch", json={"voice": "alto", "items": [
        {"input": "One.", "task_type": "CustomVoice", "max_new_tokens": 50},
        {"input": "Two.", "ref_audio": data_url(clip), "x_vector_only_mode": True},
        {"input": "Three.", "task_type": "Base"}]})
    assert r.status_code == 200, r.text
    one, two, three = r.json()["data"]
    np.testing.assert_allclose(decode_audio(base64.b64decode(one["audio"]))[0][0],
                               expected_wave("One.", 0), atol=LSB)
    np.testing.assert_allclose(decode_audio(base64.b64decode(two["audio"]))[0][0],
                               expected_wave("Two.", clone_pitch(clip)), atol=LSB)
    assert three["error"]["param"] == "items[2].voice"


# ---- the tiny Qwen3-TTS checkpoints against the reference --------------------------------------

def qwen3_tts(start_server: Callable[..., Server], ref: dict, mode: str) -> Server:
    return start_server([str(ref["root"] / mode), "--omni", "--served-model-name",
                         f"Qwen/Qwen3-TTS-12Hz-0.6B-{mode}",
                         "--stage-override", "talker.ar.sampling.temperature=0",
                         # a tiny random talker may never say EOS: requests without a cap
                         # stop at 64 frames (the server's; max_new_tokens asks fewer)
                         "--stage-override", "talker.ar.sampling.max_tokens=64"])


@pytest.fixture(scope="module")
def custom_voice(start_server: Callable[..., Server], qwen3_tts_ref: dict) -> Server:
    return qwen3_tts(start_server, qwen3_tts_ref, "custom_voice")


def assert_reference_audio(r: httpx.Response, ref: dict, case: str) -> None:
    """The answer as openai_speech_client.py saves it (a wav file) is the reference's audio
    (a clone's: the reference cuts one sample more at its start)."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav" and is_wav(r.content)
    wave, rate = decode_audio(r.content)
    expected = ref[case]["wav0"]
    assert rate == 24000 and 0 <= expected.shape[0] - wave.shape[1] <= 1
    np.testing.assert_allclose(wave[0], expected[-wave.shape[1]:], atol=WAV_ATOL, rtol=0)


def test_the_e2e_requests_and_the_custom_voice_client(custom_voice: Server,
                                                      qwen3_tts_ref: dict) -> None:
    from omnistage.testing.tiny_tts import CASES, MAX_TOKENS

    for text, language in (("Hello, how are you?", "English"), ("你好，我是通义千问", "Chinese")):
        r = custom_voice.post("/v1/audio/speech", json={"input": text, "voice": "vivian",
                                                        "language": language})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "audio/wav" and is_wav(r.content)
    voices = custom_voice.get("/v1/audio/voices").json()["voices"]
    assert {"vivian", "dylan"} <= {v.lower() for v in voices}
    fields = CASES["preset"][1]
    r = custom_voice.post("/v1/audio/speech", json={
        "model": "Qwen/Qwen3-TTS-12Hz-0.6B-custom_voice", "input": fields["text"],
        "voice": fields["speaker"], "response_format": "wav",
        "instructions": fields["instruct"], "task_type": "CustomVoice",
        "language": fields["language"], "max_new_tokens": MAX_TOKENS})
    assert_reference_audio(r, qwen3_tts_ref, "preset")


def test_the_voice_design_client(start_server: Callable[..., Server],
                                 qwen3_tts_ref: dict) -> None:
    from omnistage.testing.tiny_tts import CASES, MAX_TOKENS

    design = qwen3_tts(start_server, qwen3_tts_ref, "voice_design")
    fields = CASES["design"][1]
    r = design.post("/v1/audio/speech", json={
        "input": fields["text"], "voice": "Vivian", "response_format": "wav",
        "instructions": fields["instruct"], "task_type": "VoiceDesign",
        "language": fields["language"], "max_new_tokens": MAX_TOKENS})
    assert_reference_audio(r, qwen3_tts_ref, "design")
    r = design.post("/v1/audio/speech", json={"input": "Hi.", "task_type": "Base",
                                              "ref_audio": data_url(tone_wav())})
    assert error_of(r, 400)["param"] == "task_type"


def test_the_voice_clone_client_in_context_and_x_vector_only(start_server: Callable[..., Server],
                                                             qwen3_tts_ref: dict) -> None:
    from omnistage.testing.tiny_tts import CASES, CLIPS, MAX_TOKENS

    base = qwen3_tts(start_server, qwen3_tts_ref, "base")
    for case, x_vector in (("icl", False), ("xvector", True)):
        fields = CASES[case][1]
        clip = io.BytesIO()
        soundfile.write(clip, CLIPS[case], 24000, format="WAV", subtype="FLOAT")
        body = {"model": "Qwen/Qwen3-TTS-12Hz-0.6B-base", "input": fields["text"],
                "voice": "Vivian", "response_format": "wav", "task_type": "Base",
                "language": fields["language"], "max_new_tokens": MAX_TOKENS,
                "ref_audio": data_url(clip.getvalue()), "ref_text": "Hello world."}
        if x_vector:
            body["x_vector_only_mode"] = True      # the transcript sent along is not used
        assert_reference_audio(base.post("/v1/audio/speech", json=body), qwen3_tts_ref, case)
