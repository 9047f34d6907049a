"""GPU-only checks (skipped without CUDA): the multi-network pipelines on CUDA against their
references on CUDA, float32 with TF32 off: Qwen3-Omni (thinker -> talker -> code2wav, stage
processes) against transformers' generate(return_audio=True), and the Qwen-Image / FLUX.1 /
FLUX.2, Qwen-Image-Edit(-Plus) and GLM-Image pipelines against diffusers (FLUX.2: klein
text-to-image with CFG and an edit with two reference images, dev text-to-image; the
transformer's forwards replayed from CUDA graphs, as a CUDA stage does). What these catch is
placement (a tensor left on the CPU, a generator or reference tokens on the wrong device, a
graph replayed with stale inputs), not numerics, which the CPU golden tests pin down."""

from __future__ import annotations

import importlib.util
import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omnistage import DiffusionParams, Omni, SamplingParams

pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHAT = [{"role": "user", "content": "Hello world, what is the weather today?"}]


def _load_test_module(name: str):
    path = Path(__file__).parents[1] / "golden" / "diffusion" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_gpu_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen3_omni_on_cuda_equals_transformers(tmp_path: Path) -> None:
    import transformers

    from omnistage.models.qwen3_omni.processing import InputProcessor
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path / "omni")
    processor = InputProcessor.from_pretrained(ckpt)
    inputs = {k: v.cuda() for k, v in processor.parse_request({"messages": CHAT}).hf_kwargs()
              .items()}
    hf = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt).cuda().eval()
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        seq, wav = hf.generate(**inputs, return_audio=True, thinker_do_sample=False,
                               thinker_max_new_tokens=12, thinker_eos_token_id=eos,
                               talker_do_sample=False, talker_max_new_tokens=40)
    expected_ids = seq[0, inputs["input_ids"].shape[1]:].tolist()
    del hf
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=40), None]
    with Omni(str(ckpt), device="cuda", dtype="float32",
              stage_overrides=["code2wav.generation.options.chunk_frames=300",
                                "code2wav.generation.options.first_chunk_frames=300"]) as omni:
        (out,) = omni.generate({"messages": CHAT}, params)
    assert out.error is None, out.error
    assert out.token_ids == expected_ids
    audio = out.tensors["audio"]
    assert audio.shape == wav.reshape(-1).shape
    # the stage processes turn TF32 off for dtype float32, as the reference runs here
    assert (audio - wav.reshape(-1).cpu()).abs().max() <= 1e-3


def _uint8(images: torch.Tensor) -> torch.Tensor:
    """float images (n, 3, H, W) in [0, 1] -> uint8 (n, H, W, 3) on the CPU, as a stage's."""
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


