"""GPU-only checks (skipped without CUDA): FLUX.2 served on CUDA (its default graph, the
transformer's forwards replayed from CUDA graphs as a CUDA stage does) against diffusers'
Flux2KleinPipeline / Flux2Pipeline on CUDA, float32 with TF32 off, on the tiny folders of the
CPU golden tests: klein text-to-image with CFG, klein editing with two reference images, dev
text-to-image. What these catch is placement (a tensor left on the CPU, reference tokens or
position ids on the wrong device, a graph replayed with stale inputs), not numerics."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from omnistage import DiffusionParams, Omni

pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _load_test_module(name: str):
    path = Path(__file__).parents[1] / "diffusion" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_gpu_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve(folder: Path, prompt: str, params: list[DiffusionParams]) -> list[torch.Tensor]:
    with Omni(str(folder), device="cuda", dtype="float32",
              stage_overrides=["backend=inproc", "connector=inproc"]) as omni:
        outs = [omni.generate(prompt, p)[0] for p in params]
    for out in outs:
        assert out.error is None, out.error
    return [out.tensors["images"] for out in outs]


def _uint8(images: torch.Tensor) -> torch.Tensor:
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def test_flux2_klein_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    mod = _load_test_module("test_flux2_pipeline")
    ref = mod.build_reference(tmp_path / "klein").to("cuda")
    first, second = mod.png(70, 66, seed=2), mod.png(64, 72, seed=3)
    t2i = DiffusionParams(height=mod.SIZE, width=mod.SIZE, num_inference_steps=3,
                          guidance_scale=3.0, seed=0, num_images=2)
    edit = DiffusionParams(num_inference_steps=3, guidance_scale=2.0, seed=4, image=first,
                           extra_images=(second,))
    got = _serve(tmp_path / "klein", mod.PROMPT, [t2i, t2i, edit])   # the 2nd: graphs replay
    with torch.no_grad():
        expected_t2i = ref(prompt=mod.PROMPT, height=mod.SIZE, width=mod.SIZE,
                           num_inference_steps=3, guidance_scale=3.0, num_images_per_prompt=2,
                           generator=torch.Generator().manual_seed(0), output_type="pt",
                           return_dict=False)[0]
        expected_edit = ref(prompt=mod.PROMPT, image=[Image.open(io.BytesIO(f)).convert("RGB")
                                                      for f in (first, second)],
                            num_inference_steps=3, guidance_scale=2.0,
                            generator=torch.Generator().manual_seed(4), output_type="pt",
                            return_dict=False)[0]
    for images, expected in ((got[0], expected_t2i), (got[1], expected_t2i),
                             (got[2], expected_edit)):
        assert images.shape == _uint8(expected).shape
        assert (images.int() - _uint8(expected).int()).abs().max() <= 2


def test_flux2_dev_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    mod = _load_test_module("test_flux2_dev_pipeline")
    ref = mod.build_reference(tmp_path / "dev").to("cuda")
    params = DiffusionParams(height=mod.SIZE, width=mod.SIZE, num_inference_steps=3,
                             guidance_scale=2.5, seed=0)
    (got,) = _serve(tmp_path / "dev", mod.PROMPT, [params])
    with torch.no_grad():
        expected = ref(prompt=mod.PROMPT, height=mod.SIZE, width=mod.SIZE,
                       num_inference_steps=3, guidance_scale=2.5,
                       generator=torch.Generator().manual_seed(0), output_type="pt",
                       return_dict=False)[0]
    assert (got.int() - _uint8(expected).int()).abs().max() <= 2
