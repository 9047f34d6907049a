"""GLM-Image end to end through `Omni` on a tiny random diffusers folder, float32: its default
graph (AR stage -> tensors -> DiT stage) draws the image diffusers' GlmImagePipeline draws
(within 2/255; the reference samples its AR model with top_k=1, greedy), for text-to-image
and for edits with one or two condition images, alone or batched with a text-to-image
request; the AR stage's prompt equals GlmImageProcessor's; bad sizes are refused by name;
the image routes' fields reach the stages that take them, and /v1/images/edits serves an
edit and answers bad ones with 400s."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.models.glm_image import target_grids
from omnistage.testing.diffusion import png
from omnistage.testing.tiny_glm_image import build_tiny_glm_image, split_condition_features

diffusers = pytest.importorskip("diffusers")

H, W = 64, 96                   # a 2x3 AR token grid, a 13x19 preview before it
PROMPT = 'a red cat on the sign that reads "OPEN"'
EDIT = "the cat on a mat"
EDIT_H, EDIT_W = 64, 64         # an edit's output: a 2x2 target grid
CONDITION = png(96, 64, seed=1)     # a 2x3 token grid, the DiT's 4x6 patches
PAIR = (png(64, 64, seed=2), png(64, 64, seed=3))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, diffusers.GlmImagePipeline]:
    path = tmp_path_factory.mktemp("glm_image")
    ref = build_tiny_glm_image(path)
    ref.set_progress_bar_config(disable=True)
    split_condition_features(ref)
    return path, ref


@pytest.fixture(scope="module")
def omni(folder: tuple[Path, diffusers.GlmImagePipeline]) -> Iterator[Omni]:
    with Omni(str(folder[0]), device="cpu", backend="inproc", connector="inproc") as omni:
        yield omni


def test_text_to_image_equals_diffusers(folder: tuple[Path, diffusers.GlmImagePipeline],
                                        omni: Omni) -> None:
    _, ref = folder
    image = ref(PROMPT, height=H, width=W, num_inference_steps=2, guidance_scale=1.5,
                generator=torch.Generator().manual_seed(3)).images[0]
    expected = np.asarray(image, dtype=np.int16)                   # uint8 as ours, (H, W, 3)
    assert expected.std() > 10
    (out,) = omni.generate(PROMPT, DiffusionParams(height=H, width=W, num_inference_steps=2,
                                                   guidance_scale=1.5, seed=3))
    assert out.error is None, out.error
    got = np.asarray(out.images[0], dtype=np.int16)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 2
    ar = omni.engine.orchestrator.stage_info["ar"]
    assert ar.text_prompt and ar.max_input_images == 4
    for params, message in ((DiffusionParams(height=H + 16, width=W), "multiple of 32"),
                            (DiffusionParams(), "height / width")):
        (bad,) = omni.generate(PROMPT, params)
        assert bad.finish_reason == "error" and message in str(bad.error), bad.error


def test_prompt_equals_the_processor(folder: tuple[Path, diffusers.GlmImagePipeline]) -> None:
    """The AR stage's prompt ids and max_tokens are GlmImageProcessor's and the pipeline's."""
    from omnistage.configs.schema import ARSettings, KVCacheConfig, StageConfig
    from omnistage.stages.glm_image import GlmImageARStage

    path, ref = folder
    settings = ARSettings(enforce_eager=True, kv_cache=KVCacheConfig(num_blocks=8))
    stage = GlmImageARStage(StageConfig("ar", "ar", component="glm_image_ar", ar=settings),
                            str(path), "cpu")
    messages = [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]]
    inputs = ref.processor.apply_chat_template(messages, tokenize=True, target_h=H, target_w=W,
                                               return_dict=True, return_tensors="pt")
    target, preview = target_grids(H, W)
    assert inputs["image_grid_thw"].tolist() == [[1, *target], [1, *preview]]
    assert stage.prompt_token_ids(PROMPT, [target, preview]) == inputs["input_ids"][0].tolist()

    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in PAIR]
    messages = [[{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                              {"type": "text", "text": EDIT}]}]]
    inputs = ref.processor.apply_chat_template(messages, tokenize=True, target_h=EDIT_H,
                                               target_w=EDIT_W, return_dict=True,
                                               return_tensors="pt")
    vle = ref.vision_language_encoder
    feats = vle.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"][:2])
    ids = inputs["input_ids"][0]
    ids[ids == vle.config.image_token_id] = vle.get_image_tokens(feats.pooler_output)
    expected, _ = vle.model.get_rope_index(ids[None], inputs["image_grid_thw"],
                                           inputs["images_per_sample"])
    got, cache_ids, mm, cond = stage.edit_prompt(EDIT, images, target_grids(EDIT_H, EDIT_W)[0])
    assert got == ids.tolist() and torch.equal(mm.positions, expected[:, 0])
    marks = [i for i, (a, b) in enumerate(zip(got, cache_ids)) if a != b]
    assert [got[i] for i in marks] == [vle.config.image_start_token_id] * 2
    assert [cache_ids[i] for i in marks] == [-1 - (2 << 20 | 2)] * 2    # both 2x2 grids
    assert torch.equal(mm.decode_positions[:, :3], vle.model._cached_decode_position_ids[0, :, :3])
    assert cond.grids.tolist() == inputs["image_grid_thw"][:2, 1:].tolist()


