"""Text and speech from a real server serving the tiny random Qwen3-Omni (thinker -> talker ->
code2wav), through the official `openai` client as OpenAI's docs call it: chat answers with
message.audio (the text as its transcript, content null), streams the transcript and pcm16
pieces in delta.audio, takes image and audio parts (OpenAI's input_audio, vLLM's audio_url)
through the model's input processor, takes vLLM-Omni's sampling_params_list as it is, and
names audio.voice when the talker does not know the voice."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omnistage.utils.audio import decode_audio, encode_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
RATE = 24000          # Qwen3-Omni's code2wav rate
USER = [{"role": "user", "content": "Hello, who are you?"}]
GREEDY_TALKER = {"sampling_params_list": [None, {"temperature": 0.0}, None]}


def test_models_offer_chat_with_every_input(omni_server: Server) -> None:
    """Text and audio out, the processor's four inputs in; /v1/realtime once it is served."""
    card = omni_server.get("/v1/models").json()["data"][0]
    assert card["modalities"] == ["audio", "text"]
    assert card["capabilities"]["input_modalities"] == ["text", "audio", "image", "video"]
    assert card["capabilities"]["endpoints"][:2] == ["/v1/chat/completions", "/v1/completions"]


def test_text_only_chat_skips_speech(omni_server: Server) -> None:
    """No `modalities`: OpenAI's default, text (the talker and code2wav do not run)."""
    out = omni_server.openai().chat.completions.create(model=MODEL, messages=USER,
                                                       max_tokens=6, temperature=0)
    message = out.choices[0].message
    assert isinstance(message.content, str) and message.audio is None
    assert out.usage.completion_tokens == 6 or out.choices[0].finish_reason == "stop"


def test_chat_with_audio_returns_a_decodable_waveform(omni_server: Server) -> None:
    out = omni_server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
    message = out.choices[0].message
    assert message.content is None and message.audio.transcript
    assert message.audio.id and message.audio.expires_at > time.time()
    wave, rate = decode_audio(base64.b64decode(message.audio.data), "wav")
    assert rate == RATE and wave.shape[0] == 1 and wave.shape[1] > 0
    assert np.isfinite(wave).all() and np.abs(wave).max() <= 1.0


def test_streamed_speech_joins_to_the_whole_answer(omni_server: Server) -> None:
    """Streamed with the official client: transcript pieces and pcm16 pieces in delta.audio,
    joined equal to the non-streamed answer (greedy thinker and talker)."""
    client = omni_server.openai()
    kw = dict(model=MODEL, messages=USER, max_tokens=6, temperature=0,
              modalities=["text", "audio"], extra_body=GREEDY_TALKER)
    whole = client.chat.completions.create(**kw, audio={"voice": "ethan", "format": "wav"})
    chunks = list(client.chat.completions.create(
        **kw, audio={"voice": "ethan", "format": "pcm16"}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    audio = [d.audio for d in deltas if d.audio is not None]
    transcript = "".join(a.transcript for a in audio if a.transcript is not None)
    pieces = [a.data for a in audio if a.data is not None]
    assert transcript == whole.choices[0].message.audio.transcript
    assert pieces, "no audio streamed"
    assert len({a.id for a in audio if a.id is not None}) == 1
    assert audio[-1].expires_at is not None
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed, _ = decode_audio(b"".join(base64.b64decode(p) for p in pieces), "pcm16", RATE)
    ref, _ = decode_audio(base64.b64decode(whole.choices[0].message.audio.data), "wav")
    assert streamed.shape == ref.shape and np.abs(streamed - ref).max() <= 2 / 32767
    m = omni_server.metrics()
    assert m[("omnistage_time_to_first_audio_seconds_count", ())] >= 1


def test_vllm_omni_request_shapes(omni_server: Server) -> None:
    """A request as vLLM-Omni's examples write it: an `audio_url` part, no `audio` object,
    one sampling dict per stage with vLLM keys (detokenize ignored, code2wav's checked and
    unused); a vLLM key omnistage lacks is a 400 naming it."""
    tone = 0.3 * np.sin(np.arange(16000) * 2 * np.pi * 220 / 16000).astype(np.float32)
    url = "data:audio/wav;base64," + base64.b64encode(encode_audio(tone, 16000)).decode()
    spl = [{"temperature": 0.0, "top_k": -1, "max_tokens": 4, "seed": 42, "detokenize": True},
           {"temperature": 0.9, "top_k": 50, "max_tokens": 64, "seed": 42,
            "detokenize": False, "repetition_penalty": 1.05},
           {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42,
            "detokenize": True, "repetition_penalty": 1.1}]
    content = [{"type": "audio_url", "audio_url": {"url": url}},
               {"type": "text", "text": "What is this sound?"}]
    client = omni_server.openai()
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["audio"],
        extra_body={"sampling_params_list": spl})
    message = out.choices[0].message
    wave, rate = decode_audio(base64.b64decode(message.audio.data), "wav")
    assert rate == RATE and wave.shape[1] > 0 and message.content is None
    assert message.audio.transcript          # ["audio"] alone still carries the transcript
    text_only = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is this sound?"}],
        max_tokens=1)
    assert out.usage.prompt_tokens > text_only.usage.prompt_tokens + 1   # the audio's frames
    log = omni_server.log.read_text()
    assert "sampling_params_list[].detokenize: accepted and ignored" in log
    assert "sampling_params_list[2]: accepted and ignored" in log        # code2wav samples nothing
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=USER,
            extra_body={"sampling_params_list": [{"prompt_logprobs": 1}, None, None]})
    assert err.value.body["param"] == "sampling_params_list[0].prompt_logprobs"


