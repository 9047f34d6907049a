"""Issue 25, defects 1 and 2: the work a request costs before it is admitted is bounded, and
the request loop never stalls.

- Media is refused from its header, before decoding: a FLAC whose header claims an hour, a
  PNG whose header claims 8000x8000, a request's images over the pixel budget, a video whose
  frames are too large or too many (the decoders are spied on: never called); a header that
  claims less than the file holds is stopped while decoding.
- A text-only model refuses an image part, too many parts are refused, and a full queue
  answers 429, all before any media is fetched.
- /health answers within its deadline while a long prompt is being prepared (on the old
  code the chat template and the tokenizer ran on the event loop: seconds of stall), and the
  server's shutdown ends the token counter's child process.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image

from omnistage.entrypoints.openai import media as media_module
from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.media import MediaBudget, MediaLoader, MediaPolicy
from omnistage.entrypoints.openai.prep_pool import PrepPool
from omnistage.testing.fake_engine import FakeTextEngine
from omnistage.utils import audio as audio_module
from omnistage.utils.video import encode_video

HEALTH_DEADLINE_S = 0.1
PING_S = 0.02


# ---- media that lies about itself -------------------------------------------------------------

def flac(seconds: float, claim_s: float | None = None, rate: int = 8000) -> bytes:
    """`seconds` of silence as FLAC; `claim_s`: the STREAMINFO's total samples rewritten to
    say that long instead (the 36 low bits of bytes 18..25)."""
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate), np.float32), rate, format="FLAC",
                    subtype="PCM_16")
    data = bytearray(buf.getvalue())
    if claim_s is not None:
        field = int.from_bytes(data[18:26], "big")
        field = (field & ~((1 << 36) - 1)) | int(claim_s * rate)
        data[18:26] = field.to_bytes(8, "big")
    return bytes(data)


def png_claiming(width: int, height: int) -> bytes:
    """A 4x4 PNG whose IHDR (CRC fixed) says width x height: a few hundred bytes."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (9, 9, 9)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)        # IHDR body starts at byte 16
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of calls to the decoders (they still run)."""
    calls = {"decode_audio": 0, "load_image": 0, "fetch": 0}

    def spy(owner: object, name: str) -> None:
        real = getattr(owner, name)

        def counted(*args: object, **kw: object) -> object:
            calls[name] += 1
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, counted)

    spy(audio_module, "decode_audio")
    spy(media_module, "load_image")
    spy(MediaLoader, "fetch")
    return calls


def refused(fn, *args: object) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args)
    assert err.value.status == 400 and err.value.param == "p", err.value.body()
    return err.value


def test_audio_is_refused_from_its_header_and_stopped_while_decoding(spies) -> None:
    loader = MediaLoader(MediaPolicy(max_audio_seconds=5.0))
    hour = flac(1.0, claim_s=3600)
    assert len(hour) < 2000
    b64 = base64.b64encode(hour).decode()
    assert refused(loader.audio, b64, "flac", "p").code == "audio_too_long"
    assert spies["decode_audio"] == 0                  # refused before a sample was decoded
    # a header that says 1 s over 30 s of samples: decoding stops at the limit
    liar = flac(30.0, claim_s=1)
    assert refused(loader.audio_url, data_url(liar, "audio/flac"), "p").code == \
        "audio_too_long"
    # the limit is the request's: two 3 s parts against 5 s
    budget = MediaBudget(loader.policy)
    wave, rate = loader.audio(base64.b64encode(flac(3.0)).decode(), "flac", "p", budget)
    assert len(wave) == 3 * rate
    with pytest.raises(APIError) as err:
        loader.audio(base64.b64encode(flac(3.0)).decode(), "flac", "p", budget)
    assert err.value.code == "audio_too_long"


def test_images_are_refused_from_their_header(spies) -> None:
    loader = MediaLoader(MediaPolicy(max_image_pixels=4096 * 4096,
                                     max_request_pixels=3000 * 2000))
    bomb = png_claiming(8000, 8000)
    assert len(bomb) < 1000
    assert refused(loader.image, data_url(bomb, "image/png"), "p").code == "image_too_large"
    assert spies["load_image"] == 0
    # each within the per-image limit, together over the request's: the second is refused
    # before it is decoded
    budget = MediaBudget(loader.policy)
    with pytest.raises(APIError):                      # the 4x4 pixels are not there
        loader.image(data_url(png_claiming(2000, 2000), "image/png"), "p", budget)
    assert spies["load_image"] == 1
    with pytest.raises(APIError) as err:
        loader.image(data_url(png_claiming(2000, 2000), "image/png"), "p", budget)
    assert err.value.code == "media_too_large" and spies["load_image"] == 1


def test_videos_are_refused_from_their_stream_header(spies, monkeypatch) -> None:
    sampled = []
    real = MediaLoader._sample
    monkeypatch.setattr(MediaLoader, "_sample",
                        lambda self, *args: sampled.append(1) or real(self, *args))
    clip = data_url(encode_video(np.zeros((20, 16, 32, 3), np.uint8), 10, "mp4"), "video/mp4")
    small_frames = MediaLoader(MediaPolicy(max_image_pixels=32 * 16 - 1))
    assert refused(small_frames.video, clip, "p").code == "image_too_large"
    # 2 s at 2 fps: 4 frames of 512 pixels against a budget of 3 frames
    few_pixels = MediaLoader(MediaPolicy(max_request_pixels=3 * 32 * 16))
    assert refused(few_pixels.video, clip, "p").code == "media_too_large"
    assert not sampled                                 # no frame decoded
    frames, _ = MediaLoader(MediaPolicy(max_request_pixels=4 * 32 * 16)).video(clip, "p")
    assert len(frames) == 4 and sampled


# ---- the app, in process ----------------------------------------------------------------------

def chat(content: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}}


async def _post(app, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/chat/completions", json=body, timeout=30)


def test_media_parts_are_refused_before_anything_is_fetched(tmp_path: Path, spies) -> None:
    small = png_claiming(4, 4)
    text_app = build_app(FakeTextEngine(tmp_path / "a"), ServerConfig(served_model_name="m"))
    r = asyncio.run(_post(text_app, chat([{"type": "text", "text": "what is it?"},
                                         image_part(small)])))
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_input"
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    omni_app = build_app(FakeTextEngine(tmp_path / "b", processor=object()),
                         ServerConfig(served_model_name="m", max_media_parts=2,
                                      max_message_parts=3))
    r = asyncio.run(_post(omni_app, chat([image_part(small)] * 3)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_parts"
    r = asyncio.run(_post(omni_app, chat([{"type": "text", "text": "x"}] * 4)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    omni_app.state.client.num_in_flight = omni_app.state.client.max_queue   # the queue full
    r = asyncio.run(_post(omni_app, chat([image_part(small)])))
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert spies["fetch"] == 0 and spies["load_image"] == 0


def test_the_preparation_pool_is_bounded() -> None:
    async def go() -> None:
        pool = PrepPool(workers=1, max_pending=1)
        release = threading.Event()
        try:
            busy = asyncio.ensure_future(pool.run(release.wait, 10))
            await asyncio.sleep(0.05)
            with pytest.raises(APIError) as err:
                await pool.run(int, "1")
            assert err.value.status == 429 and err.value.code == "prep_queue_full"
            release.set()
            assert await busy is True and await pool.run(int, "1") == 1
        finally:
            release.set()
            pool.shutdown()

    asyncio.run(go())

