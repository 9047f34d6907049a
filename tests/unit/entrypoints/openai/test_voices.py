"""Issue 37, items 1 and 10, at the routes (the app in process, a fake engine):

- audio at a rate outside utils/audio.py's MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE is a 400 where
  it enters: a chat part, a voice upload, a speech request's ref_audio, realtime input, the
  offline processor and the TTS stage's reference;
- uploads are capped (transcript, number of voices, bytes on disk) with a 4xx naming the
  limit, and names are unique in any case;
- a voice deleted while a speech request reads it or a listing lists it is no voice (400 /
  left out), never a 500: the deletion is made to fall between the two reads.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.media import MediaLoader, MediaPolicy
from omnistage.entrypoints.openai.realtime.audio_buffer import decode_pcm16
from omnistage.entrypoints.openai.voices import MAX_TRANSCRIPT_CHARS, VoiceStore
from omnistage.registry import SpeechSpec
from omnistage.testing.fake_engine import FakeTextEngine
from omnistage.utils.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

RANGE = f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz"


def wav(seconds: float = 1.0, rate: int = 16000, freq: float = 97.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate,
                    format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tok")


def speech_app(tokenizer_dir: Path, voices_dir: Path) -> Any:
    engine = FakeTextEngine(tokenizer_dir, processor=object(),
                            speech=SpeechSpec(voices=("Vivian",), cloning=True))
    return build_app(engine, ServerConfig(served_model_name="m", voices_dir=str(voices_dir)))


def call(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, timeout=30, **kw)
    return asyncio.run(go())


def upload(app: Any, name: str, audio: bytes, transcript: str | None = None
           ) -> httpx.Response:
    data = {"name": name, "consent": "true"}
    if transcript is not None:
        data["transcript"] = transcript
    return call(app, "POST", "/v1/audio/voices", data=data,
                files={"audio": ("a.wav", audio, "audio/wav")})


def error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# ---- item 1: rates out of range, wherever audio enters -----------------------------------------

@pytest.mark.parametrize("rate", [700, 500_000])
def test_voice_uploads_and_ref_audio_at_rates_out_of_range_are_400(
        tokenizer_dir: Path, tmp_path: Path, rate: int) -> None:
    app = speech_app(tokenizer_dir, tmp_path)
    err = error(upload(app, "low", wav(1.0, rate)), 400)
    assert err["param"] == "audio" and err["code"] == "invalid_audio" and RANGE in err["message"]
    r = call(app, "POST", "/v1/audio/speech", json={
        "model": "m", "input": "hi", "ref_audio": base64.b64encode(wav(1.0, rate)).decode()})
    err = error(r, 400)
    assert err["param"] == "ref_audio" and RANGE in err["message"]
    assert not list(tmp_path.glob("*.json"))


def test_chat_audio_below_the_lowest_rate_is_400(tokenizer_dir: Path) -> None:
    app = build_app(FakeTextEngine(tokenizer_dir, processor=object()),
                    ServerConfig(served_model_name="m"))

    def chat(audio: bytes) -> httpx.Response:
        return call(app, "POST", "/v1/chat/completions", json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {
                    "data": base64.b64encode(audio).decode(), "format": "wav"}}]}]})

    err = error(chat(wav(0.5, 600)), 400)
    assert err["code"] == "invalid_audio" and f"{MIN_SAMPLE_RATE} to" in err["message"]
    wave, rate = MediaLoader(MediaPolicy()).audio(base64.b64encode(wav(0.5, 8001)).decode(),
                                                  "wav", "p")
    assert rate == 8001 and wave.shape == (4000,)


@pytest.mark.parametrize("rate", [MIN_SAMPLE_RATE - 1, MAX_SAMPLE_RATE + 1])
def test_realtime_input_at_a_rate_out_of_range_is_refused(rate: int) -> None:
    pcm = base64.b64encode(np.zeros(400, "<i2").tobytes()).decode()
    with pytest.raises(APIError) as err:
        decode_pcm16(pcm, rate, "audio")
    assert err.value.status == 400 and err.value.param == "audio" and RANGE in err.value.message
    assert len(decode_pcm16(pcm, 8001, "audio")) == 800      # 400 samples at 8001 Hz -> 16k


def test_offline_and_stage_inputs_at_rates_out_of_range_are_refused() -> None:
    from omnistage.models.qwen3_omni.processing import InputProcessor
    from omnistage.stages.qwen3_tts import reference_waveform
    from omnistage.stages.voice import InputError

    processor = object.__new__(InputProcessor)                # only its feature extractor
    processor.feature_extractor = SimpleNamespace(sampling_rate=16000, n_fft=400)
    part = {"audio": np.zeros(2000, np.float32), "sample_rate": 999}
    with pytest.raises(ValueError, match=r"m\.sample_rate: 999 Hz is outside"):
        processor._audio(part, "m")
    assert processor._audio({**part, "sample_rate": 7919}, "m").shape == (4041,)
    with pytest.raises(InputError, match="outside"):
        reference_waveform({"samples": np.ones(2000, "<f4").tobytes(), "sample_rate": 400_000})


# ---- item 10: caps and names -------------------------------------------------------------------

def test_uploads_are_capped(tokenizer_dir: Path, tmp_path: Path) -> None:
    app = speech_app(tokenizer_dir, tmp_path)
    err = error(upload(app, "long", wav(), "w" * (MAX_TRANSCRIPT_CHARS + 1)), 400)
    assert err["param"] == "transcript" and str(MAX_TRANSCRIPT_CHARS) in err["message"]
    assert upload(app, "ok", wav(), "w" * MAX_TRANSCRIPT_CHARS).status_code == 200

    store = VoiceStore(tmp_path / "capped", ("Vivian",))
    store.max_voices = 2
    store.add("a", wav(), None)
    store.add("b", wav(), None)
    with pytest.raises(APIError) as exc:
        store.add("c", wav(), None)
    assert exc.value.status == 400 and exc.value.code == "too_many_voices"
    assert "at most 2" in exc.value.message
    store.delete("a")
    store.max_bytes = sum(f.stat().st_size for f in store.folder.iterdir()) + 1000
    with pytest.raises(APIError) as exc:                      # a 1 s float32 clip: 64 kB
        store.add("c", wav(), None)
    assert exc.value.status == 400 and exc.value.code == "voice_storage_full"
    assert str(store.max_bytes) in exc.value.message
    assert [c.name for c in store.cards() if c.type == "uploaded"] == ["b"]
    assert not [f for f in store.folder.iterdir() if f.name.startswith(".upload-")]


def test_names_are_unique_in_any_case(tokenizer_dir: Path, tmp_path: Path) -> None:
    app = speech_app(tokenizer_dir, tmp_path)
    assert upload(app, "Ann", wav(), "hello").status_code == 200
    err = error(upload(app, "aNN", wav(freq=150.0)), 409)
    assert err["code"] == "voice_exists" and "'Ann'" in err["message"]
    store = VoiceStore(tmp_path, ("Vivian",))
    assert store.get("ANN").transcript == "hello"
    assert [c.name for c in store.cards()] == ["Vivian", "Ann"]
    assert call(app, "DELETE", "/v1/audio/voices/ann").status_code == 200
    assert not list(tmp_path.iterdir())
    assert error(call(app, "DELETE", "/v1/audio/voices/ann"), 404)["code"] == "voice_not_found"


# ---- item 10: deletion racing use and listing --------------------------------------------------

def test_a_voice_deleted_while_a_speech_request_reads_it_is_unknown(
        tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deletion lands between the voice's lookup (its json) and the read of its clip."""
    app = speech_app(tokenizer_dir, tmp_path)
    assert upload(app, "gone", wav()).status_code == 200
    real_read = soundfile.read

    def deleted_first(path: Any, *args: Any, **kw: Any) -> Any:
        VoiceStore(tmp_path, ()).delete("gone")
        return real_read(path, *args, **kw)

    monkeypatch.setattr(soundfile, "read", deleted_first)
    err = error(call(app, "POST", "/v1/audio/speech",
                     json={"model": "m", "input": "hi", "voice": "gone"}), 400)
    assert err["param"] == "voice" and err["code"] == "voice_not_found"


