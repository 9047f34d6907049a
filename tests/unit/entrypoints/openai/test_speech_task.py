"""vLLM-Omni's speech fields read against a model's speech spec (speech_task.py), the OpenAI
SDK's voice object, the voices list's two shapes and the default format (no server: the
request bodies as pydantic reads them, a stand-in for the app's config)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.protocol_speech import (
    SpeechRequest,
    SpeechVoice,
    VoiceCard,
    VoiceList,
)
from omnistage.entrypoints.openai.serving_speech import SpeechServing
from omnistage.entrypoints.openai.speech_task import (
    check_clone_mode,
    resolve_task,
    served_tasks,
)
from omnistage.registry import SpeechSpec

CUSTOM = SpeechSpec(voices=("vivian", "dylan"), instructions=True)
DESIGN = SpeechSpec(voice_design=True, instructions=True)
BASE = SpeechSpec(cloning=True)
CLIP = {"ref_audio": {"samples": b"\0" * 8, "sample_rate": 24000}}


def refused(v: SpeechVoice, spec: SpeechSpec) -> APIError:
    with pytest.raises(APIError) as err:
        resolve_task(v, spec)
    assert err.value.status == 400
    return err.value


def test_each_checkpoint_serves_its_own_task() -> None:
    assert served_tasks(CUSTOM) == ("CustomVoice",)
    assert served_tasks(DESIGN) == ("VoiceDesign",)
    assert served_tasks(BASE) == ("Base",)
    err = refused(SpeechVoice(task_type="Base", ref_audio="x"), CUSTOM)
    assert err.param == "task_type" and "CustomVoice" in err.message


def test_base_the_clip_wins_over_the_voice() -> None:
    v = resolve_task(SpeechVoice(voice="Vivian", ref_audio="x", ref_text="hi"), BASE)
    assert v.voice is None and v.ref_audio == "x" and v.ref_text == "hi"
    v = resolve_task(SpeechVoice(voice="Vivian", ref_audio="x", ref_text="hi",
                                 task_type="Base", x_vector_only_mode=True), BASE)
    assert v.voice is None and v.ref_text is None
    assert resolve_task(SpeechVoice(voice="mine", task_type="Base"), BASE).voice == "mine"
    assert refused(SpeechVoice(task_type="Base"), BASE).param == "ref_audio"
    both = SpeechSpec(voices=("vivian",), cloning=True)
    assert refused(SpeechVoice(voice="VIVIAN", task_type="Base"), both).param == "voice"


def test_voice_design_needs_instructions_and_ignores_the_voice() -> None:
    v = resolve_task(SpeechVoice(voice="Vivian", task_type="VoiceDesign",
                                 instructions="deep"), DESIGN)
    assert v.voice is None and v.instructions == "deep"
    assert refused(SpeechVoice(task_type="VoiceDesign"), DESIGN).param == "instructions"
    err = refused(SpeechVoice(task_type="VoiceDesign", instructions="deep", ref_text="t"), DESIGN)
    assert err.param == "ref_text"


def test_custom_voice_takes_no_clip() -> None:
    assert resolve_task(SpeechVoice(voice="dylan", task_type="CustomVoice"), CUSTOM).voice == "dylan"
    assert refused(SpeechVoice(task_type="CustomVoice", ref_audio="x"), CUSTOM).param == "ref_audio"


def test_x_vector_only_mode_on_the_voice_as_resolved() -> None:
    extra = {**CLIP, "ref_text": "hi", "language": "english"}
    assert check_clone_mode(SpeechVoice(), extra) is extra
    assert "ref_text" not in check_clone_mode(SpeechVoice(x_vector_only_mode=True), extra)
    assert check_clone_mode(SpeechVoice(x_vector_only_mode=False), extra) == extra
    with pytest.raises(APIError) as err:
        check_clone_mode(SpeechVoice(x_vector_only_mode=False), {**CLIP, "ref_text": None},
                         "items[1].")
    assert err.value.param == "items[1].ref_text"
    with pytest.raises(APIError) as err:
        check_clone_mode(SpeechVoice(x_vector_only_mode=True), {"voice": "vivian"})
    assert err.value.param == "x_vector_only_mode"
    assert check_clone_mode(SpeechVoice(x_vector_only_mode=False), {"voice": "v"}) == {"voice": "v"}


def test_the_sdk_voice_object_names_the_voice() -> None:
    assert SpeechVoice.model_validate({"voice": {"id": "voice_1234"}}).voice == "voice_1234"
    for bad in ({"id": "a", "name": "b"}, {}, {"id": 3}):
        with pytest.raises(ValidationError):
            SpeechVoice.model_validate({"voice": bad})


def test_voices_list_carries_both_shapes() -> None:
    listed = VoiceList(data=[VoiceCard(name="vivian", type="preset"),
                             VoiceCard(name="mine", type="uploaded", transcript="hello",
                                       created_at=5, duration_s=1.0),
                             VoiceCard(name="bare", type="uploaded", created_at=6)])
    body = listed.model_dump()
    assert body["object"] == "list" and len(body["data"]) == 3
    assert body["voices"] == ["vivian", "mine", "bare"]
    assert body["uploaded_voices"] == [{"name": "mine", "created_at": 5, "ref_text": "hello"},
                                       {"name": "bare", "created_at": 6}]


@pytest.mark.parametrize("body, vllm_server, fmt", [
    ({}, False, "mp3"),
    ({}, True, "wav"),
    ({"task_type": "CustomVoice"}, False, "wav"),
    ({"max_new_tokens": 10}, False, "wav"),
    ({"x_vector_only_mode": False}, False, "wav"),
    ({"stream": True, "stream_format": "audio"}, False, "wav"),
    ({"response_format": "pcm"}, True, "pcm"),
    ({"response_format": "mp3", "task_type": "Base"}, False, "mp3"),
])
def test_the_default_format(body: dict, vllm_server: bool, fmt: str) -> None:
    req = SpeechRequest.model_validate({"input": "hi", **body})
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(
        config=SimpleNamespace(vllm_omni_answers=vllm_server))))
    assert SpeechServing.response_format(req, request) == fmt    # type: ignore[arg-type]
