"""MiMo-Audio served: the tiny checkpoint (tests/helpers/mimo_audio.py: upstream's tiny LLM and
audio tokenizer, made to speak) behind chat completions with audio out and /v1/audio/speech.
What the server answers equals the golden path in this process: our MiMoAudioForCausalLM.
generate (the same maths as upstream generate, tests/golden/models/test_mimo_audio*.py) on
upstream's prompt layout, and the decoder's stream (mimo_audio_stream.stream_decode at the
shipped options; its seam error against the whole decode: test_mimo_audio_stream.py) on its
spoken patches; the streamed response equals the whole one; bad input is a 400 naming the
field. The speech route's formats and SSE, the WebSocket fed word by word and
/v1/audio/speech/batch speak what the plain route speaks. (/v1/realtime:
test_mimo_audio_realtime.py.)"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import torch
import yaml

from omnistage.configs import __file__ as configs_init
from omnistage.generation.mimo_audio import MiMoAudioGenerator
from omnistage.generation.mimo_audio_stream import stream_decode
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
from omnistage.models.mimo_audio.prompt import (SPEECH_START, TEXT_START, MiMoAudioInputProcessor,
                                                SpecialIds, segment_ids, text_patches)
from omnistage.models.mimo_audio.speech import patches_to_codes
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder
from omnistage.utils.audio import decode_audio
from tests.helpers.mimo_audio import build_tiny_mimo_audio
from tests.helpers.speech_routes import batch, ws_speak

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "mimo-audio"
STEPS = 12
LSB = 1 / 32767 + 1e-6                 # 16-bit rounding


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo_audio") / "model", 0.25)


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The shipped graph, greedy and STEPS tokens (the speech route has no sampling fields)."""
    graph = yaml.safe_load((Path(configs_init).parent / "mimo_audio.yaml").read_text())
    graph["stages"][0]["ar"]["sampling"] = {"temperature": 0.0, "max_tokens": STEPS}
    path = tmp_path_factory.mktemp("graph") / "mimo_audio.yaml"
    path.write_text(yaml.safe_dump(graph))
    return start_server([str(folder), "--stage-config", str(path), "--served-model-name", MODEL])


@pytest.fixture(scope="module")
def golden(folder: Path) -> Callable[..., tuple[str, np.ndarray | None, int]]:
    """prompt (a string to speak or messages), speech -> (text, waveform or None, rate)."""
    proc = MiMoAudioInputProcessor.from_pretrained(folder)
    tok = proc.tokenizer
    sp = SpecialIds.of(tok)
    model = MiMoAudioForCausalLM.from_pretrained(folder, sp.empty)
    decoder = MiMoAudioTokenizerDecoder.from_pretrained(folder / "audio_tokenizer", "cpu")
    chunking = MiMoAudioGenerator(decoder).chunking          # the shipped graph's options
    assert chunking is not None

    def run(prompt: object, speech: bool) -> tuple[str, np.ndarray | None, int]:
        ids = proc.parse_request(prompt).input_ids.tolist()
        ids += segment_ids(tok, list(SPEECH_START if speech else TEXT_START))
        out = model.generate(text_patches(ids, model.cfg).reshape(-1), STEPS)
        text_ids = out.view(STEPS, model.cfg.group_size, -1)[:, 0, 0].tolist()
        text = tok.decode([t for t in text_ids if t != sp.empty], skip_special_tokens=True)
        if not speech:
            return text, None, decoder.sample_rate
        assert sp.empty in text_ids and len(set(text_ids)) > 1, "speech and text interleaved"
        codes = patches_to_codes(out, model.cfg, sp.sostm, sp.eostm)
        with torch.no_grad():
            wave = torch.cat(stream_decode(decoder, codes, chunking)).clamp(-1, 1).numpy()
        assert float(np.abs(wave).max()) > 0.01
        return text, wave, decoder.sample_rate
    return run


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= LSB


