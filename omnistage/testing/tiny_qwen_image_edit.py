"""Tiny random Qwen-Image-Edit / Edit-Plus folders in diffusers' layout, saved by diffusers'
own `QwenImageEditPipeline` / `QwenImageEditPlusPipeline`: what the edit pipelines' golden
tests, the edit server test and the GPU test serve.

    text_encoder/  Qwen2.5-VL: 2 text layers (hidden 16, mrope sections 1/1/2) and a 2-block
                   vision tower (patch 4, merge 2, windows of 2x2 merged tokens, block 1 full)
    processor/     the Qwen2-VL image processor (images to 8x8 .. 32x32 pixels) + tokenizer
    transformer/   2 layers, 2x2 patches, 4 latent channels; vae/ base_dim 4

transformers' Qwen2VLProcessor insists on a video processor (torchvision, not installed here),
so the reference's is built without one; it never sees a video. Its `mm_token_type_ids` are
forwarded to the reference text encoder (`forward_token_types`, diffusers PR #14189): without
them transformers >= 5.15 silently drops the images' multimodal positions.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.testing.tiny_omni import build_tiny_omni_tokenizer

C = 4                           # latent channels


def tiny_processor(tokenizer):
    """Qwen2VLProcessor without a video processor, saving what a real processor/ holds."""
    import transformers
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


def build_tiny_qwen_image_edit(path: Path, plus: bool = False, zero_cond_t: bool = False):
    """diffusers' QwenImageEditPipeline (plus: QwenImageEditPlusPipeline) from tiny random
    components, saved to `path`; returned with its text encoder fixed (see above).
    zero_cond_t: the transformer of Qwen-Image-Edit-2511 (the input images' tokens see t=0)."""
    import diffusers
    import transformers

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
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
        zero_cond_t=zero_cond_t).eval()
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=4, z_dim=C, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
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
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    pipe = cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               processor=tiny_processor(tokenizer), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    forward_token_types(text_encoder, tid("<|image_pad|>"))
    return pipe
