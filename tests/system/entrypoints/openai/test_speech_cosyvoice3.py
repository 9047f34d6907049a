"""CosyVoice3 behind /v1/audio/speech: the tiny checkpoint of tests/fixtures/cosyvoice3 (flow
and HiFT golden against upstream @ace7c47, the LM's tokens too) laid out as released, with a
byte-level tokenizer padded to Qwen2's ids and ONNX stand-ins of the clip's two encoders
(tests/helpers/cosyvoice3.py), served by a real server with a greedy LM. Each answer is the
golden path run here on the same clip: our prompt builder, the LM on the AR engine, token2mel
and HiFT called directly. Zero-shot, instruct and cross-lingual; an uploaded voice; every
format; SSE equal to the whole file; two requests at once; bad input refused naming the field;
the WebSocket fed word by word and /v1/audio/speech/batch speak what the plain route speaks."""

from __future__ import annotations

import base64
import io
import json
import wave
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from omnistage.ar.engine import AREngine  # noqa: E402
from omnistage.configs.schema import ARConfig, KVCacheConfig  # noqa: E402
from omnistage.generation.cosyvoice3 import CosyVoice3Generator  # noqa: E402
from omnistage.models.cosyvoice3.llm import CosyVoice3LM  # noqa: E402
from omnistage.models.cosyvoice3.model import CosyVoice3  # noqa: E402
from omnistage.models.cosyvoice3.prompt import PromptBuilder  # noqa: E402
from omnistage.payloads import VoicePrompt  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402
from omnistage.utils.audio import decode_audio  # noqa: E402
from tests.helpers.cosyvoice3 import write_served  # noqa: E402
from tests.helpers.speech_routes import batch, ws_speak  # noqa: E402

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

TEXT = "Hi."
LSB = 1.5 / 32768          # the 16-bit files' rounding
TOL = LSB + 2.5e-4         # the flow's float32 sums in the server's threads: a few samples in
                           # 1e5 differ by up to 2e-4 (the mean difference is under 1e-5)


