"""HunyuanVideo-1.5's super-resolution pass (diffusion/pipelines/hunyuan_video15_sr.py) against
the upstream `HunyuanVideo_1_5_SR_Pipeline` (Tencent-Hunyuan/HunyuanVideo-1.5 at the commit in
tests/fixtures/hunyuan_video15_sr/manifest.json; scripts/hunyuan_video15_sr_fixtures.py ran it):
the same tiny released-layout checkpoints, low-resolution latents, text states, initial noise
and LQ noise -> the high-resolution size, the upsampled LQ latents and the final latents, in
float32, for 480p -> 720p (720p upsampler, 2 latent frames) and 720p -> 1080p (1080p
upsampler), with the resolution tiers shrunk as the script records; and 480p -> 720p
image-to-video (sr720_i2v): the first frame's pixels at the high-resolution size and its
vision-encoder crop (size and sha256) as upstream makes them, then, from the reference's VAE
latents and vision tokens (its VAE and vision encoder are seeded stand-ins), the final
latents."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.diffusion.pipelines.hunyuan_video15_sr import (RECIPES, SuperResolution,
                                                               crop_sizes, hr_size,
                                                               image_bucket, sr_sigmas)
from omnistage.models.hunyuan_video15_image import (cover_crop, crop_resize, image_condition,
                                                    vae_pixels)
from omnistage.models.hunyuan_video15_original import load_original_transformer
from omnistage.models.hunyuan_video15_upsampler import load_upsampler
from tests.helpers.hunyuan_video15_sr import build_checkpoint, expected, manifest, text_inputs

RESOLUTION = {"sr720": "720p", "sr1080": "1080p", "sr720_i2v": "720p"}
BASE = {"sr720": 640, "sr1080": 960, "sr720_i2v": 640}   # the released base bucket of each


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("hv15-sr"))


def make_sr(root, name: str) -> SuperResolution:
    case = manifest()["cases"][name]
    return SuperResolution(load_original_transformer(root / "transformer" / case["version"]),
                           load_upsampler(root / "upsampler" / case["version"]),
                           RECIPES[BASE[name]], torch.device("cpu"))


def test_sizes_and_schedule_follow_upstream() -> None:
    for name, case in manifest()["cases"].items():
        lr_h, lr_w = case["lr_size"]
        sizes = case["sizes"]
        assert (lr_w, lr_h) in crop_sizes(sizes[case["base_resolution"]])
        assert list(hr_size(lr_h, lr_w, sizes[RESOLUTION[name]])) == case["hr_size"]
    # the released 480p -> 720p map for a 16:9 base video (848 x 480 -> 1280 x 720)
    assert hr_size(480, 848, RECIPES[640].hr_base) == (720, 1280)
    assert RECIPES[960].num_inference_steps == 8 and RECIPES[960].hr_base == 1440
    sigmas, timesteps = sr_sigmas(6, 2.0)
    assert sigmas[-1] == 0 and timesteps[0] == 1000 and (timesteps >= 700).sum() == 3


@pytest.mark.parametrize("name", ["sr720", "sr1080"])
def test_sr_pass_matches_upstream(root, name: str) -> None:
    case, exp = manifest()["cases"][name], expected()
    sr = make_sr(root, name)
    size = tuple(s // 16 for s in case["hr_size"])
    up = sr.upsample(exp[f"{name}.lq_latents"], size)
    torch.testing.assert_close(up, exp[f"{name}.upsampled"], atol=1e-5, rtol=1e-5)
    out = sr.run(exp[f"{name}.latents"], up, exp[f"{name}.lq_noise"], text_inputs(),
                 case["steps"], case["flow_shift"])
    want = exp[f"{name}.final_latents"]
    assert (want - exp[f"{name}.latents"]).abs().mean() > 0.3       # the pass moved the noise
    torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-4)


def test_lq_condition_and_its_cutoff_matter(root) -> None:
    """Plausible bugs must fail: the LQ latents never zeroed, or never seen."""
    case, exp = manifest()["cases"]["sr720"], expected()
    sr = make_sr(root, "sr720")
    up = exp["sr720.upsampled"]
    want = exp["sr720.final_latents"]
    args = (exp["sr720.latents"], up, exp["sr720.lq_noise"], text_inputs(), case["steps"],
            case["flow_shift"])
    for broken in ("always", "never"):
        real = sr.condition

        def condition(lq, image_cond, real=real, broken=broken):
            with_lq, without = real(lq, image_cond)
            return (with_lq, with_lq) if broken == "always" else (without, without)

        sr.condition = condition
        try:
            assert (sr.run(*args) - want).abs().max() > 1e-2, broken
        finally:
            sr.condition = real


def i2v_args(name: str = "sr720_i2v") -> tuple:
    """sr.run's arguments for the i2v case, as the i2v pipeline's `sr_inputs` builds them
    from the image's latents and SigLIP tokens (here upstream's recorded ones)."""
    case, exp = manifest()["cases"][name], expected()
    frames = exp[f"{name}.latents"].shape[2]
    condition, mask = image_condition(exp[f"{name}.image_latents"], 1, frames, torch.float32)
    text = text_inputs() | {"image_embeds": exp[f"{name}.vision_states"]}
    return (exp[f"{name}.latents"], exp[f"{name}.upsampled"], exp[f"{name}.lq_noise"], text,
            case["steps"], case["flow_shift"], torch.cat([condition, mask], dim=1))


def test_i2v_first_frame_crops_match_upstream() -> None:
    """The image as upstream's SR pass crops it (`cover_crop`): for its VAE at the
    high-resolution size, and for its vision encoder at the real 720p bucket of the image's
    aspect. This image's sizes round where diffusers' crop_resize floors (one row more)."""
    case, exp = manifest()["cases"]["sr720_i2v"], expected()
    image = Image.fromarray(exp["sr720_i2v.image"].numpy())
    assert image.size == tuple(case["image_size"])
    want = exp["sr720_i2v.image_pixels"][:, :, 0].float() / 127.5 - 1   # (1, 3, H, W)
    torch.testing.assert_close(vae_pixels(cover_crop(image, *case["hr_size"])), want,
                               atol=0, rtol=0)
    assert not torch.equal(vae_pixels(crop_resize(image, *case["hr_size"])), want)
    size = image_bucket(image.height, image.width, RECIPES[BASE["sr720_i2v"]].hr_base)
    assert [*size, 3] == case["vision_input_size"]
    crop = np.ascontiguousarray(np.asarray(cover_crop(image, *size)))
    assert hashlib.sha256(crop).hexdigest() == case["vision_input_sha256"]


def test_i2v_sr_pass_matches_upstream(root) -> None:
    case, exp = manifest()["cases"]["sr720_i2v"], expected()
    sr = make_sr(root, "sr720_i2v")
    size = tuple(s // 16 for s in case["hr_size"])
    up = sr.upsample(exp["sr720_i2v.lq_latents"], size)
    torch.testing.assert_close(up, exp["sr720_i2v.upsampled"], atol=1e-5, rtol=1e-5)
    out = sr.run(*i2v_args())
    want = exp["sr720_i2v.final_latents"]
    assert (want - exp["sr720_i2v.latents"]).abs().mean() > 0.3     # the pass moved the noise
    torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-4)
    # plausible bugs must fail: the first-frame condition, or the vision tokens, dropped
    latents, up, noise, text, steps, shift, image_cond = i2v_args()
    no_tokens = {k: v for k, v in text.items() if k != "image_embeds"}
    for broken in ((latents, up, noise, text, steps, shift, None),
                   (latents, up, noise, no_tokens, steps, shift, image_cond)):
        assert (sr.run(*broken) - want).abs().max() > 1e-2
