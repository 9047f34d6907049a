"""Chat completions answering as vLLM-Omni answers (issue 40, items 2 and 5), each server
started as a vLLM-Omni user starts it (`serve MODEL --omni`), each request sent and each answer
read as vLLM-Omni's clients and e2e tests do:

- text_to_video's chat client and curl example (raw HTTP, no `model`, a literal `extra_body`
  object): the MP4 of the assistant message's `video_url` part, a data URL split at the comma,
  against the tiny Wan2.2 A14B folder and the toy video model (frames known exactly);
- the omni e2e tests (tests/e2e/online_serving/test_qwen3_omni*.py) and the qwen3_omni chat
  client: no `modalities`, text in choices[0] and audio in choices[1]; streamed, chunks read by
  their `modality`;
- glm_image's client reading an image model's answer, and the demo model's refusal of a
  negative prompt naming the field.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest
from PIL import Image

from omnistage.testing.toy_video import build_toy_video, expected_frames
from omnistage.utils.audio import decode_audio
from omnistage.utils.video import decode_video, encode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MIN_PSNR_DB = 35.0     # H.264 on the toy's flat colours
SYSTEM = {"role": "system", "content": [{"type": "text", "text": (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech.")}]}


def video_from_chat(answer: dict) -> bytes | None:
    """As text_to_video/openai_chat_client.py reads it: the first part whose video_url is a
    data:video URL, decoded."""
    content = answer["choices"][0]["message"]["content"]
    if isinstance(content, list):
        for item in content:
            url = item.get("video_url", {}).get("url", "")
            if url.startswith("data:video"):
                return base64.b64decode(url.split(",", 1)[1])
    return None


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


# ---- video -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
               ) -> Server:
    folder, graph = build_toy_video(tmp_path_factory.mktemp("toy_video"))
    return start_server([str(folder), "--omni", "--stage-config", str(graph),
                         "--max-video-frames", "17", "--max-video-size", "128",
                         "--videos-dir", str(tmp_path_factory.mktemp("videos"))])


def test_text_to_video_client_gets_the_mp4(toy_server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "a kite over the sea"}],
            "extra_body": {"height": 48, "width": 64, "num_frames": 13, "fps": 12,
                           "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 42,
                           "negative_prompt": "blurry"}}
    r = toy_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = video_from_chat(r.json())
    assert data is not None, r.json()
    frames, fps = decode_video(data)
    want = expected_frames("a kite over the sea", 42, 13, 48, 64)
    assert frames.shape == want.shape and fps == pytest.approx(12)
    assert psnr(frames, want) > MIN_PSNR_DB


def test_the_curl_example_frame_count_is_rounded_as_diffusers_does(toy_server: Server) -> None:
    """run_curl_text_to_video.sh asks for a frame count Wan's VAE cannot make (32 there); the
    pipeline makes the next it can, as diffusers' Wan pipeline does."""
    body = {"messages": [{"role": "user", "content": "A cat surfing on waves"}],
            "extra_body": {"height": 48, "width": 64, "num_frames": 8, "seed": 42, "fps": 16,
                           "num_inference_steps": 2}}
    r = toy_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    parts = [p for p in r.json()["choices"][0]["message"]["content"] if p["type"] == "video_url"]
    frames, _ = decode_video(base64.b64decode(parts[0]["video_url"]["url"].split(",", 1)[1]))
    assert frames.shape[0] == 9


def test_image_to_video_takes_the_user_messages_image(toy_server: Server) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 90)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "text", "text": "it moves"},
               {"type": "image_url", "image_url": {"url": url}}]
    out = toy_server.openai().chat.completions.create(
        model=None, messages=[{"role": "user", "content": content}],  # type: ignore[arg-type]
        extra_body={"num_frames": 5, "seed": 7, "num_inference_steps": 2})
    frames, _ = decode_video(video_from_chat(out.model_dump(warnings=False)) or b"")
    want = expected_frames("it moves", 7, 5, 48, 64, Image.open(io.BytesIO(buf.getvalue())))
    assert frames.shape == want.shape and psnr(frames, want) > MIN_PSNR_DB


