"""The image routes end to end with the official `openai` client against a real server serving
the built-in demo model (handwritten digits)."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

DEMO = "omnistage-demo"


def _decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_generations_decode_as_png_and_seeds_repeat(image_server: Server) -> None:
    client = image_server.openai()
    kw = dict(prompt="a handwritten 7", n=2, response_format="b64_json",
              extra_body={"seed": 1234, "num_inference_steps": 6})
    first = client.images.generate(**kw)
    assert len(first.data) == 2
    images = [_decode(d.b64_json) for d in first.data]
    assert all(im.format == "PNG" and im.size == (64, 64) for im in images)
    # two images of one request differ; the same seed draws the same images again
    a, b = (np.asarray(im) for im in images)
    assert not np.array_equal(a, b)
    again = client.images.generate(**kw)
    assert [d.b64_json for d in again.data] == [d.b64_json for d in first.data]
    other = client.images.generate(**{**kw, "extra_body": {"seed": 99, "num_inference_steps": 6}})
    assert other.data[0].b64_json != first.data[0].b64_json


def test_generations_size_and_output_format(image_server: Server) -> None:
    out = image_server.openai().images.generate(
        prompt="seven", size="32x48", model=DEMO, extra_body={"output_format": "jpeg",
                                                              "num_inference_steps": 4})
    (data,) = out.data
    image = _decode(data.b64_json)
    assert image.format == "JPEG" and image.size == (32, 48)


def test_chat_with_an_image_model_answers_with_image_parts(image_server: Server) -> None:
    body = {"model": DEMO, "messages": [{"role": "user", "content": "draw a 3"}],
            "seed": 5, "sampling_params_list": [{"num_inference_steps": 5}]}
    r = image_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (part,) = r.json()["choices"][0]["message"]["content"]
    assert part["type"] == "image_url"
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert _decode(url.split(",", 1)[1]).size == (64, 64)
    # streamed: progress as SSE comments, then the image in a delta, then [DONE]
    with httpx.stream("POST", f"{image_server.url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line]
    assert any(line.startswith(": progress") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert any(url in line for line in lines)   # same seed, same image


def test_openai_client_chat_with_image_model(image_server: Server) -> None:
    out = image_server.openai().chat.completions.create(
        model=DEMO, messages=[{"role": "user", "content": "a handwritten 1"}],
        extra_body={"sampling_params_list": [{"num_inference_steps": 3, "num_images": 2}]})
    content = out.choices[0].message.content
    assert isinstance(content, list) and len(content) == 2


def _png_bytes(color: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (24, 40), color).save(buf, format="PNG")
    return buf.getvalue()


def test_edits_redraw_the_uploaded_image(image_server: Server) -> None:
    client = image_server.openai()

    def edit(color: int) -> str:
        out = client.images.edit(image=("in.png", _png_bytes(color), "image/png"),
                                 prompt="a handwritten 7",
                                 extra_body={"seed": 3, "strength": 0.5,
                                             "num_inference_steps": 4})
        (data,) = out.data
        assert _decode(data.b64_json).format == "PNG"
        return data.b64_json

    dark = edit(20)
    assert edit(20) == dark              # same image, same seed: the same answer
    assert edit(235) != dark             # the input image matters


def test_edits_take_a_list_of_images(image_server: Server) -> None:
    """`image=[...]` goes out as the form field `image[]`: one image in a list is the same
    edit; two are a 400 naming image (the demo model starts from one image: its stage says
    max_input_images 1)."""
    client = image_server.openai()
    kw = dict(prompt="a handwritten 7", extra_body={"seed": 3, "strength": 0.5,
                                                    "num_inference_steps": 4})
    single = client.images.edit(image=("in.png", _png_bytes(20), "image/png"), **kw)
    listed = client.images.edit(image=[("in.png", _png_bytes(20), "image/png")], **kw)
    assert listed.data[0].b64_json == single.data[0].b64_json
    with pytest.raises(openai.BadRequestError) as err:
        client.images.edit(image=[("a.png", _png_bytes(20), "image/png"),
                                  ("b.png", _png_bytes(235), "image/png")], **kw)
    assert err.value.body["param"] == "image"
    assert "at most 1 input image, got 2" in err.value.body["message"]


def test_openai_image_fields_are_accepted(image_server: Server) -> None:
    """quality, style, moderation: accepted, logged as ignored; background opaque is what the
    model draws, transparent a 400 naming background."""
    client = image_server.openai()
    kw = dict(prompt="a handwritten 4", extra_body={"seed": 8, "num_inference_steps": 3})
    plain = client.images.generate(**kw)
    styled = client.images.generate(**kw, quality="high", style="natural", moderation="low",
                                    background="opaque")
    assert styled.data[0].b64_json == plain.data[0].b64_json
    edited = client.images.edit(image=("in.png", _png_bytes(20), "image/png"),
                                prompt="a handwritten 4", quality="low", background="auto",
                                input_fidelity="high", extra_body={"num_inference_steps": 2})
    assert len(edited.data) == 1
    log = image_server.log.read_text()
    for name in ("quality", "style", "moderation", "input_fidelity"):
        assert f"{name}: accepted and ignored" in log, name
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(**kw, background="transparent")
    assert err.value.body["param"] == "background"


def test_chat_image_part_makes_an_image_to_image_request(image_server: Server) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png_bytes(20)).decode()
    content = [{"type": "text", "text": "a handwritten 7"},
               {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": DEMO, "seed": 3, "messages": [{"role": "user", "content": content}],
            "sampling_params_list": [{"strength": 0.5, "num_inference_steps": 4}]}
    r = image_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (part,) = r.json()["choices"][0]["message"]["content"]
    assert part["image_url"]["url"].startswith("data:image/png;base64,")


def test_image_model_refuses_text_routes_clearly(image_server: Server) -> None:
    client = image_server.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=DEMO, prompt="hello")
    assert err.value.body["code"] == "unsupported_endpoint"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "7"}],
                                       modalities=["text"])
    assert err.value.body["param"] == "modalities"