def test_speech_route_speaks_the_golden_patches(server: Server, golden: Callable) -> None:
    _, want, rate = golden("Hello world.", True)
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": "Hello world.",
                                              "response_format": "wav"})
    assert r.status_code == 200, r.text
    wave, got_rate = decode_audio(r.content)
    assert got_rate == rate
    _close(wave[0], want)
    assert server.get("/v1/audio/voices").json()["data"][0]["name"] == "default"


def test_chat_with_audio_out_equals_golden_and_streamed_equals_whole(
        server: Server, golden: Callable) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    text, want, rate = golden({"messages": messages}, True)
    body = {"model": MODEL, "messages": messages, "modalities": ["text", "audio"],
            "temperature": 0.0, "max_tokens": STEPS}
    r = server.post("/v1/chat/completions", json={**body, "audio": {"format": "wav"}})
    assert r.status_code == 200, r.text
    audio = r.json()["choices"][0]["message"]["audio"]
    assert audio["transcript"] == text
    wave, got_rate = decode_audio(base64.b64decode(audio["data"]))
    assert got_rate == rate
    _close(wave[0], want)

    r = server.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    pieces = [d["audio"] for d in deltas if d.get("audio")]
    assert "".join(p.get("transcript", "") for p in pieces) == text
    pcm = b"".join(base64.b64decode(p["data"]) for p in pieces if p.get("data"))
    _close(decode_audio(pcm, "pcm16", rate)[0][0], want)


def test_chat_text_only_uses_the_text_prompt(server: Server, golden: Callable) -> None:
    messages = [{"role": "user", "content": "Hello there."}]
    text, _, _ = golden({"messages": messages}, False)
    r = server.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                  "temperature": 0.0, "max_tokens": STEPS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text


def test_bad_input_is_a_400_naming_the_field(server: Server) -> None:
    wav = base64.b64encode(b"RIFF0000WAVE").decode()
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "modalities": ["text", "audio"], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {
                "type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]},
         "messages"),
        ("/v1/audio/speech", {"model": MODEL, "input": "Hi", "voice": "nobody"}, "voice"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "assistant", "content": "Hi"}]}, "messages"),
    ]
    for path, body, param in cases:
        r = server.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] and err["param"].startswith(param), err


def plain(server: Server, text: str, fmt: str = "pcm") -> bytes:
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": text,
                                              "response_format": fmt})
    assert r.status_code == 200, r.text
    return r.content


def test_speech_formats_and_sse_equal_the_plain_route(server: Server) -> None:
    text = "Hello world."
    wave, rate = decode_audio(plain(server, text, "wav"))
    pcm = plain(server, text)
    _close(decode_audio(pcm, "pcm16", rate)[0][0], wave[0])
    _close(decode_audio(plain(server, text, "flac"))[0][0], wave[0])
    # lossy: the length, give or take the padding of codec frames, which is long for the tiny
    # decoder's 400 Hz audio coded at 7.35 / 8 kHz (aac's 1024-sample frames + priming: 0.25 s)
    for fmt in ("mp3", "opus", "aac"):
        got, got_rate = decode_audio(plain(server, text, fmt))
        assert -0.05 < got.shape[1] / got_rate - wave.shape[1] / rate < 0.4, fmt
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": text,
                                              "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200, r.text
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == pcm


def test_websocket_and_batch_equal_the_plain_route(server: Server) -> None:
    """Two clauses word by word: the session's pcm is each clause's plain audio in turn; a
    batch of the same two texts (and an unknown voice, refused in its place) likewise."""
    pcm, clauses = ws_speak(server.port, {"voice": "default"}, "Hello world. Good day.")
    assert clauses == ["Hello world.", "Good day."]
    want = [plain(server, text) for text in clauses]
    rate = 24000
    _close(decode_audio(pcm, "pcm16", rate)[0][0],
           decode_audio(b"".join(want), "pcm16", rate)[0][0])
    got = batch(server.url, [{"input": clauses[0]}, {"input": "Hi", "voice": "nobody"},
                             {"input": clauses[1]}], "pcm")
    assert got[1]["error"]["param"] == "items[1].voice", got[1]
    for result, data in zip((got[0], got[2]), want):
        _close(decode_audio(result["audio"], "pcm16", rate)[0][0],
               decode_audio(data, "pcm16", rate)[0][0])
