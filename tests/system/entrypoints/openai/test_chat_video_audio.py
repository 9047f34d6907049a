"""vLLM-Omni's video requests against `omnistage serve MODEL --omni` with the tiny random
Qwen2.5-Omni, sent and read as its example client does
(examples/online_serving/qwen2_5_omni/openai_chat_completion_client_for_multimodal_generation.py,
query type use_audio_in_video): a `video_url` part with `num_frames`, and
`mm_processor_kwargs: {"use_audio_in_video": true}` in the SDK's extra_body. Remote media: a
server started as vLLM-Omni's fetches http(s) URLs (a private address is still refused), one
started plainly refuses them naming the flag. The tiny Qwen3-Omni takes the same switch."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.audio_in_video import mp4_with_audio
from tests.system.entrypoints.openai.conftest import Server

SYSTEM = {"role": "system", "content": [{"type": "text", "text": (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech.")}]}
# the client's per-stage parameters, max_tokens made small (a random model never stops early)
SAMPLING = [{"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4, "seed": 42,
             "detokenize": True, "repetition_penalty": 1.1},
            {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_tokens": 8, "seed": 42,
             "detokenize": True, "repetition_penalty": 1.05},
            {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 42,
             "detokenize": True, "repetition_penalty": 1.1}]


def video_query(url: str, num_frames: int | None = 16) -> dict:
    video: dict = {"url": url}
    if num_frames is not None:
        video["num_frames"] = num_frames
    return {"role": "user", "content": [
        {"type": "video_url", "video_url": video},
        {"type": "text", "text": "Describe the content of the video, then convert what the "
                                 "baby say into text."}]}


def data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def omni25(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni

    path = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni25_video"))
    # served under the Hub name the client sends, as `vllm serve Qwen/Qwen2.5-Omni-7B` is
    return start_server([str(path), "--omni", "--served-model-name", "Qwen/Qwen2.5-Omni-7B"])


@pytest.fixture(scope="module")
def local_http() -> Iterator[str]:
    """An http server on 127.0.0.1 serving the test video (a private address)."""
    body = mp4_with_audio()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/sample_demo_1.mp4"
    server.shutdown()


def read_like_the_client(completion, out: Path) -> tuple[list[str], int]:
    """The client's loop: audio choices saved as wav files, text choices printed."""
    texts, count = [], 0
    for choice in completion.choices:
        if choice.message.audio:
            audio = base64.b64decode(choice.message.audio.data)
            (out / f"audio_{count}.wav").write_bytes(audio)
            count += 1
        elif choice.message.content:
            texts.append(choice.message.content)
    return texts, count


@pytest.mark.parametrize("num_frames", [16, None])
def test_use_audio_in_video_query(omni25: Server, tmp_path: Path,
                                  num_frames: int | None) -> None:
    completion = omni25.openai().chat.completions.create(
        messages=[SYSTEM, video_query(data_url(mp4_with_audio(20, fps=10, audio_seconds=2.0)),
                                      num_frames)],
        model="Qwen/Qwen2.5-Omni-7B",
        extra_body={"sampling_params_list": SAMPLING,
                    "mm_processor_kwargs": {"use_audio_in_video": True}})
    texts, num_audio = read_like_the_client(completion, tmp_path)
    assert len(texts) == 1 and texts[0] and num_audio == 1       # vLLM-Omni's two choices
    assert (tmp_path / "audio_0.wav").read_bytes()[:4] == b"RIFF"
    # the interleaved prompt is longer than the video alone: the track's tokens are in it
    alone = omni25.openai().chat.completions.create(
        messages=[SYSTEM, video_query(data_url(mp4_with_audio(20, fps=10, audio_seconds=2.0)),
                                      num_frames)],
        model="Qwen/Qwen2.5-Omni-7B", modalities=["text"],
        extra_body={"sampling_params_list": SAMPLING})
    with_track = omni25.openai().chat.completions.create(
        messages=[SYSTEM, video_query(data_url(mp4_with_audio(20, fps=10, audio_seconds=2.0)),
                                      num_frames)],
        model="Qwen/Qwen2.5-Omni-7B", modalities=["text"],
        extra_body={"sampling_params_list": SAMPLING,
                    "mm_processor_kwargs": {"use_audio_in_video": True}})
    assert with_track.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_bad_num_frames_and_switch_values(omni25: Server) -> None:
    video = data_url(mp4_with_audio(4, audio_seconds=None))
    for query, extra, param in (
            (video_query(video, 100_000), {}, "messages[0].content[0].video_url.num_frames"),
            (video_query(video, 0), {}, "num_frames"),
            (video_query(video), {"mm_processor_kwargs": {"use_audio_in_video": "yes"}},
             "mm_processor_kwargs.use_audio_in_video")):
        r = omni25.post("/v1/chat/completions", json={"messages": [query], **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and param in error["param"]


def test_remote_media_on_where_vllm_omni_answers(omni25: Server, local_http: str,
                                                 start_server: Callable[..., Server],
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """--omni fetches http(s) media as vLLM does, still refusing a private address; a plain
    server refuses the URL and names the flag."""
    body = {"messages": [video_query(local_http)], "modalities": ["text"]}
    r = omni25.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_fetch_failed"
    assert "not a public address" in r.json()["error"]["message"]

    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni

    plain = start_server([str(build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("plain25")))])
    r = plain.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_not_allowed"
    message = r.json()["error"]["message"]
    assert "--allow-remote-media" in message and "--api-dialect vllm-omni" in message
    assert r.json()["error"]["param"] == "messages[0].content[0].video_url.url"


def test_qwen3_omni_takes_the_switch(omni_server: Server) -> None:
    """The tiny Qwen3-Omni: the track merged token by token (2 fps: whole time steps)."""
    video = data_url(mp4_with_audio(20, fps=10, audio_seconds=2.0))
    usage = []
    for extra in ({}, {"mm_processor_kwargs": {"use_audio_in_video": True}}):
        r = omni_server.post("/v1/chat/completions", json={
            "model": "tiny-omni", "messages": [video_query(video, None)],
            "modalities": ["text"], "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"]["prompt_tokens"])
    assert usage[1] > usage[0] + 20
