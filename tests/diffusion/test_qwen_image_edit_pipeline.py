"""Qwen-Image-Edit and Qwen-Image-Edit-Plus in our engine against diffusers'
QwenImageEditPipeline / QwenImageEditPlusPipeline on tiny random folders (float32, true CFG,
several steps): the same prompt embeddings (the Qwen2.5-VL encoder with the images) and the
same packed latents; Edit-Plus with two images of different sizes; bad requests refused.

The reference gets the processor's `mm_token_type_ids` forwarded to its text encoder (diffusers
PR #14189): without it, transformers >= 5.15 silently drops the images' multimodal positions.
transformers' Qwen2VLProcessor insists on a video processor (torchvision, not installed), so
it is built without one; it never sees a video here. Sizes are scaled down from ~1024x1024
pixels (`calculate_dimensions`' area) to keep the tiny models fast.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.qwen_image_edit import (CONDITION_AREA, TARGET_AREA,
                                                           QwenImageEditPipeline)
from omnistage.errors import InputError
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_omni import build_tiny_omni_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

C = 4                           # latent channels
AREA = 64 * 64                  # stands in for 1024 * 1024 pixels
CONDITION = 32 * 32             # stands in for Edit-Plus's 384 * 384
PROMPT = "make the sea shore sunny"
NEGATIVE = "blurry, low quality"
STEPS = 3


def png_bytes(size: tuple[int, int], seed: int) -> bytes:
    """A smooth random RGB image (width, height) as PNG bytes."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize(size, Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def tiny_processor(tokenizer) -> transformers.Qwen2VLProcessor:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    from transformers.processing_utils import ProcessorMixin

    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                      min_pixels=8 * 8, max_pixels=32 * 32)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if arg is None else check(self, name, arg))
    try:
        processor = transformers.Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer,
                                                  video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check

    def save(directory, **kwargs) -> None:      # the files a real processor/ folder holds
        images.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    processor.save_pretrained = save
    return processor


def forward_token_types(text_encoder, image_token_id: int) -> None:
    """diffusers PR #14189 in the reference: the image tokens' type ids reach the encoder."""
    forward = text_encoder.forward

    def with_types(input_ids=None, **kwargs):
        kwargs.setdefault("mm_token_type_ids", (input_ids == image_token_id).int())
        text_encoder.model.rope_deltas = None
        return forward(input_ids=input_ids, **kwargs)

    text_encoder.forward = with_types


def build_reference(path: Path, cls: type) -> diffusers.DiffusionPipeline:
    """A diffusers Qwen-Image edit pipeline of `cls` from tiny random components, saved."""
    torch.manual_seed(0)
    tokenizer = build_tiny_omni_tokenizer(path / "tok")
    tid = tokenizer.convert_tokens_to_ids
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, rope_theta=10000.0, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=16, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1]),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vocab_size=len(tokenizer))).eval()
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * C, out_channels=C, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4)).eval()
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=8, z_dim=C, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0]).eval()
    with torch.no_grad():   # make every path count: the images' features, the captions
        for p in [*transformer.parameters(), *text_encoder.model.visual.parameters()]:
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.1)
        for m in [*transformer.modules(), *text_encoder.model.visual.modules()]:
            if "RMSNorm" in type(m).__name__:
                m.weight.normal_(1.0, 0.1)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
        num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True,
        time_shift_type="exponential")
    pipe = cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               processor=tiny_processor(tokenizer), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    forward_token_types(text_encoder, tid("<|image_pad|>"))
    return pipe


def scaled_sizes(monkeypatch: pytest.MonkeyPatch, ours: QwenImageEditPipeline) -> None:
    """Both sides at AREA (and CONDITION) instead of ~1024x1024 (and 384x384) pixels."""
    from diffusers.pipelines.qwenimage import (pipeline_qwenimage_edit as edit,
                                               pipeline_qwenimage_edit_plus as plus)

    areas = {TARGET_AREA: AREA, CONDITION_AREA: CONDITION}
    for module in (edit, plus):
        original = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions",
                            lambda area, ratio, f=original: f(areas[area], ratio))
    monkeypatch.setattr(ours, "target_area", AREA)
    monkeypatch.setattr(ours.prompt_encoder, "condition_area",
                        areas[type(ours.prompt_encoder).condition_area])


def load_pair(path: Path, cls: type, component: str):
    ref = build_reference(path, cls)
    ours = load_component("diffusion", component).from_pretrained(
        path, component, torch.device("cpu"), torch.float32)
    return ref, ours


