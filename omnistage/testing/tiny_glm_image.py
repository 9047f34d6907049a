"""A tiny random GLM-Image folder in diffusers' layout, saved by diffusers' own
`GlmImagePipeline`: what the GLM-Image golden tests serve.

    transformer/   2 layers, 2 heads of 8, 2x2 patches, 4 latent channels, codebook 64
    vae/           AutoencoderKL, 4 levels (8x), 4 latent channels, random latents_mean/std
    text_encoder/  ByT5-style T5 encoder (gated GELU), d_model 16; tokenizer/ ByT5's bytes
    scheduler/     flow-match Euler, dynamic shifting as GLM-Image's (base 0.25, max 0.75)

    vision_language_encoder/  the AR model (`build_tiny_glm_image` only), 2 layers of 64
    processor/     GlmImageProcessor: a word-level tokenizer, visual token ids first (as the
                   real one), a chat template

`build_tiny_glm_image_dit` leaves the AR half out: the DiT's golden test feeds the reference
pipeline `prior_token_ids` as GlmImagePipeline accepts them.
"""

from __future__ import annotations

from pathlib import Path

import torch

C = 4                           # latent channels
CODEBOOK = 64
VISION_PATCH = 16               # the processor halves an input image: one token per 32 px


def build_tiny_glm_image_dit(path: Path):
    """Save the folder at `path`; returns diffusers' pipeline (float32, CPU) on the same
    weights, the reference of the golden tests."""
    pipe = tiny_glm_image_pipeline(None, None)
    pipe.save_pretrained(path)
    return pipe


def tiny_glm_image_pipeline(processor, vision_language_encoder):
    """diffusers' GlmImagePipeline of the tiny DiT half around the given AR half (None: none)."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    transformer = diffusers.GlmImageTransformer2DModel(
        patch_size=2, in_channels=C, out_channels=C, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
        prior_vq_quantizer_codebook_size=CODEBOOK)
    with torch.no_grad():           # diffusers zero-inits some: make every path count
        for p in transformer.parameters():
            p.normal_(0.0, 0.2)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=C, block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=4, sample_size=32,
        latents_mean=torch.randn(C).tolist(), latents_std=(torch.rand(C) + 0.5).tolist())
    text_encoder = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
        time_shift_type="linear")
    return diffusers.GlmImagePipeline(
        tokenizer=transformers.ByT5Tokenizer(), processor=processor,
        text_encoder=text_encoder.eval(), vision_language_encoder=vision_language_encoder,
        vae=vae.eval(), transformer=transformer.eval(), scheduler=scheduler)


GLYPH_WORDS = ("a", "the", "sign", "that", "reads", "OPEN", "and", "24/7", "quiet", "lake", "at",
               "dawn", "red", "cat", "on", "mat")
SPECIALS = ("<|endoftext|>", "[gMASK]", "<sop>", "<eop>", "<|user|>", "<|assistant|>",
            "<|image|>")
IMAGE_START, IMAGE_END = "<|begin_of_image|>", "<|end_of_image|>"    # ids CODEBOOK, +1
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% elif c['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tiny_glm_image_processor():
    """transformers' GlmImageProcessor over a word-level tokenizer laid out as the real one:
    ids 0..CODEBOOK+1 the visual tokens (`<|dit_token_i|>`; CODEBOOK starts an image, +1 ends
    it), then the specials, numbers and a few words."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ([f"<|dit_token_{i}|>" for i in range(CODEBOOK)] + [IMAGE_START, IMAGE_END]
             + list(SPECIALS)
             + [str(i) for i in range(64)] + list(GLYPH_WORDS) + ["[UNK]"])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        bos_token=IMAGE_START, unk_token="[UNK]",
        additional_special_tokens=list(SPECIALS[1:]),
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>",
                              "grid_eos_token": "<eop>", "image_end_token": IMAGE_END})
    images = transformers.GlmImageImageProcessorPil(patch_size=VISION_PATCH, merge_size=1,
                                                    temporal_patch_size=1)
    return transformers.GlmImageProcessor(image_processor=images, tokenizer=tokenizer,
                                          chat_template=CHAT_TEMPLATE)


def tiny_glm_image_ar(vocab_size: int):
    """GlmImageForConditionalGeneration, 2 layers of 64, its visual head over the codebook plus
    the image start / end tokens; weights larger than HF's init so every path counts. Its
    generation config samples with top_k=1 (greedy, as the reference's do_sample=True draws)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GlmImageConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vision_vocab_size=CODEBOOK + 2, pad_token_id=CODEBOOK + 1,
                         eos_token_id=CODEBOOK + 1, max_position_embeddings=512,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=[2, 1, 1],
                                              partial_rotary_factor=0.5)),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                           patch_size=VISION_PATCH, image_size=64),
        vq_config=dict(embed_dim=8, num_embeddings=CODEBOOK, latent_channels=16),
        image_token_id=CODEBOOK + 8, image_start_token_id=CODEBOOK,
        image_end_token_id=CODEBOOK + 1)
    model = transformers.GlmImageForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.2)
        # logit 0 for the image start / end tokens, below the best code's: greedy writes the
        # whole grid (an early end token leaves the reference pipeline no grid to decode)
        model.lm_head.weight[CODEBOOK:].zero_()
    model.generation_config = transformers.GenerationConfig(
        do_sample=True, top_k=1, eos_token_id=CODEBOOK + 1, pad_token_id=CODEBOOK + 1)
    return model


def build_tiny_glm_image(path: Path):
    """The whole GLM-Image folder (AR half in vision_language_encoder/ and processor/, DiT half
    as `build_tiny_glm_image_dit`); returns diffusers' pipeline on it, float32, CPU."""
    processor = tiny_glm_image_processor()
    pipe = tiny_glm_image_pipeline(processor, tiny_glm_image_ar(len(processor.tokenizer)))
    pipe.save_pretrained(path)
    return pipe


def split_condition_features(pipe) -> None:
    """Let diffusers 0.42's `GlmImagePipeline` edit with transformers 5: it concatenates its
    condition images' (C, h, w) features along C before the VQ, which transformers now
    tokenizes per image from a list (as its own forward passes them). Patches `pipe`'s AR
    model to split them back (condition images of one size), so it serves as the edit
    reference; text-to-image does not pass there. Older transformers (5.17, the device's)
    take the packed features diffusers passes: left as they are."""
    import inspect

    vle = pipe.vision_language_encoder
    inner = type(getattr(vle, "model", vle)).get_image_tokens       # GlmImageModel's own
    if "hidden_states.shape" in inspect.getsource(inner):
        return
    tokens, channels = vle.get_image_tokens, vle.config.vision_config.hidden_size
    vle.get_image_tokens = lambda feats, grids=None: tokens(
        list(feats.split(channels)) if torch.is_tensor(feats) else feats, grids)
