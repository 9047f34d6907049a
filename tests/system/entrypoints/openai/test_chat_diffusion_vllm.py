"""Diffusion through chat completions in vLLM-Omni's form (issue 40, items 1 and 2): the requests
its text_to_image / image_to_image clients send (raw HTTP with a literal `extra_body` object, no
`model`; the `openai` SDK with `extra_body`), read back as those clients read them (the
assistant message's `image_url` parts, data URLs decoded to PNGs of the asked size); bad input."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

import openai
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server


def _pngs(answer: dict) -> list[Image.Image]:
    """As vLLM-Omni's openai_chat_client.py reads them: every image_url part's data URL."""
    content = answer["choices"][0]["message"]["content"]
    out = []
    for part in content:
        assert part["type"] == "image_url"
        url = part["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        out.append(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    return out


def _user(text: str, image: bytes | None = None) -> list[dict]:
    if image is None:
        return [{"role": "user", "content": text}]
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_raw_http_with_an_extra_body_object_and_no_model(image_server: Server) -> None:
    body = {"messages": _user("a handwritten 7"),
            "extra_body": {"height": 48, "width": 32, "num_inference_steps": 4,
                           "guidance_scale": 1.0, "seed": 42,
                           "num_outputs_per_prompt": 2}}
    r = image_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    images = _pngs(r.json())
    assert len(images) == 2 and all(im.format == "PNG" and im.size == (32, 48)
                                    for im in images)
    again = image_server.post("/v1/chat/completions", json=body)     # the seed was used
    assert again.json()["choices"][0]["message"]["content"] == \
        r.json()["choices"][0]["message"]["content"]


def test_openai_sdk_extra_body_fields_at_the_top_level(image_server: Server) -> None:
    out = image_server.openai().chat.completions.create(
        model="omnistage-demo", messages=_user("a handwritten 2"),
        extra_body={"height": 40, "width": 24, "num_inference_steps": 3, "seed": 1,
                    "true_cfg_scale": 1.0, "flow_shift": 3.0})
    (image,) = _pngs(out.model_dump())
    assert image.size == (24, 40)


def test_edit_takes_the_user_messages_image(image_server: Server) -> None:
    buf = io.BytesIO()
    Image.new("L", (24, 40), 20).save(buf, format="PNG")
    body = {"messages": _user("a handwritten 7", buf.getvalue()),
            "extra_body": {"num_inference_steps": 4, "seed": 3}}
    r = image_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (image,) = _pngs(r.json())
    assert image.format == "PNG"


@pytest.mark.parametrize(("extra", "top", "param"), [
    ({"height": 32}, {"height": 32}, "height"),                   # given both ways
    ({"num_inference_steps": 0}, {}, "num_inference_steps"),      # out of range
    ({"width": "wide"}, {}, "width"),                             # not a number
    ({"num_outputs_per_prompt": 0}, {}, "num_images"),
])
def test_bad_values_are_400_naming_the_field(image_server: Server, extra: dict, top: dict,
                                             param: str) -> None:
    body = {"messages": _user("a 7"), "extra_body": extra, **top}
    r = image_server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error


def test_extra_body_must_be_an_object(image_server: Server) -> None:
    r = image_server.post("/v1/chat/completions",
                          json={"messages": _user("a 7"), "extra_body": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra_body"


def test_diffusion_fields_on_a_text_model_are_refused(text_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        text_server.openai().chat.completions.create(
            model=None, messages=_user("hi"), extra_body={"num_inference_steps": 4})  # type: ignore[arg-type]
    assert err.value.body["param"] == "num_inference_steps"
