"""VibeVoice behind /v1/audio/speech: a tiny random checkpoint (transformers' classes,
save_pretrained, a character tokenizer beside it) served by `omnistage serve <folder>`; a
two-speaker script in the voice of a clip (sent along, or uploaded) speaks exactly what
transformers' generate speaks on the same ids, clip and seed (16-bit rounding apart); every
response format; SSE equal to the whole; two requests at different steps batched; bad input
4xx. Two speakers in two voices (`voices`) speak what transformers speaks with those two clips;
the WebSocket fed the script word by word (both dialects) and /v1/audio/speech/batch speak
what the plain route speaks for each clause / item."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import httpx
import numpy as np
import pytest
import torch

from omnistage.models.vibevoice.config import SAMPLE_RATE, SpeechTokenIds
from omnistage.models.vibevoice.script import parse_script, script_ids
from omnistage.utils.audio import decode_audio, encode_audio
from tests.helpers.speech_routes import batch, ws_speak, ws_speak_vllm
from tests.helpers.vibevoice import reference_generate_with_clips

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "vibevoice"
RATIOS = (8, 10, 15)                   # hop 1200: a 0.5 s clip is 10 frames
HOP = 1200
SEED, G, STEPS = 11, 1.3, 5
SCRIPT = "Speaker 1: Hello there.\nSpeaker 2: Hi, how are you?"
LSB = 1 / 32767 + 1e-4                 # 16-bit rounding, and the golden tests' 1e-4
TOKENS = SpeechTokenIds(audio_bos=250, audio_eos=251, audio=252, eos=253)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_vibevoice import build_tiny_vibevoice, write_tiny_tokenizer

    path = build_tiny_vibevoice(tmp_path_factory.mktemp("vibevoice"), 0, audio_gain=0.01,
                                ratios=RATIOS, speak=1.5)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], root: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    over = [f"speaker.ar.sampling.seed={SEED}", f"speaker.ar.options.guidance_scale={G}",
            f"speaker.ar.options.num_diffusion_steps={STEPS}",
            "speaker.ar.kv_cache.block_size=16", "speaker.ar.kv_cache.num_blocks=128"]
    return start_server([str(root), "--served-model-name", MODEL, "--device", "cpu",
                         "--dtype", "float32", "--voices-dir",
                         str(tmp_path_factory.mktemp("voices")),
                         *[a for o in over for a in ("--stage-override", o)]])


@pytest.fixture(scope="module")
def clip_wav() -> bytes:
    t = np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE
    wave = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.1 * np.sin(2 * np.pi * 1234 * t)
    return encode_audio(wave.astype(np.float32), SAMPLE_RATE, "wav")


@pytest.fixture(scope="module")
def clip2_wav() -> bytes:
    """A second voice: 0.6 s (12 frames), other tones."""
    t = np.arange(SAMPLE_RATE * 3 // 5) / SAMPLE_RATE
    wave = 0.25 * np.sin(2 * np.pi * 220 * t) + 0.15 * np.sin(2 * np.pi * 2500 * t)
    return encode_audio(wave.astype(np.float32), SAMPLE_RATE, "wav")


def reference(root: Path, text: str, wav: bytes, max_new: int,
              per_speaker: list[bytes] | None = None) -> dict:
    """transformers' generate on the ids the script makes, with the clip as the server reads
    it (the wav decoded) as every speaker's voice, or `per_speaker`'s clips, one a speaker."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root)
    script = parse_script(text)
    clips = [torch.from_numpy(decode_audio(w)[0][0].copy())
             for w in per_speaker or [wav] * script.num_speakers]
    frames = [-(-clip.numel() // HOP) for clip in clips]
    ids = script_ids(lambda s: tok.encode(s, add_special_tokens=False), TOKENS, script, frames)
    ref = reference_generate_with_clips(root, ids, clips, SEED, max_new, G, STEPS)
    assert (torch.tensor(ref["tokens"]) == TOKENS.audio).sum() >= 3, ref["tokens"]
    assert 0.05 < ref["audio"].abs().mean() < 0.9, "the reference's audio is silent or clipped"
    return ref


def speak(server: Server, text: str, fmt: str, max_new: int, **voice: object) -> bytes:
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": text,
                                               "response_format": fmt,
                                               "max_new_tokens": max_new, **voice},
                    timeout=300)
    assert r.status_code == 200, r.text
    return r.content


def b64(wav: bytes) -> str:
    return base64.b64encode(wav).decode("ascii")


