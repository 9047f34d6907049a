"""HunyuanVideo-1.5's super-resolution pass (diffusion/pipelines/hunyuan_video15_sr.py) against
the upstream `HunyuanVideo_1_5_SR_Pipeline` (Tencent-Hunyuan/HunyuanVideo-1.5 at the commit in
tests/fixtures/hunyuan_video15_sr/manifest.json; scripts/hunyuan_video15_sr_fixtures.py ran it):
the same tiny released-layout checkpoints, low-resolution latents, text states, initial noise
and LQ noise -> the high-resolution size, the upsampled LQ latents and the final latents, in
float32, for 480p -> 720p (720p upsampler, 2 latent frames) and 720p -> 1080p (1080p
upsampler), with the resolution tiers shrunk as the script records."""

from __future__ import annotations

import pytest
import torch

from omnistage.diffusion.pipelines.hunyuan_video15_sr import (RECIPES, SuperResolution,
                                                               crop_sizes, hr_size, sr_sigmas)
from omnistage.models.hunyuan_video15_original import load_original_transformer
from omnistage.models.hunyuan_video15_upsampler import load_upsampler
from tests.helpers.hunyuan_video15_sr import build_checkpoint, expected, manifest, text_inputs

RESOLUTION = {"sr720": "720p", "sr1080": "1080p"}
BASE = {"sr720": 640, "sr1080": 960}        # the released base buckets of each recipe


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