def test_a_listing_leaves_out_a_voice_deleted_meanwhile(
        tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deletion lands between the listing's read of the folder and of a voice's json."""
    app = speech_app(tokenizer_dir, tmp_path)
    for name in ("first", "second"):
        assert upload(app, name, wav()).status_code == 200
    real_read_text = Path.read_text
    deleted: list[str] = []

    def deleted_first(self: Path, *args: Any, **kw: Any) -> str:
        if self.name == "first.json" and not deleted:
            deleted.append(self.stem)
            VoiceStore(tmp_path, ()).delete(self.stem)
        return real_read_text(self, *args, **kw)

    monkeypatch.setattr(Path, "read_text", deleted_first)
    r = call(app, "GET", "/v1/audio/voices")
    assert r.status_code == 200 and deleted == ["first"]
    assert [v["name"] for v in r.json()["data"]] == ["Vivian", "second"]


def test_a_voice_deleted_twice_at_once_is_deleted_and_a_404(
        tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another deletion (another process's store) lands between this one's lookup and its
    unlinking."""
    app = speech_app(tokenizer_dir, tmp_path)
    assert upload(app, "twice", wav()).status_code == 200
    real_unlink = Path.unlink
    deleted: list[str] = []

    def deleted_first(self: Path, *args: Any, **kw: Any) -> None:
        if self.name == "twice.json" and not deleted:
            deleted.append(self.stem)
            VoiceStore(tmp_path, ()).delete(self.stem)
        real_unlink(self, *args, **kw)

    monkeypatch.setattr(Path, "unlink", deleted_first)
    err = error(call(app, "DELETE", "/v1/audio/voices/twice"), 404)
    assert err["code"] == "voice_not_found" and deleted == ["twice"]
    assert not list(tmp_path.iterdir())


def test_deleting_and_re_adding_while_others_read_and_list_never_fails(tmp_path: Path) -> None:
    """Two threads delete and re-add one voice while two others list and read it: every
    listing and read answers (the voice or no voice), every delete is done or a 404."""
    store = VoiceStore(tmp_path, ("Vivian",))
    clip = wav(0.6)
    store.add("v", clip, "t")
    stop, failures, counts = threading.Event(), [], {"read": 0, "listed": 0, "churn": 0}

    def churn() -> None:
        while not stop.is_set():
            for step in (lambda: store.delete("v"), lambda: store.add("v", clip, "t")):
                try:
                    step()
                except APIError as err:
                    if err.status not in (404, 409):
                        failures.append(err)
                except Exception as exc:                    # noqa: BLE001 (the test's point)
                    failures.append(exc)
            counts["churn"] += 1

    def read() -> None:
        while not stop.is_set():
            try:
                voice = store.get("V")
                assert voice is None or (voice.sample_rate == 16000 and len(voice.samples)
                                         == 9600 and voice.transcript == "t")
                names = [c.name for c in store.cards()]
                assert names in (["Vivian"], ["Vivian", "v"]), names
            except Exception as exc:                        # noqa: BLE001
                failures.append(exc)
            counts["read"] += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (churn, churn, read, read)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (counts["churn"] < 40 or counts["read"] < 40) and time.monotonic() < deadline \
            and not failures:
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert not failures, failures[:3]
    assert counts["churn"] >= 40 and counts["read"] >= 40, counts
