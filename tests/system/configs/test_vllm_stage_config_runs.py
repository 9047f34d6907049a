"""vLLM-Omni stage configs run: Qwen3-TTS, Qwen-Image and Wan loaded through
`Omni(model, stage_configs_path=FILE)` (vLLM-Omni's own shipped file where it ships one,
tests/fixtures/vllm_omni/upstream/, else the hand-written fixture) give the same outputs as our
shipped graph on the tiny checkpoints: the same audio samples, image pixels and video frames for
the same seed, float32 on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.diffusion.params import DiffusionParams

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm_omni"
UPSTREAM = FIXTURES / "upstream"


def run(model: Path, params: object, prompt: str, key: str, **kw: object) -> torch.Tensor:
    with Omni(str(model), device="cpu", backend="inproc", connector="inproc", **kw) as omni:
        [out] = omni.generate([prompt], params, use_tqdm=False)
    assert out.error is None, out.error
    return out.tensors[key]


@pytest.mark.parametrize("name,chunked", [("qwen3_tts.yaml", "true"),
                                          ("qwen3_tts_no_async_chunk.yaml", "false")])
def test_qwen3_tts_speaks_as_the_shipped_graph(qwen3_tts_ref: dict, name: str,
                                               chunked: str) -> None:
    """The talker sampled (temperature 0.9, top-k 50) with a fixed seed: vLLM-Omni's two-stage
    file and ours make the same samples, code2wav streamed (async_chunk: true, our default) or
    decoding each request whole (async_chunk: false; ours told so too). The file's talker
    max_model_len (4096) is over the tiny talker's 512 positions: overridden, as a vLLM user
    would with --max-model-len."""
    from omnistage.testing.tiny_tts import MAX_TOKENS

    model = qwen3_tts_ref["root"] / "custom_voice"
    params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, min_tokens=2,
                            max_tokens=MAX_TOKENS, detokenize=False, seed=7,
                            extra={"voice": "vivian", "language": "English"})
    ours = run(model, params, "Hello world.", "audio",
               stage_overrides=[f"code2wav.inputs.0.chunked={chunked}"])
    theirs = run(model, params, "Hello world.", "audio", stage_configs_path=UPSTREAM / name,
                 stage_overrides=["talker.ar.max_model_len=512"])
    assert ours.numel() > 0 and torch.equal(theirs, ours)


@pytest.fixture(scope="module")
def tiny_qwen_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("diffusers")
    from tests.helpers.qwen_image import build_tiny_qwen_image_pipeline

    return build_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("qwen_image"))


@pytest.mark.parametrize("path,graph", [
    (FIXTURES / "qwen_image.yaml", None),
    (UPSTREAM / "QwenImagePipeline.yaml", "qwen_image_split"),
    (UPSTREAM / "qwen_image_3stage.yaml", "qwen_image_split"),
], ids=["one-stage", "text-encoder-stage", "three-stage"])
def test_qwen_image_draws_as_the_shipped_graph(tiny_qwen_image: Path, path: Path,
                                               graph: str | None) -> None:
    """Two steps of true CFG at 64 pixels: the same pixels as the shipped graph of the file's
    shape (vLLM-Omni's text-encoder stage: qwen_image_split)."""
    params = DiffusionParams(height=64, width=64, num_inference_steps=2, seed=1,
                             true_cfg_scale=4.0, negative_prompt="blurry")
    ours = run(tiny_qwen_image, params, "a red cube", "images", stage_config=graph)
    theirs = run(tiny_qwen_image, params, "a red cube", "images", stage_configs_path=path)
    assert ours.float().std() > 0 and torch.equal(theirs, ours)


def test_wan_films_as_the_shipped_graph(tmp_path: Path) -> None:
    """vLLM-Omni ships no Wan stage config (a one-stage diffusion model needs none there): the
    fixture in its grammar gives the shipped graph's frames."""
    pytest.importorskip("diffusers")
    from omnistage.testing.tiny_wan import build_tiny_wan

    build_tiny_wan(tmp_path)
    params = DiffusionParams(height=32, width=48, num_frames=5, num_inference_steps=2, seed=3)
    ours = run(tmp_path, params, "a cat on the beach", "video")
    theirs = run(tmp_path, params, "a cat on the beach", "video",
                 stage_configs_path=FIXTURES / "wan.yaml")
    assert ours.float().std() > 0 and torch.equal(theirs, ours)
