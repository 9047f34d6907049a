"""GLM-Image end to end through `Omni` on a tiny random diffusers folder, float32: its default
graph (AR stage -> tokens_to_tensor -> DiT stage) draws the image diffusers' GlmImagePipeline
draws (within 2/255; the reference samples its AR model with top_k=1, greedy); the AR stage's
prompt equals GlmImageProcessor's; bad sizes are refused by name; the image route's fields
reach the stages that take them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.models.glm_image import target_grids
from omnistage.testing.tiny_glm_image import build_tiny_glm_image

diffusers = pytest.importorskip("diffusers")

H, W = 64, 96                   # a 2x3 AR token grid, a 13x19 preview before it
PROMPT = 'a red cat on the sign that reads "OPEN"'


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, diffusers.GlmImagePipeline]:
    path = tmp_path_factory.mktemp("glm_image")
    ref = build_tiny_glm_image(path)
    ref.set_progress_bar_config(disable=True)
    return path, ref


def test_text_to_image_equals_diffusers(folder: tuple[Path, diffusers.GlmImagePipeline]
                                        ) -> None:
    path, ref = folder
    image = ref(PROMPT, height=H, width=W, num_inference_steps=2, guidance_scale=1.5,
                generator=torch.Generator().manual_seed(3)).images[0]
    expected = np.asarray(image, dtype=np.int16)                   # uint8 as ours, (H, W, 3)
    assert expected.std() > 10
    with Omni(str(path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate(PROMPT, DiffusionParams(height=H, width=W, num_inference_steps=2,
                                                       guidance_scale=1.5, seed=3))
        assert out.error is None, out.error
        got = np.asarray(out.images[0], dtype=np.int16)
        assert got.shape == expected.shape and np.abs(got - expected).max() <= 2
        ar = omni.engine.orchestrator.stage_info["ar"]
        assert ar["text_prompt"] == 1
        for params, message in ((DiffusionParams(height=H + 16, width=W), "multiple of 32"),
                                (DiffusionParams(), "height / width")):
            (bad,) = omni.generate(PROMPT, params)
            assert bad.finish_reason == "error" and message in bad.error, bad.error


def test_prompt_equals_the_processor(folder: tuple[Path, diffusers.GlmImagePipeline]) -> None:
    """The AR stage's prompt ids and max_tokens are GlmImageProcessor's and the pipeline's."""
    from omnistage.configs.schema import StageConfig
    from omnistage.stages.glm_image import GlmImageARStage

    path, ref = folder
    stage = GlmImageARStage(StageConfig("ar", "ar", component="glm_image_ar",
                                        enforce_eager=True, num_kv_blocks=8), str(path), "cpu")
    messages = [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]]
    inputs = ref.processor.apply_chat_template(messages, tokenize=True, target_h=H, target_w=W,
                                               return_dict=True, return_tensors="pt")
    target, preview = target_grids(H, W)
    assert inputs["image_grid_thw"].tolist() == [[1, *target], [1, *preview]]
    assert stage.prompt_token_ids(PROMPT, [target, preview]) == inputs["input_ids"][0].tolist()


def test_image_routes_size_the_ar_stage(folder: tuple[Path, diffusers.GlmImagePipeline]) -> None:
    """/v1/images/generations' fields go to the DiT stage; the AR entry stage samples with its
    own defaults (the AR model's generation config) and reads the size from the DiT's params."""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.entrypoints.openai.params import stage_params

    path, _ = folder
    graph = resolve_graph(str(path), path, None)
    assert [s.component for s in graph.stages] == ["glm_image_ar", "glm_image"]
    ar, dit = stage_params(graph, ["ar"], {"num_images": 1, "height": H, "width": W}, None,
                           image_fields=True)
    assert ar is None and (dit.height, dit.width) == (H, W)
