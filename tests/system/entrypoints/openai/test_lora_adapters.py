"""LoRA adapters loaded and unloaded at run time on a served tiny Qwen-Image
(`--lora-modules`, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter), listed by
GET /v1/models and chosen by `model` or by a `lora` object naming them.

Golden by chain: an adapter chosen by name gives exactly what the same file given by path
under another name gives (the per-request path, itself golden against diffusers'
`load_lora_weights` in tests/golden/diffusion/test_lora_qwen_image.py), and visibly differs
from the base model; requests with different adapters sent together each get what they get
alone; unloading an adapter a running request uses lets that request finish as it would
have; bad input is a 4xx in OpenAI's shape and the server keeps serving."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-qwen-image"
BODY = {"prompt": "a photo of the sea shore", "size": "64x64", "seed": 5,
        "num_inference_steps": 2}


def adapter(path: Path, seed: int, width: int = 32) -> Path:
    """A random rank-2 adapter on the first block's attention (diffusers' layout)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in ("to_q", "to_v", "to_out.0"):
        key = f"transformer.transformer_blocks.0.attn.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, width, generator=g)
        tensors[f"{key}.lora_B.weight"] = torch.randn(32, 2, generator=g)
    file = path / f"lora_{seed}_{width}.safetensors"
    save_file(tensors, str(file))
    return file


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("loras")
    garbage = path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    return {"style": adapter(path, 0), "ink": adapter(path, 1), "wide": adapter(path, 2, 48),
            "garbage": garbage, "missing": path / "none.safetensors"}


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], files: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    from tests.helpers.qwen_image import build_tiny_qwen_image_pipeline

    path = build_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("qwen_image"))
    return start_server([str(path), "--served-model-name", MODEL,
                         "--lora-modules", f"style={files['style']}"])


def image(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    data = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data))).astype(int)


def generate(server: Server, **fields: object) -> np.ndarray:
    return image(server.post("/v1/images/generations", json={**BODY, **fields}))


def refused(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


def load(server: Server, name: str, path: Path) -> httpx.Response:
    return server.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                      "lora_path": str(path)})


def test_load_generate_list_unload(server: Server, files: dict[str, Path]) -> None:
    plain = generate(server)
    by_path = generate(server, lora={"name": "ref-style", "local_path": str(files["style"])})
    assert np.abs(by_path - plain).mean() > 1.0                  # the adapter draws
    # --lora-modules' adapter, chosen by `model` (vLLM) and by a lora object's name alone
    assert np.array_equal(generate(server, model="style"), by_path)
    assert np.array_equal(generate(server, lora={"lora_name": "style"}), by_path)
    # one loaded at run time
    r = load(server, "ink", files["ink"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ink' added successfully."
    ink = generate(server, model="ink")
    assert np.array_equal(ink, generate(server, lora={"name": "ref-ink",
                                                      "path": str(files["ink"])}))
    assert np.abs(ink - by_path).mean() > 1.0                   # not the other adapter
    assert np.array_equal(generate(server), plain)             # the base untouched
    cards = {c["id"]: c for c in server.get("/v1/models").json()["data"]}
    assert list(cards) == [MODEL, "style", "ink"]
    assert (cards["ink"]["parent"], cards["ink"]["root"]) == (MODEL, str(files["ink"]))
    assert server.get("/v1/models/ink").json()["root"] == str(files["ink"])
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "ink"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ink' removed successfully."
    refused(server.post("/v1/images/generations", json={**BODY, "model": "ink"}), 404, "model")
    refused(server.post("/v1/images/generations", json={**BODY, "lora": {"name": "ink"}}),
            400, "lora.name")
    assert [c["id"] for c in server.get("/v1/models").json()["data"]] == [MODEL, "style"]
    refused(server.get("/v1/models/ink"), 404, "model")


def test_chat_and_edits_choose_by_model(server: Server) -> None:
    chat = {"model": "style", "messages": [{"role": "user", "content": BODY["prompt"]}],
            "extra_body": {"height": 64, "width": 64, "num_inference_steps": 2, "seed": 5}}
    r = server.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    url = r.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))).astype(int)
    assert np.array_equal(got, generate(server, model="style"))
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 90, 90)).save(buf, "PNG")
    form = {"prompt": BODY["prompt"], "size": "64x64", "num_inference_steps": "2", "seed": "5"}
    edits = [image(server.post("/v1/images/edits", data={**form, **extra},
                               files={"image": ("in.png", buf.getvalue(), "image/png")}))
             for extra in ({"model": "style"}, {"lora": '{"name": "style"}'}, {})]
    assert np.array_equal(edits[0], edits[1]) and not np.array_equal(edits[0], edits[2])