@pytest.mark.parametrize("fmt", ["pcm16", "flac", "mp3", "opus"])
def test_every_audio_format_decodes_to_the_same_speech(omni_server: Server, fmt: str) -> None:
    """The same greedy answer in each format: lossless ones equal the WAV's samples (16-bit
    steps), lossy ones keep its length and loudness (within codec tolerance)."""
    def speech(fmt: str) -> tuple[np.ndarray, int]:
        out = omni_server.openai().chat.completions.create(   # a greedy talker as well
            model=MODEL, messages=USER, max_tokens=6, temperature=0,
            modalities=["text", "audio"], audio={"voice": "ethan", "format": fmt},
            extra_body=GREEDY_TALKER)
        data = base64.b64decode(out.choices[0].message.audio.data)
        return decode_audio(data, fmt, RATE if fmt == "pcm16" else None)

    ref, _ = speech("wav")
    wave, rate = speech(fmt)
    if fmt in ("pcm16", "flac"):
        assert rate == RATE and wave.shape == ref.shape
        assert np.abs(wave - ref).max() <= 2 / 32767
    else:
        mono = wave.mean(axis=0)
        assert rate in (RATE, 48000)
        assert abs(len(mono) / rate - ref.shape[1] / RATE) <= 0.1   # codec padding, frames
        assert 0.3 < np.sqrt((mono ** 2).mean()) / np.sqrt((ref ** 2).mean()) < 3.0


def test_image_parts_reach_the_model(omni_server: Server) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]}]}
    with_image = omni_server.post("/v1/chat/completions", json=body)
    assert with_image.status_code == 200, with_image.text
    text_only = omni_server.post("/v1/chat/completions", json={
        **body, "messages": [{"role": "user", "content": "What?"}]})
    # the image's patches are in the prompt
    assert (with_image.json()["usage"]["prompt_tokens"]
            > text_only.json()["usage"]["prompt_tokens"] + 1)