def pcm_wave(data: bytes) -> np.ndarray:
    return decode_audio(data, "pcm16", SAMPLE_RATE)[0][0]


def test_speech_equals_transformers_in_every_format(server: Server, root: Path,
                                                    clip_wav: bytes) -> None:
    ref = reference(root, SCRIPT, clip_wav, 12)["audio"].numpy()
    pcm = speak(server, SCRIPT, "pcm", 12, ref_audio=b64(clip_wav))
    wave = decode_audio(pcm, "pcm16", SAMPLE_RATE)[0][0]
    np.testing.assert_allclose(wave, ref, atol=LSB, rtol=0)
    for fmt in ("wav", "flac"):                      # lossless: the same 16-bit samples
        got, rate = decode_audio(speak(server, SCRIPT, fmt, 12, ref_audio=b64(clip_wav)))
        assert rate == SAMPLE_RATE
        np.testing.assert_allclose(got[0], wave, atol=1.5 / 32767, rtol=0)
    for fmt in ("mp3", "opus", "aac"):               # lossy: the length, and not silence
        got, rate = decode_audio(speak(server, SCRIPT, fmt, 12, ref_audio=b64(clip_wav)))
        seconds = got.shape[1] / rate
        assert abs(seconds - len(ref) / SAMPLE_RATE) < 0.1, (fmt, seconds)
        assert np.abs(got).max() > 0.05, fmt


def test_an_uploaded_voice_and_sse_equal_the_whole(server: Server, clip_wav: bytes) -> None:
    r = server.post("/v1/audio/voices", data={"name": "alice", "consent": "true"},
                    files={"audio": ("clip.wav", clip_wav, "audio/wav")})
    assert r.status_code == 200, r.text
    whole = speak(server, SCRIPT, "pcm", 12, ref_audio=b64(clip_wav))
    assert speak(server, SCRIPT, "pcm", 12, voice="alice") == whole
    events = server.post("/v1/audio/speech", json={
        "model": MODEL, "input": SCRIPT, "voice": "alice", "response_format": "pcm",
        "max_new_tokens": 12, "stream_format": "sse"}, timeout=300)
    assert events.status_code == 200, events.text
    data = [json.loads(line[5:]) for line in events.text.splitlines()
            if line.startswith("data:")]
    assert data[-1]["type"] == "speech.audio.done", data[-1]
    deltas = [base64.b64decode(e["audio"]) for e in data if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and b"".join(deltas) == whole


def test_two_requests_at_different_steps_batched(server: Server, root: Path,
                                                 clip_wav: bytes) -> None:
    """A streams; B is sent once A's first audio has arrived; each equals its own reference
    run within 4 LSB and 1e-3 relative: the float32 drift of 40 frames batched with another
    request, which batches depend on timing (seen at 1.3e-4 on one sample, 1.6e-4 on three of
    48000 on a loaded machine); a request fed another's state is off by far more."""
    other = "Speaker 3: Good morning to you all."
    ref_a = reference(root, SCRIPT, clip_wav, 40)["audio"].numpy()
    ref_b = reference(root, other, clip_wav, 9)["audio"].numpy()
    got: dict[str, bytes] = {}
    started = threading.Event()

    def run_a() -> None:
        body = {"model": MODEL, "input": SCRIPT, "response_format": "pcm",
                "max_new_tokens": 40, "ref_audio": b64(clip_wav)}
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body,
                          timeout=300) as resp:
            pieces = []
            for piece in resp.iter_bytes():
                pieces.append(piece)
                started.set()
        got["a"] = b"".join(pieces)

    thread = threading.Thread(target=run_a)
    thread.start()
    assert started.wait(300)
    got["b"] = speak(server, other, "pcm", 9, ref_audio=b64(clip_wav))
    thread.join(300)
    for key, ref in (("a", ref_a), ("b", ref_b)):
        wave = decode_audio(got[key], "pcm16", SAMPLE_RATE)[0][0]
        # rtol: float32 drift over A's 40 frames in batches of other shapes
        np.testing.assert_allclose(wave, ref, atol=4 * LSB, rtol=1e-3, err_msg=key)
        assert np.abs(ref).max() > 0.05                     # an audible reference