@pytest.mark.parametrize("name", ["qwen_image", "flux"])
def test_diffusion_pipeline_on_cuda_equals_diffusers(name: str, tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    mod = _load_test_module(f"test_{name}_pipeline")
    args = (tmp_path / name,) if name == "qwen_image" else (tmp_path / name, True)
    ref = mod.build_reference(*args)
    ref.to("cuda")
    size = mod.SIZE
    kwargs = dict(height=size, width=size, num_inference_steps=4, output_type="pt",
                  generator=torch.Generator().manual_seed(0), return_dict=False)
    if name == "qwen_image":
        kwargs.update(negative_prompt=mod.NEGATIVE, true_cfg_scale=4.0)
        params = DiffusionParams(height=size, width=size, num_inference_steps=4, seed=0,
                                 negative_prompt=mod.NEGATIVE, true_cfg_scale=4.0)
    else:
        kwargs.update(guidance_scale=3.5)
        params = DiffusionParams(height=size, width=size, num_inference_steps=4, seed=0,
                                 guidance_scale=3.5)
    with torch.no_grad():
        expected = ref(mod.PROMPT, **kwargs)[0]                          # (1, 3, H, W) [0, 1]
    expected = _uint8(expected)
    with Omni(str(tmp_path / name), device="cuda", dtype="float32",
              stage_overrides=["backend=inproc", "connector=inproc"]) as omni:
        (out,) = omni.generate(mod.PROMPT, params)
    assert out.error is None, out.error
    assert (out.tensors["images"].int() - expected.int()).abs().max() <= 2


def _flux2_images(folder: Path, prompt: str, params: list[DiffusionParams]) -> list[torch.Tensor]:
    """FLUX.2 through its default graph on CUDA (in-process): each request's uint8 images."""
    with Omni(str(folder), device="cuda", dtype="float32",
              stage_overrides=["backend=inproc", "connector=inproc"]) as omni:
        outs = [omni.generate(prompt, p)[0] for p in params]
    assert all(out.error is None for out in outs), [out.error for out in outs]
    return [out.tensors["images"] for out in outs]


def test_flux2_klein_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from PIL import Image

    from omnistage.testing.diffusion import png
    from omnistage.testing.tiny_flux2 import build_tiny_flux2_klein

    ref = build_tiny_flux2_klein(tmp_path / "klein").to("cuda")
    prompt, first, second = "a photo of the sea shore", png(70, 66, seed=2), png(64, 72, seed=3)
    t2i = DiffusionParams(height=32, width=32, num_inference_steps=3, guidance_scale=3.0,
                          seed=0, num_images=2)
    edit = DiffusionParams(num_inference_steps=3, guidance_scale=2.0, seed=4, image=first,
                           extra_images=(second,))
    got = _flux2_images(tmp_path / "klein", prompt, [t2i, t2i, edit])  # the 2nd: replays
    with torch.no_grad():
        expected_t2i = ref(prompt=prompt, height=32, width=32, num_inference_steps=3,
                           guidance_scale=3.0, num_images_per_prompt=2, output_type="pt",
                           generator=torch.Generator().manual_seed(0), return_dict=False)[0]
        expected_edit = ref(prompt=prompt, image=[Image.open(io.BytesIO(f)).convert("RGB")
                                                  for f in (first, second)],
                            num_inference_steps=3, guidance_scale=2.0, output_type="pt",
                            generator=torch.Generator().manual_seed(4), return_dict=False)[0]
    for images, expected in zip(got, (expected_t2i, expected_t2i, expected_edit)):
        assert images.shape == _uint8(expected).shape
        assert (images.int() - _uint8(expected).int()).abs().max() <= 2


def test_flux2_dev_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from omnistage.testing.tiny_flux2 import build_tiny_flux2_dev

    ref = build_tiny_flux2_dev(tmp_path / "dev").to("cuda")
    prompt = "a photo of the sea shore"
    params = DiffusionParams(height=32, width=32, num_inference_steps=3, guidance_scale=2.5,
                             seed=0)
    (got,) = _flux2_images(tmp_path / "dev", prompt, [params])
    with torch.no_grad():
        expected = ref(prompt=prompt, height=32, width=32, num_inference_steps=3,
                       guidance_scale=2.5, generator=torch.Generator().manual_seed(0),
                       output_type="pt", return_dict=False)[0]
    assert (got.int() - _uint8(expected).int()).abs().max() <= 2


@pytest.mark.parametrize("plus", [False, True], ids=["edit", "edit-plus"])
def test_qwen_image_edit_on_cuda_equals_diffusers(plus: bool, tmp_path: Path) -> None:
    """Qwen-Image-Edit (one image) and Edit-Plus (two of different sizes) through `Omni` on
    CUDA (the vision tower, the multimodal rotary, the image tokens, CUDA graphs on) against
    diffusers on CUDA with its `mm_token_type_ids` fix, at the real ~1024x1024-pixel image
    sizes."""
    pytest.importorskip("diffusers")
    from PIL import Image

    from omnistage.testing.tiny_qwen_image_edit import build_tiny_qwen_image_edit

    mod = _load_test_module("test_qwen_image_edit_pipeline")
    ref = build_tiny_qwen_image_edit(tmp_path / "edit", plus=plus)
    ref.to("cuda")
    files = [mod.png_bytes((80, 48), seed=1), mod.png_bytes((48, 64), seed=3)][:1 + plus]
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in files]
    with torch.no_grad():
        expected = ref(images if plus else images[0], mod.PROMPT, negative_prompt=mod.NEGATIVE,
                       true_cfg_scale=4.0, height=64, width=96, num_inference_steps=3,
                       generator=torch.Generator().manual_seed(0), output_type="pt",
                       return_dict=False)[0]                          # (1, 3, H, W) [0, 1]
    expected = _uint8(expected)
    params = DiffusionParams(height=64, width=96, num_inference_steps=3, seed=0,
                             negative_prompt=mod.NEGATIVE, true_cfg_scale=4.0, image=files[0],
                             extra_images=tuple(files[1:]))
    with Omni(str(tmp_path / "edit"), device="cuda", dtype="float32",
              stage_overrides=["backend=inproc", "connector=inproc"]) as omni:
        outs = omni.generate([mod.PROMPT] * 2, [params])       # two requests, one batch
    for out in outs:
        assert out.error is None, out.error
        assert (out.tensors["images"].int() - expected.int()).abs().max() <= 2


