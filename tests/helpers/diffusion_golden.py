"""The golden comparison of a diffusion pipeline against diffusers', written once.

Each golden file under tests/diffusion builds a tiny random diffusers pipeline, saves it, loads
ours from the same folder and runs both on the same prompt, seed and sizes. What repeats is
here:

    build      randomize(*models)          diffusers zero-inits some layers: every path counts
               save_reference(pipe, path)  progress bar off, save_pretrained
               load_ours(path, component)  our pipeline from the folder (float32, CPU)
    run        reference(ref, prompt, params, "latent")   diffusers' call for OUR params: the
                                                          same sizes, steps, guidance, negative
                                                          prompt, images, frames and seed
               record_latents(ours, monkeypatch, key)     what our engine hands to `decode`
    compare    assert_latents_match(got, expected)        shape, not near zero, allclose
               assert_output_matches(out, expected_float) uint8 output vs diffusers' [0, 1]
               matches_diffusers(ref, ours, prompt, params)  all of it for one request

The reference's arguments are derived from our `DiffusionParams`, so the two sides cannot be
given different inputs by a typo in one of them. The checks refuse a degenerate reference (near
zero latents, a flat image): a tiny pipeline that drew nothing would match anything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from omnistage.registry import load_component
from omnistage.testing.diffusion import run_alone

if TYPE_CHECKING:
    from omnistage.diffusion.pipeline import DiffusionPipeline
    from omnistage.diffusion_params import DiffusionParams

# float32 on CPU: our engine and diffusers run the same ops in the same order up to fused
# kernels; 1e-4 absolute on latents of magnitude ~1 catches a wrong sign, scale, shift or step
LATENT_ATOL = 1e-4
MIN_ABS_MEAN = 0.3      # a tiny random pipeline's latents; near zero would hide a dropped term


def randomize(*models: nn.Module, std: float = 0.1, keep: Iterable[str] = ()) -> None:
    """Redraw every parameter of `models` from N(0, std), but those named in `keep`:
    diffusers zero-inits output projections and gates, which would make a whole branch (and
    a bug in it) invisible."""
    kept = set(keep)
    with torch.no_grad():
        for model in models:
            for name, p in model.named_parameters():
                if name not in kept:
                    p.normal_(0.0, std)


def save_reference(pipe: Any, path: Path) -> Any:
    """The reference quiet (no progress bar) and saved where ours loads from; -> `pipe`."""
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    return pipe


def load_ours(path: Path, component: str, dtype: torch.dtype = torch.float32
              ) -> DiffusionPipeline:
    """Our pipeline registered as `component`, from the reference's folder, on the CPU."""
    return load_component("diffusion", component).from_pretrained(
        path, component, torch.device("cpu"), dtype)


def reference_kwargs(params: DiffusionParams, seeds: Iterable[int] | None = None
                     ) -> dict[str, Any]:
    """diffusers' call arguments for `params`: one generator per seed (default: params.seed),
    one per prompt as our engine draws one per request."""
    seeds = [params.seed or 0] if seeds is None else list(seeds)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    kw: dict[str, Any] = {"num_inference_steps": params.num_inference_steps,
                          "generator": generators[0] if len(generators) == 1 else generators,
                          "num_images_per_prompt": params.num_images}
    for name in ("height", "width", "guidance_scale", "negative_prompt", "num_frames"):
        value = getattr(params, name)
        if value is not None:
            kw[name] = value
    kw["true_cfg_scale"] = params.true_cfg_scale
    kw["guidance_scale_2"] = params.guidance_scale_2
    return kw


def _takes(ref: Any, name: str) -> bool:
    return name in inspect.signature(ref.__call__).parameters


def reference(ref: Any, prompt: str | list[str], params: DiffusionParams, output_type: str,
              *, seeds: Iterable[int] | None = None, **extra: Any) -> Tensor:
    """diffusers' output for our params (`extra`: what the pipeline takes besides them, e.g.
    max_sequence_length; None drops a derived argument); np output as a tensor."""
    kw = {**reference_kwargs(params, seeds), **extra}
    if not _takes(ref, "num_images_per_prompt"):      # video pipelines count videos
        kw["num_videos_per_prompt"] = kw.pop("num_images_per_prompt")
    # these only to pipelines that have them (Qwen-Image's default true CFG scale is 4.0)
    kw = {k: v for k, v in kw.items()
          if v is not None and (k not in ("true_cfg_scale", "guidance_scale_2")
                                or _takes(ref, k))}
    with torch.no_grad():
        # by keyword: some pipelines (FLUX.2) take `image` first
        out = ref(prompt=prompt, output_type=output_type, return_dict=False, **kw)[0]
    return torch.from_numpy(np.asarray(out)) if output_type == "np" else out