def test_a_streamed_video_ends_with_its_part(toy_server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "a kite"}], "stream": True,
            "extra_body": {"num_frames": 5, "seed": 1, "num_inference_steps": 3}}
    r = toy_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert ": progress" in r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    parts = [p for c in chunks for p in (c["choices"][0]["delta"].get("content") or [])
             if isinstance(p, dict)]
    assert [p["type"] for p in parts] == ["video_url"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"num_frames": 21}, "num_frames", "too_many_frames"),         # --max-video-frames 17
    ({"width": 40}, "width", None),                                # not a multiple of 16
    ({"height": 256}, "height", "size_too_large"),                 # --max-video-size 128
    ({"num_inference_steps": 0}, "num_inference_steps", None),
    ({"temperature": 0.5}, "temperature", None),                   # a text model's field
])
def test_bad_video_requests_are_400_naming_the_field(toy_server: Server, extra: dict,
                                                     param: str, code: str | None) -> None:
    r = toy_server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a kite"}], "extra_body": extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if code:
        assert error["code"] == code


@pytest.fixture(scope="module")
def wan_server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
               ) -> Server:
    pytest.importorskip("diffusers")
    from omnistage.testing.tiny_wan import build_tiny_wan22_a14b

    folder = tmp_path_factory.mktemp("wan22")
    build_tiny_wan22_a14b(folder)
    return start_server([str(folder), "--omni", "--videos-dir",
                         str(tmp_path_factory.mktemp("wan-videos"))])


def test_wan22_through_chat_as_the_curl_example_asks(wan_server: Server) -> None:
    """run_curl_text_to_video.sh's body (Wan2.2 A14B: both guidance scales), smaller."""
    body = {"messages": [{"role": "user", "content": "A cat surfing on waves"}],
            "extra_body": {"height": 32, "width": 48, "num_frames": 5,
                           "num_inference_steps": 2, "guidance_scale": 4.0,
                           "guidance_scale_2": 3.0, "seed": 42, "fps": 16}}
    r = wan_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    frames, _ = decode_video(video_from_chat(r.json()) or b"")
    assert frames.shape == (5, 32, 48, 3) and frames.std() > 1.0


# ---- omni: two choices -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def omni(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
         ) -> Server:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_omni"))
    return start_server([str(path), "--omni", "--served-model-name", "tiny-omni",
                         "--stage-override", "thinker.ar.sampling.temperature=0",
                         "--stage-override", "thinker.ar.sampling.ignore_eos=true",
                         "--stage-override", "thinker.ar.sampling.max_tokens=12"])


def video_messages() -> list[dict]:
    """The e2e tests' messages: the system prompt, then a video and a question."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (4, 32, 32, 3), dtype=np.uint8)
    url = "data:video/mp4;base64," + base64.b64encode(encode_video(frames, 2, "mp4")).decode()
    return [SYSTEM, {"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "Describe the video briefly."}]}]


def test_omni_e2e_two_choices(omni: Server) -> None:
    """test_video_to_audio: no modalities; text in choices[0] (finish length: the thinker
    never stops early here), audio in choices[1] (finish stop)."""
    out = omni.openai().chat.completions.create(model="tiny-omni", messages=video_messages())
    assert len(out.choices) == 2
    text_choice, audio_choice = out.choices
    assert text_choice.finish_reason == "length"
    assert text_choice.message.content is not None and len(text_choice.message.content) >= 10
    assert text_choice.message.role == "assistant"
    assert audio_choice.finish_reason == "stop"
    assert audio_choice.message.audio is not None and len(audio_choice.message.audio.data) > 0
    wave, rate = decode_audio(base64.b64decode(audio_choice.message.audio.data))
    assert rate == 24000 and wave.shape[1] > 0


def test_omni_client_reads_every_choice(omni: Server) -> None:
    """openai_chat_completion_client_for_multimodal_generation.py: a sampling dict per stage
    in extra_body, then each choice saved as audio or printed as text."""
    spl = [{"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 6,
            "repetition_penalty": 1.05, "seed": 42},
           {"temperature": 0.9, "top_k": 50, "max_tokens": 64, "seed": 42,
            "detokenize": False, "repetition_penalty": 1.05},
           {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42,
            "detokenize": True, "repetition_penalty": 1.1}]
    out = omni.openai().chat.completions.create(
        model="tiny-omni", messages=[SYSTEM, {"role": "user", "content": [
            {"type": "text", "text": "Explain the system architecture."}]}],
        extra_body={"sampling_params_list": spl})
    audio, text = [], []
    for choice in out.choices:
        if choice.message.audio:
            audio.append(base64.b64decode(choice.message.audio.data))
        elif choice.message.content:
            text.append(choice.message.content)
    assert len(audio) == 1 and len(text) == 1 and audio[0][:4] == b"RIFF"


def test_omni_e2e_stream_read_by_modality(omni: Server) -> None:
    """The e2e tests' streamed reading: each chunk's `modality`; text joined, each audio
    chunk's content a base64 audio file."""
    stream = omni.openai().chat.completions.create(model="tiny-omni",
                                                   messages=video_messages(), stream=True)
    text, files = "", []
    for chunk in stream:
        for choice in chunk.choices:
            content = getattr(choice.delta, "content", None)
            modality = getattr(chunk, "modality", None)
            if modality == "audio" and content:
                files.append(base64.b64decode(content))
            elif modality == "text" and content:
                text += content
    assert len(text) >= 2 and files
    waves = [decode_audio(f)[0] for f in files]
    assert sum(w.shape[1] for w in waves) > 0