@pytest.fixture(scope="module")
def edit_pair(tmp_path_factory: pytest.TempPathFactory):
    return load_pair(tmp_path_factory.mktemp("qwen_image_edit"), diffusers.QwenImageEditPipeline,
                     "qwen_image_edit")


@pytest.fixture(scope="module")
def plus_pair(tmp_path_factory: pytest.TempPathFactory):
    return load_pair(tmp_path_factory.mktemp("qwen_image_edit_plus"),
                     diffusers.QwenImageEditPlusPipeline, "qwen_image_edit_plus")


def run_ours(ours: QwenImageEditPipeline, monkeypatch: pytest.MonkeyPatch,
             params: DiffusionParams) -> Tensor:
    """The request's final packed latents, run through the engine."""
    seen = {}
    decode = ours.decode
    monkeypatch.setattr(ours, "decode",
                        lambda latents, p: seen.setdefault("x", latents.clone()) is None
                        or decode(latents, p))
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, params)
    run_to_end(engine)
    return seen["x"]


def reference(ref, images: list[bytes], **kwargs) -> Tensor:
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    with torch.no_grad():
        return ref(pil[0] if len(pil) == 1 else pil, PROMPT, negative_prompt=NEGATIVE,
                   true_cfg_scale=4.0, num_inference_steps=STEPS,
                   generator=torch.Generator().manual_seed(0), output_type="latent",
                   return_dict=False, **kwargs)[0]


def test_edit_matches_diffusers(edit_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = edit_pair
    scaled_sizes(monkeypatch, ours)
    image = png_bytes((80, 48), seed=1)                 # encoded at 96x64: 6x4 tokens
    expected = reference(ref, [image], num_images_per_prompt=2)
    got = run_ours(ours, monkeypatch, DiffusionParams(
        num_inference_steps=STEPS, true_cfg_scale=4.0, negative_prompt=NEGATIVE, seed=0,
        num_images=2, image=image))
    assert got.shape == expected.shape == (2, 6 * 4, 4 * C)
    assert expected.abs().mean() > 0.3
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_edit_prompt_embeds_see_the_image(edit_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder's states equal diffusers', and another image changes them clearly."""
    ref, ours = edit_pair
    scaled_sizes(monkeypatch, ours)
    states = []
    for seed in (1, 2):
        pil = Image.open(io.BytesIO(png_bytes((80, 48), seed))).convert("RGB")
        sized = pil.resize((96, 64), Image.Resampling.LANCZOS)
        with torch.no_grad():
            expected, mask = ref.encode_prompt(PROMPT, image=sized, device=torch.device("cpu"))
        (got,) = ours.prompt_encoder.encode_texts([PROMPT], [[sized]])
        assert mask is None and got.shape == expected.shape[1:]
        torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)
        states.append(got)
    image_rows = states[0].shape[0] - len(ours.prompt_encoder.tokenizer(PROMPT).input_ids) - 5
    assert (states[0] - states[1]).abs().max() > 0.1 and image_rows > 0


def test_plus_two_images_match_diffusers(plus_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = plus_pair
    scaled_sizes(monkeypatch, ours)
    images = [png_bytes((80, 48), seed=1), png_bytes((48, 64), seed=3)]
    expected = reference(ref, images)
    got = run_ours(ours, monkeypatch, DiffusionParams(
        num_inference_steps=STEPS, true_cfg_scale=4.0, negative_prompt=NEGATIVE, seed=0,
        image=images[0], extra_images=(images[1],)))
    # output: the last image's aspect, 64x64 -> 4x4 tokens
    assert got.shape == expected.shape == (1, 4 * 4, 4 * C)
    assert expected.abs().mean() > 0.3
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_bad_requests_refused(edit_pair, plus_pair) -> None:
    (_, edit), (_, plus) = edit_pair, plus_pair
    image = png_bytes((80, 48), seed=1)
    cases = [
        (edit, DiffusionParams(), "edits an input image"),
        (edit, DiffusionParams(image=image, extra_images=(image,)), "at most 1 input image,"),
        (plus, DiffusionParams(image=image, extra_images=(image,) * 3), "at most 3 input"),
        (edit, DiffusionParams(image=image, strength=0.5), "strength"),
        (edit, DiffusionParams(image=png_bytes((4000, 8), seed=0)), "too elongated"),
    ]
    for pipe, params, message in cases:
        with pytest.raises(InputError, match=message):
            pipe.validate(PROMPT, params)
    with pytest.raises(InputError, match="cannot be decoded"):
        edit.validate(PROMPT, DiffusionParams(image=b"not an image"))