def size_seed(params: DiffusionParams) -> str:
    """A recorded request's key "HxW:seed" (None where our pipeline picked the size)."""
    return f"{params.height}x{params.width}:{params.seed}"


def record_latents(pipe: DiffusionPipeline, monkeypatch: pytest.MonkeyPatch,
                   key: Callable[[DiffusionParams], object] = lambda p: p.seed,
                   transform: Callable[[Tensor, DiffusionParams], Tensor] | None = None
                   ) -> dict[object, Tensor]:
    """-> a dict that gets, for every request our engine decodes from now on, its final
    latents (by `key(params)`; `transform` maps them to diffusers' layout first)."""
    seen: dict[object, Tensor] = {}
    decode = pipe.decode

    def spy(latents: Tensor, params: DiffusionParams) -> Tensor:
        seen[key(params)] = (transform(latents, params) if transform else latents).clone()
        return decode(latents, params)

    monkeypatch.setattr(pipe, "decode", spy)
    return seen


def assert_latents_match(got: Tensor, expected: Tensor, *, shape: tuple[int, ...] | None = None,
                         atol: float = LATENT_ATOL, rtol: float = 0.0,
                         min_abs_mean: float = MIN_ABS_MEAN) -> None:
    """Same shape (and `shape` when given), a reference far from zero, close everywhere."""
    assert got.shape == expected.shape, (tuple(got.shape), tuple(expected.shape))
    if shape is not None:
        assert tuple(expected.shape) == shape, (tuple(expected.shape), shape)
    mean = expected.float().abs().mean()
    assert mean > min_abs_mean, f"the reference latents are near zero ({float(mean):.3g})"
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def assert_output_matches(out: Tensor, expected: Tensor, *, max_diff: int = 1) -> None:
    """Our uint8 output (n, H, W, 3), or video (n, F, H, W, 3), against diffusers' float
    output in [0, 1]: images "pt" (n, 3, H, W), video "np" (n, F, H, W, 3); within `max_diff`
    levels (rounding), and not a flat picture."""
    if expected.dim() == 4 and expected.shape[1] == 3 and out.shape[-1] == 3:
        expected = expected.permute(0, 2, 3, 1)                       # pt -> channels last
    quantized = (expected.float() * 255).round().to(torch.uint8)
    assert out.dtype == torch.uint8 and out.shape == quantized.shape, (
        out.dtype, tuple(out.shape), tuple(quantized.shape))
    assert (out.int() - quantized.int()).abs().max() <= max_diff
    assert out.float().std() > 1.0, "the tiny pipeline should not draw a flat image"


@dataclass(frozen=True)
class GoldenRun:
    """One request through ours and diffusers: our final latents and output, theirs."""
    latents: Tensor
    output: Tensor
    expected_latents: Tensor


def matches_diffusers(ref: Any, ours: DiffusionPipeline, prompt: str, params: DiffusionParams,
                      *, shape: tuple[int, ...] | None = None, atol: float = LATENT_ATOL,
                      rtol: float = 0.0, min_abs_mean: float = MIN_ABS_MEAN,
                      image_atol: float | None = LATENT_ATOL, output: str = "pt",
                      latents_as: Callable[[Tensor], Tensor] | None = None, **extra: Any
                      ) -> GoldenRun:
    """The comparison for one request alone: final latents; our float decode against
    diffusers' "pt" images (`image_atol`; None skips it, for pipelines whose float decode is
    not public); the uint8 output against diffusers' `output` ("pt" images, "np" video).
    `latents_as`: our latents in diffusers' latent layout. -> what ran, for further checks."""
    got, out = run_alone(ours, prompt, params)
    expected = reference(ref, prompt, params, "latent", **extra)
    mapped = latents_as(got) if latents_as else got
    assert_latents_match(mapped, expected, shape=shape, atol=atol, rtol=rtol,
                         min_abs_mean=min_abs_mean)
    expected_out = reference(ref, prompt, params, output, **extra)
    if image_atol is not None:
        with torch.no_grad():
            images = ours.decode_float(got, params)
        torch.testing.assert_close(images, expected_out, atol=image_atol, rtol=0)
    assert_output_matches(out, expected_out)
    return GoldenRun(got, out, expected)