def clip_wav(rate: int = 24000, seconds: float = 1.6, f0: float = 180.0) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = 0.3 * np.sin(2 * np.pi * f0 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def data_url(wav: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return write_served(tmp_path_factory.mktemp("cosyvoice3"))


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder,
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    return start_server([str(folder), "--device", "cpu", "--voices-dir",
                         str(tmp_path_factory.mktemp("voices")),
                         "--stage-override", "llm.ar.sampling.temperature=0"])


class Golden:
    """The golden path, in this process: prompt -> greedy LM on the engine -> flow -> HiFT."""

    def __init__(self, folder) -> None:
        model = CosyVoice3.from_pretrained(folder)
        size = model.cfg.speech_token_size

        def load(path, device, dtype):
            lm = CosyVoice3LM.from_pretrained(folder, size, device, dtype)
            return lm, lm.model_config, None
        self.engine = AREngine(ARConfig(model=str(folder / "CosyVoice-BlankEN"), device="cpu",
                                        dtype="float32", kv_cache=KVCacheConfig(block_size=16)),
                               loader=load)
        self.model, self.builder = model, PromptBuilder(folder, model.cfg, self.engine.model)

    def tokens(self, prompt) -> list[int]:
        params = SamplingParams(temperature=0.0, min_tokens=prompt.min_tokens,
                                max_tokens=prompt.max_tokens,
                                stop_token_ids=self.engine.model.stop_token_ids)
        self.engine.add_request("golden", None, params, prompt.embeds)
        out: list[int] = []
        while self.engine.has_unfinished_requests:
            for o in self.engine.step():
                out += o.new_token_ids
        return [t for t in out if t < self.model.cfg.speech_token_size]

    def speak(self, wav: bytes, text: str = TEXT, **kw) -> np.ndarray:
        """One thread, as each stage process of the 2-core server runs (stage_cpu_threads): the
        vocoder's f0 phase integrates the mel's float32 rounding over the whole utterance."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._speak(wav, text, **kw)
        finally:
            torch.set_num_threads(threads)

    @torch.no_grad()
    def _speak(self, wav: bytes, text: str = TEXT, **kw) -> np.ndarray:
        samples, rate = decode_audio(wav)
        clip = self.builder.clip(samples.mean(axis=0).astype(np.float32), rate)
        prompt = self.builder.build(text, clip, kw.get("ref_text"), kw.get("instructions"))
        tokens = self.tokens(prompt)
        assert len(tokens) >= 4 and len(set(tokens)) >= 2, tokens
        chunks = CosyVoice3Generator(self.model, torch.device("cpu")).speak(
            tokens, VoicePrompt(clip.tokens, clip.mel, clip.xvector))    # streamed, as served
        return torch.cat(chunks).numpy()


@pytest.fixture(scope="module")
def golden(folder) -> Golden:
    return Golden(folder)


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, atol=TOL)
    assert float(np.abs(got - want).mean()) < 3e-5     # 16-bit rounding: ~1e-5


def speak(server: Server, fmt: str = "wav", **body: object) -> np.ndarray:
    r = server.post("/v1/audio/speech", json={"input": TEXT, "response_format": fmt, **body})
    assert r.status_code == 200, r.text
    return decode_audio(r.content, "pcm16" if fmt == "pcm" else None, 24000)[0][0]


@pytest.mark.parametrize("mode", [{"ref_text": "A tone."}, {"instructions": "Speak slowly."},
                                  {}], ids=["zero_shot", "instruct", "cross_lingual"])
def test_speech_equals_the_golden_path(server: Server, golden: Golden, mode: dict) -> None:
    wav = clip_wav()
    want = golden.speak(wav, **mode)
    assert np.abs(want).mean() > 0.05
    got = speak(server, ref_audio=data_url(wav), **mode)
    close(got, want)


def test_two_requests_at_once_each_equal_their_golden(server: Server, golden: Golden) -> None:
    a, b = clip_wav(f0=150.0), clip_wav(rate=16000, seconds=1.2, f0=240.0)
    bodies = [dict(ref_audio=data_url(a), ref_text="A tone."),
              dict(ref_audio=data_url(b), instructions="Loudly.", input="One, two.")]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda body: speak(server, **body), bodies))
    close(got[0], golden.speak(a, ref_text="A tone."))
    close(got[1], golden.speak(b, "One, two.", instructions="Loudly."))


def test_every_format(server: Server) -> None:
    body = dict(ref_audio=data_url(clip_wav()), ref_text="A tone.")
    want = speak(server, **body)
    for fmt in ("mp3", "opus", "aac", "flac", "pcm"):
        r = server.post("/v1/audio/speech", json={"input": TEXT, "response_format": fmt, **body})
        assert r.status_code == 200, (fmt, r.text)
        got, rate = decode_audio(r.content, "pcm16" if fmt == "pcm" else None, 24000)
        if fmt in ("flac", "pcm"):
            np.testing.assert_allclose(got[0], want, atol=TOL)
        else:                 # lossy codecs pad a frame or two (opus decodes at 48 kHz)
            assert len(want) / 24000 <= got.shape[1] / rate <= len(want) / 24000 + 0.1, fmt


def test_sse_stream_equals_the_whole_file(server: Server) -> None:
    body = {"input": TEXT, "ref_audio": data_url(clip_wav()), "ref_text": "A tone.",
            "response_format": "wav", "stream_format": "sse"}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done"
    streamed, _ = decode_audio(b"".join(base64.b64decode(e["audio"]) for e in deltas))
    whole = speak(server, ref_audio=body["ref_audio"], ref_text="A tone.")
    np.testing.assert_array_equal(streamed[0], whole)


def test_an_uploaded_voice_clones_as_its_clip(server: Server) -> None:
    wav = clip_wav(f0=210.0)
    r = server.post("/v1/audio/voices", data={"name": "tone", "consent": "true",
                                              "transcript": "A tone."},
                    files={"audio": ("clip.wav", wav, "audio/wav")})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(speak(server, voice="tone"),
                                  speak(server, ref_audio=data_url(wav), ref_text="A tone."))


@pytest.mark.parametrize("body, param", [
    ({}, "voice"),                                                   # no clip at all
    ({"voice": "nobody"}, "voice"),                                  # no preset voices
    ({"ref_audio": data_url(clip_wav(seconds=0.02))}, "ref_audio"),  # too short for a token
    ({"ref_audio": data_url(clip_wav(rate=16000, seconds=31))}, "ref_audio"),   # over 30 s
    ({"ref_audio": data_url(clip_wav()), "ref_text": "[breath] <|endofsystem|>"}, "ref_text"),
])
def test_bad_input_is_refused_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = server.post("/v1/audio/speech", json={"input": TEXT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_websocket_and_batch_equal_the_plain_route(server: Server) -> None:
    """A zero-shot session fed word by word: each clause's audio is the plain route's for it;
    a batch item likewise, and one without a voice refused in its place."""
    voice = {"ref_audio": data_url(clip_wav(f0=160.0)), "ref_text": "A tone."}
    pcm, clauses = ws_speak(server.port, voice, "Hi. Yes.")
    assert clauses == ["Hi.", "Yes."]
    want = [speak(server, "pcm", input=text, **voice) for text in clauses]
    close(decode_audio(pcm, "pcm16", 24000)[0][0], np.concatenate(want))
    got = batch(server.url, [{"input": "Yes.", **voice}, {"input": "Hi."}], "wav")
    assert got[1]["error"]["param"] == "items[1].voice", got[1]
    close(decode_audio(got[0]["audio"])[0][0], want[1])
