"""A table of bad requests: each gets the right 4xx and OpenAI's error JSON naming the field,
never a 500, and both servers are healthy and serving after all of them."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

CHAT = "tiny-chat"
DEMO = "omnistage-demo"
USER = [{"role": "user", "content": "hello"}]


def _png(size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (10, 200, 10)).save(buf, format="PNG")
    return buf.getvalue()


PNG_URL = "data:image/png;base64," + base64.b64encode(_png()).decode()
# a chat body as raw bytes, for what a JSON encoder will not write (NaN, lone surrogates)
RAW = b'{"model":"tiny-chat","messages":[{"role":"user","content":"hello"}]}'
JSON = {"content-type": "application/json"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": CHAT, "messages": USER, **fields}


def image_part(url: str, model: str = CHAT) -> dict[str, Any]:
    return chat(model=model, messages=[{"role": "user", "content": [
        {"type": "text", "text": "draw a 3 like this"},
        {"type": "image_url", "image_url": {"url": url}}]}])


def demo_image(url: str) -> dict[str, Any]:
    """An image part sent to the demo image model, which takes one (the text model refuses
    media parts before fetching them)."""
    return image_part(url, DEMO)


# (id, server, method, path, request kwargs, status, param or None, code or None)
# "{media}" in a string is replaced by the servers' allowed media folder. The text model
# refuses media parts before fetching them; what fetching and decoding refuse is asked of
# the image model (audio and video: test_media.py).
CASES: list[tuple[str, str, str, str, dict, int, str | None, str | None]] = [
    ("not-json", "text", "POST", "/v1/chat/completions",
     {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, None,
     "invalid_json"),
    ("array-body", "text", "POST", "/v1/chat/completions", {"json": [1, 2]}, 400, None,
     "invalid_body"),
    # chat completions take no `model` as the served one (vLLM-Omni's clients omit it)
    ("no-model", "text", "POST", "/v1/completions", {"json": {"prompt": "hi"}}, 400,
     "model", None),
    ("no-messages", "text", "POST", "/v1/chat/completions", {"json": {"model": CHAT}}, 400,
     "messages", None),
    ("empty-messages", "text", "POST", "/v1/chat/completions", {"json": chat(messages=[])},
     400, "messages", None),
    ("bad-role", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "robot", "content": "x"}])}, 400, "messages[0].role",
     None),
    ("content-number", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "user", "content": 5}])}, 400, "messages[0].content",
     None),
    ("unknown-part", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}])}, 400,
     "messages[0].content[0]", None),
    ("unknown-field", "text", "POST", "/v1/chat/completions", {"json": chat(foo=1)}, 400,
     "foo", None),
    ("temperature-negative", "text", "POST", "/v1/chat/completions",
     {"json": chat(temperature=-1)}, 400, "temperature", None),
    ("temperature-string", "text", "POST", "/v1/chat/completions",
     {"json": chat(temperature="hot")}, 400, "temperature", None),
    ("top-p-zero", "text", "POST", "/v1/chat/completions", {"json": chat(top_p=0)}, 400,
     "top_p", None),
    ("max-tokens-zero", "text", "POST", "/v1/chat/completions", {"json": chat(max_tokens=0)},
     400, "max_tokens", None),
    ("n-zero", "text", "POST", "/v1/chat/completions", {"json": chat(n=0)}, 400, "n", None),
    ("presence-penalty", "text", "POST", "/v1/chat/completions",
     {"json": chat(presence_penalty=3)}, 400, "presence_penalty", None),
    ("seed-negative", "text", "POST", "/v1/chat/completions", {"json": chat(seed=-1)}, 400,
     "seed", None),
    ("min-over-max", "text", "POST", "/v1/chat/completions",
     {"json": chat(max_tokens=2, min_tokens=5)}, 400, "min_tokens", None),
    ("empty-stop", "text", "POST", "/v1/chat/completions", {"json": chat(stop=[""])}, 400,
     "stop", None),
    ("top-logprobs-alone", "text", "POST", "/v1/chat/completions",
     {"json": chat(top_logprobs=2)}, 400, "top_logprobs", None),
    ("stream-options-alone", "text", "POST", "/v1/chat/completions",
     {"json": chat(stream_options={"include_usage": True})}, 400, "stream_options", None),
    ("tools", "text", "POST", "/v1/chat/completions",
     {"json": chat(tools=[{"type": "function", "function": {"name": "f"}}])}, 400, "tools",
     None),
    ("logit-bias", "text", "POST", "/v1/chat/completions", {"json": chat(logit_bias={"5": 1})},
     400, "logit_bias", None),
    ("audio-modality", "text", "POST", "/v1/chat/completions",
     {"json": chat(modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})},
     400, "modalities", "unsupported_modality"),
    ("audio-format", "text", "POST", "/v1/chat/completions",
     {"json": chat(audio={"voice": "ethan", "format": "aiff"})}, 400, "audio.format", None),
    ("spl-length", "text", "POST", "/v1/chat/completions",
     {"json": chat(sampling_params_list=[{}, {}])}, 400, "sampling_params_list", None),
    ("spl-unknown-key", "text", "POST", "/v1/chat/completions",
     {"json": chat(sampling_params_list=[{"temperatur": 1}])}, 400,
     "sampling_params_list[0].temperatur", None),
    ("spl-bad-value", "text", "POST", "/v1/chat/completions",
     {"json": chat(sampling_params_list=[{"top_p": 5}])}, 400, "sampling_params_list[0].top_p",
     None),
    ("spl-graph-field", "text", "POST", "/v1/chat/completions",
     {"json": chat(sampling_params_list=[{"output_hidden_layers": [1]}])}, 400,
     "sampling_params_list[0].output_hidden_layers", None),
    ("mm-audio-in-video", "text", "POST", "/v1/chat/completions",
     {"json": chat(mm_processor_kwargs={"use_audio_in_video": "yes"})}, 400,
     "mm_processor_kwargs.use_audio_in_video", None),
    ("mm-unknown-key", "text", "POST", "/v1/chat/completions",
     {"json": chat(mm_processor_kwargs={"fps": 2})}, 400, "mm_processor_kwargs.fps", None),
    ("template-kwargs", "text", "POST", "/v1/chat/completions",
     {"json": chat(chat_template_kwargs={"tokenize": True})}, 400,
     "chat_template_kwargs.tokenize", None),
    ("image-bad-base64", "image", "POST", "/v1/chat/completions",
     {"json": demo_image("data:image/png;base64,@@@@")}, 400,
     "messages[0].content[1].image_url.url", "invalid_base64"),
    ("image-not-image", "image", "POST", "/v1/chat/completions",
     {"json": demo_image("data:image/png;base64,AAAA")}, 400,
     "messages[0].content[1].image_url.url", "invalid_image"),
    ("image-no-base64", "image", "POST", "/v1/chat/completions",
     {"json": demo_image("data:image/png,raw")}, 400, "messages[0].content[1].image_url.url",
     "invalid_media_url"),
    ("image-file-outside", "image", "POST", "/v1/chat/completions",
     {"json": demo_image("file:///etc/hostname")}, 400, "messages[0].content[1].image_url.url",
     "media_not_allowed"),
    ("image-file-missing", "image", "POST", "/v1/chat/completions",
     {"json": demo_image("file://{media}/nope.png")}, 400,
     "messages[0].content[1].image_url.url", "media_not_found"),
    ("image-remote", "image", "POST", "/v1/chat/completions",
     {"json": demo_image("https://example.com/cat.png")}, 400,
     "messages[0].content[1].image_url.url", "media_not_allowed"),
    ("image-text-model", "text", "POST", "/v1/chat/completions",
     {"json": image_part(PNG_URL)}, 400, "messages[0].content[1]", "unsupported_input"),
    ("image-file-allowed-text-model", "text", "POST", "/v1/chat/completions",
     {"json": image_part("file://{media}/green.png")}, 400, "messages[0].content[1]",
     "unsupported_input"),
    ("audio-bad-data", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {
         "data": base64.b64encode(b"not audio").decode(), "format": "wav"}}]}])}, 400,
     "messages[0].content[0]", "unsupported_input"),
    ("audio-url-bad-data", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {
         "url": "data:audio/wav;base64," + base64.b64encode(b"not audio").decode()}}]}])}, 400,
     "messages[0].content[0]", "unsupported_input"),
    ("audio-url-remote", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {
         "url": "https://example.com/a.wav"}}]}])}, 400,
     "messages[0].content[0]", "unsupported_input"),
    ("functions", "text", "POST", "/v1/chat/completions",
     {"json": chat(functions=[{"name": "f"}])}, 400, "functions", None),
    ("reasoning-effort-bad", "text", "POST", "/v1/chat/completions",
     {"json": chat(reasoning_effort="extreme")}, 400, "reasoning_effort", None),
    ("spl-vllm-only-key", "text", "POST", "/v1/chat/completions",
     {"json": chat(sampling_params_list=[{"prompt_logprobs": 1, "detokenize": False}])}, 400,
     "sampling_params_list[0].prompt_logprobs", None),
    ("wrong-model", "text", "POST", "/v1/chat/completions", {"json": chat(model="gpt-4o")},
     404, "model", "model_not_found"),
    ("no-key", "text", "POST", "/v1/chat/completions",
     {"json": chat(), "headers": {"Authorization": ""}}, 401, None, "invalid_api_key"),
    ("too-large", "text", "POST", "/v1/chat/completions",
     {"json": chat(messages=[{"role": "user", "content": "x" * (2 << 20)}])}, 413, None,
     "request_too_large"),
    ("no-route", "text", "GET", "/v1/nothing-here", {}, 404, None, None),
    ("wrong-method", "text", "GET", "/v1/chat/completions", {}, 405, None, None),
    ("unknown-model-card", "text", "GET", "/v1/models/gpt-4o", {}, 404, "model",
     "model_not_found"),
    ("prompt-empty-list", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": []}}, 400, "prompt", None),
    ("prompt-out-of-vocab", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": [10**6]}}, 400, "prompt", None),
    ("prompt-too-long", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": [5] * 600}}, 400, "prompt", None),
    ("prompt-batch-bad-item", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": [[5, 6], [10**6]]}}, 400, "prompt[1]", None),
    ("suffix", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": "a", "suffix": "b"}}, 400, "suffix", None),
    ("best-of", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": "a", "best_of": 3}}, 400, "best_of", None),
    ("echo-logprobs", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": "a", "echo": True, "logprobs": 1}}, 400, "echo", None),
    ("images-on-text-model", "text", "POST", "/v1/images/generations",
     {"json": {"prompt": "a 7"}}, 400, "model", "unsupported_endpoint"),
    ("size-banana", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "a 7", "size": "banana"}}, 400, "size", None),
    ("size-not-multiple", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "a 7", "size": "65x65"}}, 400, "size", "invalid_input"),
    ("prompt-no-digit", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "a cat"}}, 400, "prompt", "invalid_input"),
    ("prompt-empty", "image", "POST", "/v1/images/generations", {"json": {"prompt": ""}}, 400,
     "prompt", None),
    ("n-eleven", "image", "POST", "/v1/images/generations", {"json": {"prompt": "7", "n": 11}},
     400, "n", None),
    ("format-file", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "response_format": "file"}}, 400, "response_format", None),
    ("format-gif", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "output_format": "gif"}}, 400, "output_format", None),
    ("background-transparent", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "background": "transparent"}}, 400, "background", None),
    ("images-stream", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "stream": True}}, 400, "stream", None),
    ("images-unknown-field", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "colour": "red"}}, 400, "colour", None),
    ("quality-bad", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "quality": "ultra"}}, 400, "quality", None),
    ("steps-zero", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "num_inference_steps": 0}}, 400, "num_inference_steps", None),
    ("negative-prompt-demo", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "7", "negative_prompt": "blurry"}}, 400, None, "invalid_input"),
    ("edit-no-image", "image", "POST", "/v1/images/edits", {"data": {"prompt": "7"}}, 400,
     "image", None),
    ("edit-not-image", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7"}, "files": {"image": ("a.png", b"GIF89", "image/png")}}, 400,
     "image", "invalid_image"),
    ("edit-bad-n", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7", "n": "many"}, "files": {"image": ("a.png", _png(), "image/png")}},
     400, "n", None),
    ("edit-mask", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7"}, "files": [("image", ("a.png", _png(), "image/png")),
                                         ("mask", ("m.png", _png(), "image/png"))]}, 400,
     "mask", None),
    ("edit-two-images", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7"}, "files": [("image", ("a.png", _png(), "image/png")),
                                         ("image", ("b.png", _png(), "image/png"))]}, 400,
     "image", None),
    ("edit-two-listed-images", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7"}, "files": [("image[]", ("a.png", _png(), "image/png")),
                                         ("image[]", ("b.png", _png(), "image/png"))]}, 400,
     "image", None),
    ("edit-image-as-text", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7", "image": "a.png"}}, 400, "image", None),
    ("edit-unknown-field", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7", "colour": "red"},
      "files": {"image": ("a.png", _png(), "image/png")}}, 400, "colour", None),
    ("edit-style", "image", "POST", "/v1/images/edits",      # a field of generations only
     {"data": {"prompt": "7", "style": "vivid"},
      "files": {"image": ("a.png", _png(), "image/png")}}, 400, "style", None),
    ("edit-no-prompt", "image", "POST", "/v1/images/edits",
     {"files": {"image": ("a.png", _png(), "image/png")}}, 400, "prompt", None),
    ("edit-wrong-model", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7", "model": "dall-e-2"},
      "files": {"image": ("a.png", _png(), "image/png")}}, 404, "model", "model_not_found"),
    ("edit-strength", "image", "POST", "/v1/images/edits",
     {"data": {"prompt": "7", "strength": "2"},
      "files": {"image": ("a.png", _png(), "image/png")}}, 400, "strength", None),
    ("strength-without-image", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": USER,
               "sampling_params_list": [{"strength": 0.5}]}}, 400,
     "sampling_params_list[0].strength", None),
    ("chat-image-audio-part", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": [{"role": "user", "content": [
         {"type": "text", "text": "a 7"}, {"type": "input_audio", "input_audio": {
             "data": "", "format": "wav"}}]}]}}, 400,
     "messages[0].content[1].input_audio.data", None),
    ("chat-image-temperature", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": USER, "temperature": 0.5}}, 400,
     "temperature", None),
    ("chat-image-no-user-text", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": [{"role": "system", "content": "7"}]}},
     400, "messages", None),
    ("chat-image-no-digit", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": [{"role": "user", "content": "a cat"}]}},
     400, "messages", "invalid_input"),
    ("chat-image-stream-no-digit", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "stream": True,
               "messages": [{"role": "user", "content": "a cat"}]}},
     400, "messages", "invalid_input"),
    ("chat-image-stream-bad-spl", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": USER, "stream": True,
               "sampling_params_list": [{"num_inference_steps": 0}]}}, 400,
     "sampling_params_list[0].num_inference_steps", None),
    # one JSON policy (json_body.py): no NaN / Infinity, ints within 64 bits, finite floats,
    # no lone surrogates, named where they sit; no numeric strings (strict request models)
    *[(f"int-2**64-{field}", "text", "POST", "/v1/chat/completions", {"json": chat(**{
        field: [2**64] if field == "stop_token_ids" else 2**64})}, 400,
       f"{field}[0]" if field == "stop_token_ids" else field, None)
      for field in ("max_tokens", "top_k", "stop_token_ids", "min_tokens", "seed", "n")],
    ("int-2**64-completions-prompt", "text", "POST", "/v1/completions",
     {"json": {"model": CHAT, "prompt": [5, 2**64]}}, 400, "prompt[1]", None),
    ("nan-literal", "text", "POST", "/v1/chat/completions", {"content": RAW.replace(
        b"}]}", b"}],\"temperature\":NaN}"), "headers": JSON}, 400, None, "invalid_json"),
    ("infinity-literal", "image", "POST", "/v1/images/generations",
     {"content": b'{"prompt":"7","guidance_scale":Infinity}', "headers": JSON}, 400, None,
     "invalid_json"),
    ("float-overflow", "text", "POST", "/v1/chat/completions", {"content": RAW.replace(
        b"}]}", b"}],\"top_p\":1e999}"), "headers": JSON}, 400, "top_p", None),
    ("surrogate-content", "text", "POST", "/v1/chat/completions",
     {"content": RAW.replace(b"hello", b"\\ud800"), "headers": JSON}, 400,
     "messages[0].content", None),
    ("surrogate-model", "text", "POST", "/v1/chat/completions",
     {"content": RAW.replace(CHAT.encode(), b"\\udfff"), "headers": JSON}, 400, "model",
     None),
    ("numeric-string", "text", "POST", "/v1/chat/completions",
     {"json": chat(temperature="0.5")}, 400, "temperature", None),
    ("bool-as-int", "text", "POST", "/v1/chat/completions", {"json": chat(max_tokens=True)},
     400, "max_tokens", None),
    ("guidance-1e39", "image", "POST", "/v1/images/generations",
     {"json": {"prompt": "a 7", "guidance_scale": 1e39}}, 400, "guidance_scale", None),
    # the top-level limits hold in the per-stage overrides too (one validation path)
    *[(f"spl-limit-{case}", "text", "POST", "/v1/chat/completions",
       {"json": chat(sampling_params_list=[{name: value}])}, 400,
       f"sampling_params_list[0].{name}", None)
      for case, name, value in (
          ("stop-count", "stop", ["x"] * 10_000), ("stop-length", "stop", "y" * 5000),
          ("logprobs", "logprobs", 21), ("max-tokens", "max_tokens", 2**40),
          ("temperature", "temperature", 5.0), ("n", "n", 1000), ("top-k", "top_k", 2**63 - 1),
          ("stop-token-ids", "stop_token_ids", list(range(10_000))))],
    ("spl-limit-guidance", "image", "POST", "/v1/chat/completions",
     {"json": {"model": "omnistage-demo", "messages": [{"role": "user", "content": "a 7"}],
               "sampling_params_list": [{"guidance_scale": 1e39}]}}, 400,
     "sampling_params_list[0].guidance_scale", None),
]


def _fill(value: Any, media: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{media}", str(media))
    if isinstance(value, dict):
        return {k: _fill(v, media) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, media) for v in value]
    return value


@pytest.fixture(scope="module")
def media(media_dir: Path) -> Path:
    (media_dir / "green.png").write_bytes(_png())
    return media_dir


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_4xx_and_error_json(case: tuple, servers: dict[str, Server],
                                                 media: Path) -> None:
    _, which, method, path, kwargs, status, param, code = case
    server = servers[which]
    kwargs = _fill(kwargs, media)
    r = server.post(path, **kwargs) if method == "POST" else server.get(path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_servers_are_healthy_after_the_bad_requests(servers: dict[str, Server]) -> None:
    assert len(CASES) >= 30
    for server in servers.values():
        assert server.get("/health").status_code == 200
    text = servers["text"].openai().chat.completions.create(model=CHAT, messages=USER,
                                                            max_tokens=3)
    assert text.choices[0].finish_reason in ("stop", "length")
    image = servers["image"].openai().images.generate(prompt="a 2",
                                                      extra_body={"num_inference_steps": 2})
    assert len(image.data) == 1
    m = servers["text"].metrics()
    assert not any(name == "omnistage_http_requests_total" and dict(labels)["status"] == "500"
                   for name, labels in m)