def test_glm_image_dit_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    """GLM-Image's DiT decode stage in our engine on CUDA, with CFG, against diffusers'
    GlmImagePipeline on CUDA given the same AR tokens."""
    pytest.importorskip("diffusers")
    from omnistage.diffusion.pipelines.glm_image import GlmImagePipeline
    from omnistage.testing.diffusion import run_recording_latents

    mod = _load_test_module("test_glm_image_pipeline")
    ref = mod.build_tiny_glm_image_dit(tmp_path / "glm")
    ref.to("cuda")
    ref.set_progress_bar_config(disable=True)
    tokens = mod.ar_tokens(0)
    with torch.no_grad():
        expected = mod.reference(ref, mod.PROMPT, tokens.cuda(), 1.5, "pt")  # (1, 3, H, W)
    ours = GlmImagePipeline.from_pretrained(tmp_path / "glm", "glm_image", torch.device("cuda"),
                                            torch.float32)
    p = mod.params(1.5)
    runs, _ = run_recording_latents(ours, lambda e: (mod.add(e, "a", mod.PROMPT, p, tokens),
                                                     {"a": p})[1])
    images = runs["a"][1]                                                # uint8 (1, H, W, 3)
    assert (images.int() - _uint8(expected).int()).abs().max() <= 2


def test_glm_image_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    """GLM-Image's whole graph (AR stage -> DiT stage, stage processes) on CUDA against
    diffusers' GlmImagePipeline on CUDA, its AR model sampling greedily (top_k=1): text-to-
    image, and an edit with two condition images."""
    pytest.importorskip("diffusers")
    import numpy as np
    from PIL import Image

    from omnistage.testing.diffusion import png
    from omnistage.testing.tiny_glm_image import build_tiny_glm_image, split_condition_features

    ref = build_tiny_glm_image(tmp_path / "glm")
    ref.to("cuda")
    ref.set_progress_bar_config(disable=True)
    split_condition_features(ref)
    prompt, size = 'a red cat on the sign that reads "OPEN"', (64, 96)
    files = (png(96, 64, seed=1), png(96, 64, seed=2))
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    expected = []
    with torch.no_grad():
        for given in (None, images):
            image = ref(prompt, image=given, height=size[0], width=size[1],
                        num_inference_steps=2, guidance_scale=1.5,
                        generator=torch.Generator().manual_seed(3)).images[0]
            expected.append(np.asarray(image, dtype=np.int16))
    params = DiffusionParams(height=size[0], width=size[1], num_inference_steps=2,
                             guidance_scale=1.5, seed=3)
    with Omni(str(tmp_path / "glm"), device="cuda") as omni:
        (t2i,) = omni.generate(prompt, params)
        (edit,) = omni.generate(prompt, replace(params, image=files[0],
                                                extra_images=files[1:]))
    for out, want in zip((t2i, edit), expected):
        assert out.error is None, out.error
        assert np.abs(np.asarray(out.images[0], dtype=np.int16) - want).max() <= 2