def test_image_routes_size_the_ar_stage(folder: tuple[Path, diffusers.GlmImagePipeline]) -> None:
    """/v1/images/generations' fields go to the DiT stage; the AR entry stage samples with its
    own defaults (the AR model's generation config) and reads the size from the DiT's params."""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.engine.request import RequestFields, build_request

    path, _ = folder
    graph = resolve_graph(str(path), path, None)
    assert [s.component for s in graph.stages] == ["glm_image_ar", "glm_image"]
    fields = RequestFields({"num_images": 1, "height": H, "width": W}, image_fields=True)
    ar, dit = build_request(graph, ["ar"], "a prompt", fields).params
    assert ar is None and (dit.height, dit.width) == (H, W)


def reference_edit(ref: diffusers.GlmImagePipeline, files: tuple[bytes, ...], seed: int
                   ) -> np.ndarray:
    """diffusers' edit of EDIT_H x EDIT_W from `files`, uint8 (H, W, 3)."""
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    image = ref(EDIT, image=images, height=EDIT_H, width=EDIT_W, num_inference_steps=2,
                guidance_scale=1.5, generator=torch.Generator().manual_seed(seed)).images[0]
    return np.asarray(image, dtype=np.int16)


def edit_params(files: tuple[bytes, ...], seed: int) -> DiffusionParams:
    return DiffusionParams(height=EDIT_H, width=EDIT_W, num_inference_steps=2,
                           guidance_scale=1.5, seed=seed, image=files[0],
                           extra_images=files[1:])


def test_edits_equal_diffusers_alone_and_batched(folder: tuple[Path, diffusers.GlmImagePipeline],
                                                 omni: Omni) -> None:
    """One and two condition images, as diffusers draws them; an edit and a text-to-image
    request submitted together, each as it is alone."""
    _, ref = folder
    one, two = reference_edit(ref, (CONDITION,), 3), reference_edit(ref, PAIR, 4)
    t2i = np.asarray(ref(EDIT, height=EDIT_H, width=EDIT_W, num_inference_steps=2,
                         guidance_scale=1.5, generator=torch.Generator().manual_seed(5)
                         ).images[0], dtype=np.int16)
    assert one.std() > 10 and two.std() > 10 and np.abs(one - t2i).max() > 30
    (got_two,) = omni.generate(EDIT, edit_params(PAIR, 4))
    assert got_two.error is None, got_two.error
    assert np.abs(np.asarray(got_two.images[0], dtype=np.int16) - two).max() <= 2

    async def both() -> list:
        async def last(params: DiffusionParams) -> object:
            async for out in omni.engine.generate(EDIT, [None, params]):
                pass
            return out
        return await asyncio.gather(last(edit_params((CONDITION,), 3)), last(DiffusionParams(
            height=EDIT_H, width=EDIT_W, num_inference_steps=2, guidance_scale=1.5, seed=5)))

    for out, expected in zip(asyncio.run(both()), (one, t2i)):
        assert out.error is None, out.error
        assert np.abs(np.asarray(out.images[0], dtype=np.int16) - expected).max() <= 2


def edit_call(omni: Omni, files: list[bytes], size: str | None = "64x64") -> httpx.Response:
    """One /v1/images/edits call to the server's app over this engine, in process (size
    None: not sent)."""
    from omnistage.entrypoints.openai.api_server import ServerConfig, build_app

    async def go() -> httpx.Response:
        app = build_app(omni.engine, ServerConfig(served_model_name="glm-image"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            return await client.post(
                "/v1/images/edits", timeout=60,
                data={"prompt": EDIT, "seed": "3", "num_inference_steps": "2",
                      "guidance_scale": "1.5", **({"size": size} if size else {})},
                files=[("image[]", (f"{i}.png", f, "image/png")) for i, f in enumerate(files)])

    return asyncio.run(go())


def test_edit_route(folder: tuple[Path, diffusers.GlmImagePipeline], omni: Omni) -> None:
    """/v1/images/edits draws diffusers' edit (without a size: the condition image's); too
    many images, a condition image whose token grid misses the DiT's patches, and a size off
    the token grid are 400s."""
    ok = edit_call(omni, [CONDITION])
    assert ok.status_code == 200, ok.text
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(ok.json()["data"][0]["b64_json"]))),
                     dtype=np.int16)
    expected = reference_edit(folder[1], (CONDITION,), 3)
    assert np.abs(got - expected).max() <= 2
    unsized = edit_call(omni, [CONDITION], None)
    assert unsized.status_code == 200 and unsized.json()["size"] == "96x64", unsized.text
    for files, size, param, message in (
            ([png(64, 64, seed=i) for i in range(5)], "64x64", "image", "at most 4"),
            ([png(80, 64, seed=1)], "64x64", "image", "multiples of 32"),
            ([CONDITION], "64x48", "size", "multiple of 32")):
        bad = edit_call(omni, files, size)
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == param and message in error["message"], error
