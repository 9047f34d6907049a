"""HunyuanVideo-1.5's super-resolution pass inside the stage (`diffusion.options.sr`): a request
on the engine over the tiny text-to-video pipeline with a tiny SR DiT and upsampler attached
ends as its base loop (run without SR) followed by the SR pass on those latents, with the
request's own generator, prompt rows and the high-resolution bucket of its aspect; and the
decoded video has that size. The SR pass itself is checked against the upstream code in
test_hunyuan_video15_sr_pipeline.py; the options and the released-layout loading here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.options import read_options
from omnistage.diffusion.pipelines.hunyuan_video15_sr import (HunyuanVideo15Options, SRRecipe,
                                                               SuperResolution)
from omnistage.diffusion_params import DiffusionParams
from omnistage.models.hunyuan_video15_transformer import (HunyuanVideo15Transformer3DModel,
                                                          HunyuanVideo15TransformerConfig)
from omnistage.models.hunyuan_video15_upsampler import SRTo720pUpsampler, SRTo720pUpsamplerConfig
from omnistage.testing.diffusion import run_alone
from tests.helpers.diffusion_golden import randomize
from tests.helpers.hunyuan_video15 import (GLYPH_DIM, IMAGE_DIM, LATENT, TEXT_DIM,
                                           FakePromptEncoder, build_tiny_t2v)
from tests.helpers.hunyuan_video15_sr import build_checkpoint

pytest.importorskip("diffusers")

PROMPT = 'a cat holds a sign that says "hi"'
HR_BASE = 96                    # the tiny recipe's high-resolution buckets (8 px latents)


def tiny_sr() -> SuperResolution:
    cfg = HunyuanVideo15TransformerConfig(
        in_channels=3 * LATENT + 2, out_channels=LATENT, num_attention_heads=2,
        attention_head_dim=16, num_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
        text_embed_dim=TEXT_DIM, text_embed_2_dim=GLYPH_DIM, image_embed_dim=IMAGE_DIM,
        rope_axes_dim=(4, 6, 6), target_size=HR_BASE)
    torch.manual_seed(5)
    dit = HunyuanVideo15Transformer3DModel(cfg).eval()
    up = SRTo720pUpsampler(SRTo720pUpsamplerConfig(in_channels=LATENT, out_channels=LATENT,
                                                   hidden_channels=8, num_blocks=1)).eval()
    randomize(dit, up, std=0.2)
    return SuperResolution(dit, up, SRRecipe("tiny_sr", HR_BASE, 3), torch.device("cpu"))


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory):
    from omnistage.diffusion.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

    path = tmp_path_factory.mktemp("hv15")
    build_tiny_t2v(path)
    pipe = HunyuanVideo15Pipeline.from_pretrained(path, "hunyuan_video15", torch.device("cpu"),
                                                  torch.float32, text_encoders=False)
    pipe.prompt_encoder = FakePromptEncoder()
    return pipe


def test_sr_runs_after_the_base_loop(pipe) -> None:
    params = DiffusionParams(height=40, width=56, num_frames=5, num_inference_steps=2, seed=3,
                             num_images=2, negative_prompt="blurry")
    pipe.sr = None
    base, _ = run_alone(pipe, PROMPT, params)                     # (2, 4, 2, 5, 7)
    sr = tiny_sr()
    pipe.sr = sr
    try:
        got, video = run_alone(pipe, PROMPT, params)
    finally:
        pipe.sr = None
    # 56 x 40 (aspect 1.4) -> the 96 px buckets' 112 x 80 (1.4): latents 14 x 10
    shape = sr.target_shape(tuple(base.shape), 8, 8)
    assert shape == (2, LATENT, 2, 10, 14) and tuple(got.shape) == shape
    assert tuple(video.shape) == (2, 5, 80, 112, 3)
    gen = torch.Generator().manual_seed(params.seed)
    torch.randn(base.shape, generator=gen)                         # the base loop's noise
    text, glyph = FakePromptEncoder().states(PROMPT)
    inputs = {"encoder_hidden_states": text[None].expand(2, -1, -1),
              "encoder_attention_mask": torch.ones(2, text.shape[0]),
              "encoder_hidden_states_2": glyph[None].expand(2, -1, -1),
              "encoder_attention_mask_2": torch.ones(2, glyph.shape[0])}
    want = sr.refine(base, inputs, gen, shape)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[0] - got[1]).abs().mean() > 1e-2                   # rows draw their own noise


def test_options_are_checked() -> None:
    where = "stage 'dit': diffusion.options"
    opts = read_options(HunyuanVideo15Options, {"sr": True, "sr_checkpoint": "/x"}, where)
    assert opts.sr and opts.sr_num_inference_steps is None
    for bad in ({"sr": True}, {"sr_chekpoint": "/x"}, {"sr": True, "sr_checkpoint": "/x",
                                                      "sr_num_inference_steps": 0}):
        with pytest.raises(ValueError):
            read_options(HunyuanVideo15Options, bad, where)


def test_released_layout_loads_by_base_size(tmp_path: Path, pipe) -> None:
    root = build_checkpoint(tmp_path)
    sr = SuperResolution.from_pretrained(root, 640, torch.device("cpu"), torch.float32)
    assert sr.recipe.version == "720p_sr_distilled" and sr.recipe.num_inference_steps == 6
    assert isinstance(sr.upsampler, SRTo720pUpsampler) and sr.transformer.cfg.in_channels == 98
    with pytest.raises(ValueError, match="base of 64 px"):        # the tiny base: no recipe
        pipe.configure(HunyuanVideo15Options(sr=True, sr_checkpoint=str(root)))
    with pytest.raises(FileNotFoundError, match="1080p_sr_distilled"):
        SuperResolution.from_pretrained(tmp_path / "missing", 960, torch.device("cpu"), None)


def test_image_to_video_conditions_the_sr_pass_on_its_first_frame(tmp_path: Path) -> None:
    """Image-to-video: the pass gets the first frame again, cropped as upstream's SR pass
    crops it (`cover_crop`): VAE latents at the high-resolution size on frame 0 with the mask,
    SigLIP tokens of the image's own bucket at the SR's resolution; without them it ends
    elsewhere."""
    import numpy as np
    from PIL import Image

    from omnistage.diffusion.pipelines.hunyuan_video15 import (HunyuanVideo15Pipeline,
                                                               bucket_size)
    from omnistage.diffusion.pipelines.hunyuan_video15_i2v import (
        HunyuanVideo15ImageToVideoPipeline)
    from omnistage.diffusion.pipelines.hunyuan_video15_sr import image_bucket
    from omnistage.models.hunyuan_video15_image import (cover_crop, siglip_tokens,
                                                        vae_image_latents)
    from tests.helpers.hunyuan_video15 import build_tiny_i2v

    build_tiny_i2v(tmp_path)
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(
        tmp_path, "hunyuan_video15_i2v", torch.device("cpu"), torch.float32,
        text_encoders=False)
    pipe.prompt_encoder = FakePromptEncoder()
    pipe.sr = tiny_sr()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (44, 70, 3),
                                                              dtype=np.uint8))
    params = DiffusionParams(num_frames=5, num_inference_steps=2, seed=4, image=image,
                             guidance_scale=1.0)
    seen: dict = {}
    real = pipe.sr_inputs

    def recording(request, shape):
        seen["shape"], seen["out"] = shape, real(request, shape)
        return seen["out"]

    pipe.sr_inputs = recording
    got, video = run_alone(pipe, "the cat turns its head", params)
    (extra, cond), (n, _, _, hh, ww) = seen["out"], seen["shape"]
    first = vae_image_latents(pipe.vae, cover_crop(image, hh * 8, ww * 8))[:, :, 0]
    torch.testing.assert_close(cond[:, :LATENT, 0], first.expand(n, -1, -1, -1))
    assert cond[:, :LATENT, 1:].abs().max() == 0                  # frame 0 only, its mask 1
    assert (cond[:, LATENT, 0] == 1).all() and (cond[:, LATENT, 1:] == 0).all()
    tokens = siglip_tokens(pipe.image_encoder, pipe.image_processor,
                           cover_crop(image, *image_bucket(44, 70, HR_BASE)))
    torch.testing.assert_close(extra["image_embeds"], tokens.expand(n, -1, -1))
    h, w = bucket_size(44, 70, 64, 8)                     # the base video: the image's bucket
    size = pipe.sr.target_shape((1, LATENT, 2, h // 8, w // 8), 8, 8)[3:]
    assert size != (h // 8, w // 8) and tuple(got.shape[3:]) == size
    assert tuple(video.shape[2:]) == (size[0] * 8, size[1] * 8, 3)
    pipe.sr_inputs = lambda request, shape: HunyuanVideo15Pipeline.sr_inputs(pipe, request,
                                                                              shape)
    without, _ = run_alone(pipe, "the cat turns its head", params)
    assert (got - without).abs().max() > 1e-2
