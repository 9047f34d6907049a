"""The image routes' corners a client of OpenAI or vLLM-Omni meets: `response_format="url"`
through the official `openai` client (each URL downloaded as a client would: a plain GET,
without the API key), what the server accepted and ignored named in X-Omnistage-Ignored, and
Qwen-Image taking what diffusers (and vLLM-Omni) warn about and ignore, `guidance_scale` and
`true_cfg_scale` without a negative prompt, instead of refusing it."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

HEADER = "x-omnistage-ignored"
KEY = "sk-images"


def download(url: str) -> httpx.Response:
    """What a client does with an image URL: GET it, no headers of the API's."""
    return httpx.get(url, timeout=30)


def png_bytes(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (value, value, value)).save(buf, "PNG")
    return buf.getvalue()


def test_url_answers_download_as_the_b64_images(image_server: Server) -> None:
    client = image_server.openai()
    extra = {"seed": 11, "num_inference_steps": 4}
    urls = client.images.generate(prompt="a 3", n=2, response_format="url", extra_body=extra)
    inline = client.images.generate(prompt="a 3", n=2, response_format="b64_json",
                                    extra_body=extra)
    assert [d.b64_json for d in urls.data] == [None, None] and urls.size == inline.size
    for got, want in zip(urls.data, inline.data):
        assert got.url.startswith(f"{image_server.url}/v1/images/files/img_")
        r = download(got.url)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert r.content == base64.b64decode(want.b64_json)       # the same file
    assert urls.data[0].url != urls.data[1].url


def test_url_answers_for_edits_and_other_formats(image_server: Server) -> None:
    out = image_server.openai().images.edit(
        image=("in.png", png_bytes(200), "image/png"), prompt="a 5", response_format="url",
        extra_body={"seed": 1, "num_inference_steps": 3, "output_format": "jpeg"})
    (data,) = out.data
    r = download(data.url)
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(r.content)).format == "JPEG"


def test_an_unknown_image_url_is_404_in_openai_shape(image_server: Server) -> None:
    r = download(f"{image_server.url}/v1/images/files/img_{'0' * 32}")
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "image_not_found"


def test_image_urls_need_no_api_key(start_server: Callable[..., Server]) -> None:
    server = start_server([], api_key=KEY)
    assert httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "7"},
                      timeout=30).status_code == 401        # the API itself still needs it
    out = server.openai().images.generate(prompt="a 7", response_format="url",
                                          extra_body={"num_inference_steps": 2})
    r = download(out.data[0].url)
    assert r.status_code == 200 and r.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_ignored_fields_are_named_in_the_header(image_server: Server) -> None:
    r = image_server.post("/v1/images/generations", json={
        "prompt": "a 4", "quality": "hd", "user": "u-1", "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "quality, user"
    plain = image_server.post("/v1/images/generations",
                              json={"prompt": "a 4", "num_inference_steps": 2})
    assert plain.status_code == 200 and HEADER not in plain.headers


def test_vllm_chat_fields_ignored_are_named_in_the_header(image_server: Server) -> None:
    """vLLM-Omni's image chat client may send Wan's knobs; the demo model takes the rest."""
    r = image_server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a handwritten 2"}],
        "extra_body": {"num_inference_steps": 2, "seed": 3, "flow_shift": 3.0}})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "flow_shift"


# ---- Qwen-Image: warnings where diffusers warns -----------------------------------------------

@pytest.fixture(scope="module")
def qwen_image(start_server: Callable[..., Server],
               tmp_path_factory: pytest.TempPathFactory) -> Server:
    from tests.helpers.qwen_image import build_tiny_qwen_image_pipeline

    path: Path = build_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("qwen_image"))
    return start_server([str(path), "--served-model-name", "tiny-qwen-image"])


def generate(server: Server, **fields: object) -> np.ndarray:
    out = server.openai().images.generate(
        prompt="a photo of the sea shore", size="64x64",
        extra_body={"seed": 5, "num_inference_steps": 2, **fields})
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))