def test_omni_curl_example_body(omni: Server) -> None:
    """qwen3_omni/run_curl_multimodal_generation.sh text: raw HTTP with the model's name (the
    user's to change), `"modalities": null`, `"mm_processor_kwargs": {}`, three stage dicts
    (the talker's `stop_token_ids`, code2wav's `top_k: -1`), a system prompt of parts; the
    script prints `.choices[0].message.content`: the text."""
    import httpx

    spl = [{"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 6, "seed": 42,
            "repetition_penalty": 1.05, "stop_token_ids": [151645]},
           {"temperature": 0.9, "top_k": 50, "max_tokens": 64, "seed": 42,
            "detokenize": False, "repetition_penalty": 1.05},
           {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42,
            "detokenize": True, "repetition_penalty": 1.1}]
    body = {"model": "tiny-omni", "sampling_params_list": spl, "mm_processor_kwargs": {},
            "modalities": None, "messages": [SYSTEM, {"role": "user", "content": [
                {"type": "text", "text": "Explain the system architecture. Answer in 15 "
                                         "words."}]}]}
    r = httpx.post(f"{omni.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and isinstance(choices[0]["message"]["content"], str)
    assert choices[0]["message"]["content"] and choices[1]["message"]["audio"]["data"]


def test_openai_modalities_and_audio_keep_openais_shape(omni: Server) -> None:
    """A request with OpenAI's `audio` object says its client reads OpenAI's shape."""
    out = omni.openai().chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "hi"}],
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
    (choice,) = out.choices
    assert choice.message.content is None and choice.message.audio.transcript


# ---- images and the demo ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
         ) -> Server:
    return start_server(["--omni"])         # no MODEL: the demo model


def test_glm_image_client_reads_the_image(demo: Server) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a 7"}]}],
            "extra_body": {"height": 32, "width": 32, "num_inference_steps": 4,
                           "guidance_scale": 1.5, "seed": 42}}
    r = demo.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    found = None
    for choice in r.json().get("choices", []):       # glm_image/openai_chat_client.py
        for item in choice.get("message", {}).get("content") or []:
            if isinstance(item, dict) and "image_url" in item:
                url = item["image_url"].get("url", "")
                if url.startswith("data:image"):
                    found = base64.b64decode(url.split(",", 1)[1])
    assert found is not None and Image.open(io.BytesIO(found)).size == (32, 32)


@pytest.mark.parametrize(("extra", "param"), [({"negative_prompt": "blurry"}, "negative_prompt"),
                                              ({"true_cfg_scale": 4.0}, "true_cfg_scale")])
def test_the_demo_refusal_names_the_field(demo: Server, extra: dict, param: str) -> None:
    r = demo.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a 7"}], "extra_body": extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_an_image_model_makes_no_video(demo: Server) -> None:
    r = demo.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a 7"}], "modalities": ["video"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_modality"