def test_the_playground_chats_with_attachments_and_speech(omni_server: Server, browser: object,
                                                         tmp_path: Path) -> None:
    """The chat tab in headless Chromium: an image and an audio file attached through the file
    field reach the prompt, and the answer streams its transcript and plays its pcm16."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from omnistage.testing.browser import open_playground, visible_tabs, wait_for

    caps = omni_server.get("/v1/models").json()["data"][0]["capabilities"]
    open_playground(browser, omni_server.url)
    realtime = ["Realtime voice"] if "/v1/realtime" in caps["endpoints"] else []
    assert visible_tabs(browser) == ["Chat", *realtime]
    files = browser.find_element(By.ID, "chat-files")
    assert files.get_attribute("accept") == "image/*,audio/*,video/*"
    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "red.png")
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)
    (tmp_path / "tone.wav").write_bytes(encode_audio(tone.astype(np.float32), 16000, "wav"))
    files.send_keys(f"{tmp_path / 'red.png'}\n{tmp_path / 'tone.wav'}")
    browser.find_element(By.ID, "chat-audio").click()
    tokens = browser.find_element(By.ID, "chat-max-tokens")
    tokens.clear()
    tokens.send_keys("6")
    browser.find_element(By.ID, "chat-input").send_keys("What?", Keys.ENTER)
    answer = wait_for(browser, "the spoken answer", lambda d: d.find_element(
        By.CSS_SELECTOR, '.msg.assistant[data-done="true"]'), timeout_s=60)
    assert "error" not in answer.get_attribute("class") and answer.text.strip(), answer.text
    metrics = browser.find_element(By.ID, "chat-metrics").text
    assert "first token" in metrics and "first audio" in metrics, metrics
    # the page's prompt is the text, the image and the audio, as a client would send them
    png, wav = (base64.b64encode((tmp_path / f).read_bytes()).decode()
                for f in ("red.png", "tone.wav"))
    same = omni_server.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]})
    assert f"prompt {same.json()['usage']['prompt_tokens']} tokens" in metrics, metrics


def test_unknown_voice_names_audio_voice(omni_server: Server) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 4,
            "modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "pcm16"}}
    for stream in (False, True):
        r = omni_server.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "audio.voice"


def test_disconnect_mid_speech_aborts_in_every_stage(omni_server: Server) -> None:
    def state() -> dict[str, float]:
        m = omni_server.metrics()
        out = {f"{stage}.{what}": m.get((name, tuple(sorted(labels.items()))), -1.0)
               for stage in ("thinker", "talker", "code2wav")
               for what, name, labels in (
                   ("queued", "omnistage_stage_queue_length", {"stage": stage}),
                   ("free", "omnistage_stage_kv_blocks", {"stage": stage, "state": "free"}),
                   ("total", "omnistage_stage_kv_blocks", {"stage": stage, "state": "total"}))}
        out["aborts"] = m.get(("omnistage_requests_finished_total",
                               (("finish_reason", "abort"),)), 0.0)
        return out

    before = state()
    body = {"model": MODEL, "messages": USER, "max_tokens": 300, "ignore_eos": True,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "stream": True,   # the random talker must not stop at once: min_tokens
            "sampling_params_list": [None, {"min_tokens": 400, "max_tokens": 1000}, None]}
    held: dict[str, float] = {}
    with httpx.stream("POST", f"{omni_server.url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        seen = []
        for line in r.iter_lines():
            seen.append(line)
            if '"audio"' in line:     # speech has started: every stage holds the request
                held = state()
                break
    assert held, ("the stream ended before any audio", [x for x in seen if x][-3:])
    assert all(held[f"{s}.queued"] == 1 for s in ("thinker", "talker", "code2wav")), held
    deadline = time.monotonic() + 30
    while True:
        now = state()
        if (all(now[f"{s}.queued"] == 0 for s in ("thinker", "talker", "code2wav"))
                and all(now[f"{s}.free"] == now[f"{s}.total"] for s in ("thinker", "talker"))
                and now["aborts"] == before["aborts"] + 1):
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.1)


def _segments() -> set[str]:
    """This host's omnistage shared-memory segments (`<namespace>_<tag>_<n>`)."""
    return {n for n in os.listdir("/dev/shm") if re.fullmatch(r"os[0-9a-f]{8}_\w+", n)}


def _held(server: Server) -> dict[str, float]:
    """Per stage: requests its worker holds, requests in its engine, KV blocks in use."""
    m = server.metrics()

    def get(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    return {f"{stage}.{what}": value for stage in ("thinker", "talker", "code2wav")
            for what, value in (
                ("requests", get("omnistage_stage_queue_length", stage=stage)),
                ("engine", get("omnistage_stage_engine_requests", stage=stage)),
                ("blocks", get("omnistage_stage_kv_blocks", stage=stage, state="total")
                 - get("omnistage_stage_kv_blocks", stage=stage, state="free")))}


@pytest.mark.parametrize("kind, body, status", [
    ("int-2**64", {"max_tokens": 2**64}, 400),
    ("talker-override-2**64", {"sampling_params_list": [None, {"top_k": 2**64}, None]}, 400),
    ("talker-override-limit", {"sampling_params_list": [None, {"stop": ["x"] * 10_000},
                                                        None]}, 400),
    ("code2wav-override", {"sampling_params_list": [None, None, {"seed": 2**63}]}, 400),
    ("surrogate", {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
    ("talker-refuses", {"audio": {"voice": "nobody", "format": "wav"}}, 400),
])
def test_a_failed_request_is_freed_in_every_stage(omni_server: Server, kind: str, body: dict,
                                                  status: int) -> None:
    """Whatever the failure (refused at the door, or by a stage after the request was
    registered in all three), no stage holds the request or its KV blocks afterwards and no
    shared-memory segment of it is left."""
    segments = _segments()
    full = {"model": MODEL, "messages": USER, "max_tokens": 4, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "wav"}, **body}
    raw = json.dumps(full).encode()              # a lone surrogate included, as JSON escapes it
    r = omni_server.post("/v1/chat/completions", content=raw,
                         headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    deadline = time.monotonic() + 10
    while any(_held(omni_server).values()) or _segments() - segments:
        assert time.monotonic() < deadline, (kind, _held(omni_server), _segments() - segments)
        time.sleep(0.1)