@pytest.mark.parametrize("body, param", [
    ({"input": SCRIPT, "voice": "nobody"}, "voice"),
    ({"input": "  ", "voice": "alice"}, "input"),
    ({"input": "Speaker 1:", "ref_audio": "AAAA"}, "ref_audio"),
    ({"input": SCRIPT}, "voice"),
])
def test_bad_input_is_a_4xx_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = server.post("/v1/audio/speech", json={"model": MODEL, **body})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_two_speakers_in_two_voices_equal_transformers(server: Server, root: Path,
                                                       clip_wav: bytes, clip2_wav: bytes) -> None:
    """`voices`: one clip per speaker (a clip sent along, an uploaded voice) -> transformers'
    generate with those two clips; a count other than the script's speakers -> 400 naming
    voices."""
    ref = reference(root, SCRIPT, clip_wav, 12, [clip_wav, clip2_wav])["audio"].numpy()
    r = server.post("/v1/audio/voices", data={"name": "bob", "consent": "true"},
                    files={"audio": ("clip.wav", clip2_wav, "audio/wav")})
    assert r.status_code == 200, r.text
    pcm = speak(server, SCRIPT, "pcm", 12, voices=[b64(clip_wav), "bob"])
    np.testing.assert_allclose(pcm_wave(pcm), ref, atol=LSB, rtol=0)
    assert speak(server, SCRIPT, "pcm", 12, voices=[b64(clip_wav), b64(clip2_wav)]) == pcm
    one_voice = pcm_wave(speak(server, SCRIPT, "pcm", 12, ref_audio=b64(clip_wav)))
    assert one_voice.shape != ref.shape or np.abs(one_voice - ref).max() > 0.01, \
        "the second speaker's clip changes nothing"
    for body, param in [({"voices": [b64(clip_wav)]}, "voices"),
                        ({"voices": ["bob", "bob", "bob"]}, "voices"),
                        ({"voices": ["bob"] * 5}, "voices"),
                        ({"voices": ["bob", "bob"], "ref_audio": b64(clip_wav)}, "ref_audio"),
                        ({"voices": ["nobody", "bob"]}, "voices[0]")]:
        r = server.post("/v1/audio/speech", json={"model": MODEL, "input": SCRIPT,
                                                  "max_new_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_websocket_word_by_word_speaks_each_clause_as_the_plain_route(
        server: Server, clip_wav: bytes, clip2_wav: bytes) -> None:
    """The script a word at a time: each clause keeps its speaker ("Hi," is speaker 2's) and
    that speaker's voice, in both dialects; the audio is the plain route's for each clause
    (rtol: clauses in flight together are batched, as in the test above)."""
    voices = [b64(clip_wav), b64(clip2_wav)]
    pcm, clauses = ws_speak(server.port, {"voices": voices, "max_new_tokens": 6}, SCRIPT)
    assert clauses == ["Speaker 1: Hello there.", "Speaker 2: Hi,", "Speaker 2: how are you?"]
    plain = [speak(server, text, "pcm", 6, voices=[v])
             for text, v in zip(clauses, [voices[0], voices[1], voices[1]])]
    np.testing.assert_allclose(pcm_wave(pcm), pcm_wave(b"".join(plain)), atol=LSB, rtol=1e-3)
    sentences = ws_speak_vllm(server.port, {"voices": voices, "max_new_tokens": 6,
                                            "stream_audio": True}, SCRIPT)
    assert [text for text, _ in sentences] == clauses
    for (_, got), want in zip(sentences, plain):
        np.testing.assert_allclose(pcm_wave(got), pcm_wave(want), atol=LSB, rtol=1e-3)


def test_batch_items_each_equal_the_plain_route(server: Server, clip_wav: bytes,
                                                clip2_wav: bytes) -> None:
    """Items of two voices and of one run together; each is the plain route's audio; an item
    with a wrong voice count fails alone, naming its field."""
    items = [{"input": SCRIPT, "voices": [b64(clip_wav), b64(clip2_wav)], "max_new_tokens": 6},
             {"input": "Speaker 1: Good day.", "ref_audio": b64(clip2_wav), "max_new_tokens": 6},
             {"input": SCRIPT, "voices": [b64(clip_wav)], "max_new_tokens": 6}]
    got = batch(server.url, items, "wav", model=MODEL)
    assert got[2]["error"]["param"] == "items[2].voices", got[2]
    for item, result in zip(items[:2], got):
        want = decode_audio(speak(server, item["input"], "wav", 6, **{
            k: v for k, v in item.items() if k in ("voices", "ref_audio")}))[0][0]
        assert result["sample_rate"] == SAMPLE_RATE
        np.testing.assert_allclose(decode_audio(result["audio"])[0][0], want, atol=LSB,
                                   rtol=1e-3)