def test_different_adapters_sent_together_each_get_their_own(server: Server,
                                                             files: dict[str, Path]) -> None:
    assert load(server, "ink2", files["ink"]).status_code == 200
    jobs = [{"model": "style"}, {"lora": {"name": "ink2", "scale": 0.5}}, {},
            {"model": "ink2", "seed": 9}, {"lora": {"name": "style", "scale": -1.0}}]
    alone = [generate(server, **job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: generate(server, **job), jobs * 2))
    for i, got in enumerate(together):
        assert np.array_equal(got, alone[i % len(jobs)]), jobs[i % len(jobs)]


def test_unloading_an_adapter_in_use_lets_its_request_finish(server: Server,
                                                             files: dict[str, Path]) -> None:
    assert load(server, "busy", files["ink"]).status_code == 200
    body = {**BODY, "num_inference_steps": 200, "size": "256x256"}   # seconds on a CPU
    start = time.monotonic()
    reference = generate(server, **body, lora={"name": "ref-busy", "path": str(files["ink"])})
    alone_s = time.monotonic() - start
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: generate(server, **body, model="busy"))
        time.sleep(alone_s / 4)
        r = server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        unloaded_first = not running.done()
        assert r.status_code == 200, r.text
        refused(server.post("/v1/images/generations", json={**BODY, "model": "busy"}),
                404, "model")
        # the name loaded again from another file, used while the first request still runs
        assert load(server, "busy", files["style"]).status_code == 200
        assert np.array_equal(generate(server, model="busy"), generate(server, model="style"))
        assert np.array_equal(running.result(timeout=120), reference)
    assert unloaded_first, f"the request ({alone_s:.2f} s alone) ended before the unload"


def test_bad_input_is_refused_and_the_server_keeps_serving(server: Server,
                                                           files: dict[str, Path]) -> None:
    message = refused(load(server, "style", files["ink"]), 400, "lora_name")
    assert message == "The lora adapter 'style' has already been loaded."
    message = refused(load(server, "x", files["missing"]), 404, "lora_path")
    assert message == f"Loading lora x failed: No adapter found for {files['missing']}"
    refused(load(server, "x", files["garbage"]), 400, "lora_path")
    refused(server.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    message = refused(server.post("/v1/unload_lora_adapter", json={"lora_name": "never"}),
                      404, "lora_name")
    assert message == "The lora adapter 'never' cannot be found."
    refused(server.post("/v1/images/generations", json={**BODY, "model": "nope"}), 404, "model")
    refused(server.post("/v1/images/generations", json={**BODY, "lora": {"name": "nope"}}),
            400, "lora.name")
    refused(server.post("/v1/images/generations", json={           # per request as well
        **BODY, "lora": {"name": "g", "path": str(files["garbage"])}}), 400, "lora.path")
    refused(server.post("/v1/images/generations", json={
        **BODY, "model": "style", "lora": {"name": "other"}}), 400, "lora.name")
    # a LoRA file of another model's widths: loads (no model here to check it against), and
    # the first request that uses it is refused naming its path
    assert load(server, "wide", files["wide"]).status_code == 200
    refused(server.post("/v1/images/generations", json={**BODY, "model": "wide"}),
            400, "lora.path")
    assert server.get("/health").status_code == 200
    assert generate(server, model="style").shape == (64, 64, 3)


def test_a_bad_lora_module_stops_the_start(start_server: Callable[..., Server],
                                           files: dict[str, Path], tmp_path: Path) -> None:
    from tests.helpers.qwen_image import build_tiny_qwen_image_pipeline

    path = build_tiny_qwen_image_pipeline(tmp_path / "qwen_image")
    with pytest.raises(RuntimeError, match="server exited") as err:
        start_server([str(path), "--lora-modules", f"bad={files['garbage']}"])
    assert "--lora-modules bad=" in str(err.value) and "not a safetensors file" in str(err.value)