def test_qwen_image_ignores_what_diffusers_ignores(qwen_image: Server) -> None:
    plain = generate(qwen_image)
    # diffusers warns and draws without true CFG, without guidance embedding: so do we
    assert np.array_equal(generate(qwen_image, guidance_scale=3.5), plain)
    assert np.array_equal(generate(qwen_image, true_cfg_scale=4.0), plain)
    assert np.array_equal(generate(qwen_image, negative_prompt="blurry"), plain)
    guided = generate(qwen_image, true_cfg_scale=4.0, negative_prompt="blurry")
    assert not np.array_equal(guided, plain)                  # true CFG itself still works
    # (the chat route takes them too: vLLM-Omni's image client sends guidance_scale)
    r = qwen_image.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a photo of the sea shore"}],
        "extra_body": {"height": 64, "width": 64, "num_inference_steps": 2,
                       "guidance_scale": 4.0, "true_cfg_scale": 4.0, "seed": 5}})
    assert r.status_code == 200, r.text
    (part,) = r.json()["choices"][0]["message"]["content"]
    assert part["type"] == "image_url"


def test_what_qwen_image_ignores_is_named_in_the_header(qwen_image: Server) -> None:
    """The stage decides what Qwen-Image does not use (diffusers' warnings): its metrics carry
    the names back, and the answer's X-Omnistage-Ignored names them; a request using every
    field it sends names none."""
    body = {"prompt": "a photo of the sea shore", "size": "64x64", "seed": 5,
            "num_inference_steps": 2}
    r = qwen_image.post("/v1/images/generations", json={**body, "guidance_scale": 3.5,
                                                        "true_cfg_scale": 4.0})
    assert r.status_code == 200, r.text
    named = [n.strip() for n in r.headers["x-omnistage-ignored"].split(",")]
    assert sorted(named) == ["guidance_scale", "true_cfg_scale"]
    r = qwen_image.post("/v1/images/generations", json={**body, "true_cfg_scale": 4.0,
                                                        "negative_prompt": "blurry"})
    assert r.status_code == 200 and "x-omnistage-ignored" not in r.headers


# ---- LoRA: vLLM-Omni's per-request `lora` object ----------------------------------------------

def lora_file(path: Path) -> Path:
    """A random rank-2 adapter on the tiny Qwen-Image's first block (diffusers' layout)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name in ("to_q", "to_v", "to_out.0"):
        key = f"transformer.transformer_blocks.0.attn.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, 32, generator=g)
        tensors[f"{key}.lora_B.weight"] = torch.randn(32, 2, generator=g)
    save_file(tensors, str(path / "style.safetensors"))
    return path / "style.safetensors"


def test_lora_per_request_and_bad_adapters_named(qwen_image: Server, tmp_path: Path) -> None:
    file = lora_file(tmp_path)
    plain = generate(qwen_image)
    styled = generate(qwen_image, lora={"name": "style", "local_path": str(file), "scale": 1.0})
    assert np.abs(styled.astype(int) - plain.astype(int)).mean() > 1.0   # the adapter draws
    # loaded once: by name alone now (an extension: vLLM-Omni always sends the path too)
    assert np.array_equal(generate(qwen_image, lora={"lora_name": "style"}), styled)
    assert np.array_equal(generate(qwen_image), plain)          # the base is untouched
    body = {"prompt": "a photo of the sea shore", "size": "64x64", "num_inference_steps": 2}
    for lora, param in [({"name": "nope"}, "lora.name"),
                        ({"name": "x", "path": str(tmp_path / "none.safetensors")}, "lora.path"),
                        ({"path": str(file)}, "lora.name")]:
        r = qwen_image.post("/v1/images/generations", json={**body, "lora": lora})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    # the chat route takes the same object in extra_body (vLLM-Omni's online LoRA example)
    chat = {"messages": [{"role": "user", "content": "a photo of the sea shore"}],
            "extra_body": {"height": 64, "width": 64, "num_inference_steps": 2, "seed": 5,
                           "lora": {"lora_name": "style", "lora_path": str(file)}}}
    r = qwen_image.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    chat["extra_body"]["lora"] = {"name": "nope"}
    r = qwen_image.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora.name", r.text
    # the edit form takes it as JSON text (vLLM-Omni's form)
    form = {"prompt": "a photo of the sea shore", "size": "64x64", "num_inference_steps": "2"}
    files = {"image": ("in.png", png_bytes(90), "image/png")}
    for lora, status, param in [('{"name": "style"}', 200, None),
                                ('{"name": "nope"}', 400, "lora.name"),
                                ("[1]", 400, "lora")]:
        r = qwen_image.post("/v1/images/edits", data={**form, "lora": lora}, files=files)
        assert r.status_code == status, r.text
        assert param is None or r.json()["error"]["param"] == param, r.text
