"""Chat answers in vLLM-Omni's form, in process (the stand-in omni engine of test_app.py: text
"Hi there" and, when audio is asked for, four chunks of a 440 Hz tone): which requests get
them (the server's dialect, or what the request itself says), the two choices read as
vLLM-Omni's clients read them (not streamed: the choice with `message.audio` and the one
with `content`; streamed: chunks by their `modality`, each audio chunk a file of its own);
and a video model's chat fields planned as /v1/videos plans them."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from omnistage.entrypoints.openai.api_server import ServerConfig
from omnistage.entrypoints.openai.chat_media_out import video_fields
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest
from omnistage.entrypoints.openai.video_params import VideoLimits
from omnistage.registry import VideoSpec
from omnistage.utils.audio import decode_audio
from tests.unit.entrypoints.openai.test_app import CHUNKS, RATE, WAVE, FakeOmni, call

VLLM = ServerConfig(served_model_name="omni", vllm_omni_launch=True)     # `serve --omni`
OPENAI = ServerConfig(served_model_name="omni", vllm_omni_launch=True, api_dialect="openai")
PLAIN = ServerConfig(served_model_name="omni")                           # auto, no --omni
CHAT = {"model": "omni", "messages": [{"role": "user", "content": "say hi"}]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> FakeOmni:
    return FakeOmni(tmp_path_factory.mktemp("tok"))


def chat(engine: FakeOmni, config: ServerConfig, **body: object) -> dict:
    r = call(engine, "POST", "/v1/chat/completions", config, json={**CHAT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def read_like_vllm_omni(answer: dict) -> tuple[str | None, bytes | None]:
    """As vLLM-Omni's example client and e2e tests read an answer: the audio from the choice
    whose message has audio, the text from the one whose content is set."""
    text = audio = None
    for choice in answer["choices"]:
        if choice["message"].get("audio"):
            audio = base64.b64decode(choice["message"]["audio"]["data"])
        elif choice["message"]["content"] is not None:
            text = choice["message"]["content"]
    return text, audio


def test_omni_started_with_omni_answers_text_and_audio_as_two_choices(engine: FakeOmni
                                                                       ) -> None:
    answer = chat(engine, VLLM)
    text_choice, audio_choice = answer["choices"]
    assert text_choice["index"] == 0 and audio_choice["index"] == 1
    assert text_choice["message"]["content"] == "Hi there"
    assert text_choice["message"].get("audio") is None
    assert audio_choice["message"]["content"] is None
    assert audio_choice["finish_reason"] == "stop"
    assert audio_choice["message"]["audio"]["transcript"] == "Hi there"
    text, audio = read_like_vllm_omni(answer)
    assert text == "Hi there" and audio is not None
    wave, rate = decode_audio(audio, "wav")
    assert rate == RATE
    np.testing.assert_allclose(wave[0], WAVE, atol=1 / 32767 + 1e-6)


def test_the_two_choices_streamed_as_vllm_omni_streams_them(engine: FakeOmni) -> None:
    r = call(engine, "POST", "/v1/chat/completions", VLLM,
             json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    text, files = "", []
    for chunk in chunks:                 # vLLM-Omni's e2e reading: by the chunk's modality
        for choice in chunk["choices"]:
            content = choice["delta"].get("content")
            if chunk.get("modality") == "audio" and content:
                files.append(base64.b64decode(content))
            elif chunk.get("modality") == "text" and content:
                text += content
    assert text == "Hi there"
    assert len(files) == len(CHUNKS)
    waves = [decode_audio(f, "wav") for f in files]       # each chunk a wav file of its own
    assert all(rate == RATE for _, rate in waves)
    np.testing.assert_allclose(np.concatenate([w[0] for w, _ in waves]), WAVE,
                               atol=1 / 32767 + 1e-6)
    by_modality = {c["modality"]: c["choices"][0]["index"] for c in chunks if c["choices"]}
    assert by_modality == {"text": 0, "audio": 1}
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0].get("finish_reason")}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["total_tokens"] > 0 and r.text.rstrip().endswith("[DONE]")


def test_the_openai_dialect_changes_nothing(engine: FakeOmni) -> None:
    for config in (OPENAI, PLAIN):
        (choice,) = chat(engine, config)["choices"]
        assert choice["message"]["content"] == "Hi there" and choice["message"]["audio"] is None
        (spoken,) = chat(engine, config, modalities=["text", "audio"])["choices"]
        assert spoken["message"]["content"] is None
        assert spoken["message"]["audio"]["transcript"] == "Hi there"


def test_a_request_that_tells_decides(engine: FakeOmni) -> None:
    # OpenAI's `audio` object (vLLM-Omni's clients send none): OpenAI's one choice
    (choice,) = chat(engine, VLLM, modalities=["text", "audio"],
                     audio={"voice": "ethan", "format": "wav"})["choices"]
    assert choice["message"]["content"] is None and choice["message"]["audio"]["data"]
    # vLLM-Omni's `speaker` or a body-level extra_body object: its two choices, whatever the
    # server's dialect; the speaker is the talker's voice
    answer = chat(engine, OPENAI, speaker="chelsie")
    assert read_like_vllm_omni(answer)[0] == "Hi there" and len(answer["choices"]) == 2
    assert engine.params[-1][0].extra["speaker"] == "chelsie"
    assert len(chat(engine, PLAIN, extra_body={})["choices"]) == 2


def test_modalities_under_the_vllm_dialect(engine: FakeOmni) -> None:
    (choice,) = chat(engine, VLLM, modalities=["text"])["choices"]
    assert choice["message"]["content"] == "Hi there"
    assert len(chat(engine, VLLM, modalities=["text", "audio"])["choices"]) == 2
    (audio,) = chat(engine, VLLM, modalities=["audio"])["choices"]       # one audio choice
    assert audio["message"]["content"] is None and audio["message"]["audio"]["data"]
    # a server's own default_modalities wins over the dialect's
    text_default = ServerConfig(served_model_name="omni", vllm_omni_launch=True,
                                default_modalities=("text",))
    assert len(chat(engine, text_default)["choices"]) == 1


@pytest.mark.parametrize(("body", "param"), [
    ({"speaker": "ethan", "audio": {"voice": "ethan"}}, "speaker"),     # the voice twice
    ({"speaker": "ethan", "modalities": ["text"]}, "speaker"),          # no speech to voice
    ({"speaker": ""}, "speaker"),
])
def test_bad_speakers_are_400_naming_it(engine: FakeOmni, body: dict, param: str) -> None:
    r = call(engine, "POST", "/v1/chat/completions", VLLM, json={**CHAT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


SPEC = VideoSpec(default_size=(64, 48), size_multiple=16, default_num_frames=9,
                 max_num_frames=33, fps=8)
LIMITS = VideoLimits(max_frames=17, max_size=128)


def plan(has_image: bool = False, **fields: object) -> dict:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "a kite"}], "extra_body": fields})
    return video_fields(req, SPEC, LIMITS, has_image)


def test_video_fields_planned_as_videos_plans_them() -> None:
    fields = plan(height=32, num_frames=13, fps=12, seed=5, num_inference_steps=3,
                  guidance_scale=4.0, guidance_scale_2=3.0, negative_prompt="blur")
    assert fields == {"num_frames": 13, "fps": 12, "height": 32, "width": 64, "seed": 5,
                      "num_inference_steps": 3, "guidance_scale": 4.0,
                      "guidance_scale_2": 3.0, "negative_prompt": "blur"}
    defaults = plan()
    assert (defaults["num_frames"], defaults["height"], defaults["width"]) == (9, 48, 64)
    assert 0 <= defaults["seed"]            # drawn: a seed is always set
    assert plan(num_frames=12)["num_frames"] == 13      # rounded as diffusers rounds
    assert plan(true_cfg_scale=2.0, flow_shift=3.0)["num_frames"] == 9   # logged, ignored


@pytest.mark.parametrize(("fields", "has_image", "param"), [
    ({"width": 40}, False, "width"),                      # not a multiple of 16
    ({"width": 64, "height": 40}, False, "height"),
    ({"height": 256}, False, "height"),                   # beyond --max-video-size
    ({"num_frames": 21}, False, "num_frames"),            # beyond --max-video-frames
    ({"num_inference_steps": 0}, False, "num_inference_steps"),
    ({"fps": 0}, False, "fps"),
    ({"num_outputs_per_prompt": 2}, False, "num_outputs_per_prompt"),
    ({}, True, "messages"),                               # a first frame: text-to-video only
])
def test_bad_video_fields_are_400_naming_the_chat_field(fields: dict, has_image: bool,
                                                        param: str) -> None:
    with pytest.raises(APIError) as err:
        plan(has_image, **fields)
    assert err.value.status == 400 and err.value.param == param, err.value.message
