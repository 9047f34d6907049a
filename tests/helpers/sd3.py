"""The tiny random SD3.5 folders (TinySD3: BASE, ODD) and diffusers' reference for them, shared
by the golden and the system SD3 tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines import sd3
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SEQ = 12                        # T5 max_sequence_length
HEIGHT, WIDTH = 20, 36          # pixels: the tiny VAE halves them, patches of 2 -> 5x9 tokens
PROMPTS = ("a photo of the sea shore", "the weather today is sunny")
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEEDS = 4, 4.5, (0, 7)
Pair = tuple["diffusers.StableDiffusion3Pipeline", sd3.StableDiffusion3Pipeline, Path]


@dataclass(frozen=True)
class TinySD3:
    """The sizes of a tiny random SD3.5 folder. BASE: the medium-like folder most tests use;
    ODD: one where nothing happens to line up (caption projection 24 against the T5 width 56,
    CLIPs 16 + 32 zero-padded to 56, 16 latent channels, the VAE's sample_size left at
    diffusers' default of 32 px, so every image here is larger than it)."""

    clip_widths: tuple[int, int] = (32, 24)
    clip_projection: int = 12               # each CLIP's; pooled = 2x this
    t5_width: int = 40                      # = the transformer's joint_attention_dim
    heads: int = 2
    head_dim: int = 8                       # caption_projection_dim = heads * head_dim
    sample_size: int = 16
    pos_embed_max_size: int = 12
    latent_channels: int = 4
    vae_sample_size: int | None = 64        # None: diffusers' default (32)
    shift_factor: float = 0.0609
    scaling_factor: float = 1.5305


BASE = TinySD3()
ODD = TinySD3(clip_widths=(16, 32), clip_projection=20, t5_width=56, heads=4, head_dim=6,
              sample_size=24, pos_embed_max_size=40, latent_channels=16, vae_sample_size=None,
              shift_factor=0.07, scaling_factor=1.3)


def clip(vocab: int, hidden: int, projection: int) -> transformers.CLIPTextModelWithProjection:
    return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=3, max_position_embeddings=77, projection_dim=projection,
        hidden_act="gelu", bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()


def build_reference(path: Path, sizes: TinySD3 = BASE) -> diffusers.StableDiffusion3Pipeline:
    """diffusers' StableDiffusion3Pipeline from tiny random components, saved to `path`."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    tokenizer.model_max_length = 77                     # CLIP's; diffusers pads to it
    vocab = len(tokenizer)
    text_encoder_3 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=vocab, d_model=sizes.t5_width, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0)).eval()
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=sizes.sample_size, patch_size=2, in_channels=sizes.latent_channels,
        num_layers=3, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.t5_width, caption_projection_dim=sizes.heads * sizes.head_dim,
        pooled_projection_dim=2 * sizes.clip_projection, out_channels=sizes.latent_channels,
        pos_embed_max_size=sizes.pos_embed_max_size, dual_attention_layers=(0,),
        qk_norm="rms_norm").eval()
    vae_sample_size = {} if sizes.vae_sample_size is None else {
        "sample_size": sizes.vae_sample_size}
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=sizes.latent_channels, norm_num_groups=4, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=sizes.shift_factor,
        scaling_factor=sizes.scaling_factor, **vae_sample_size).eval()
    golden.randomize(transformer, vae, std=0.15, keep=("pos_embed.pos_embed",))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)      # SD3's config
    width_l, width_g = sizes.clip_widths
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=clip(vocab, width_l, sizes.clip_projection), tokenizer=tokenizer,
        text_encoder_2=clip(vocab, width_g, sizes.clip_projection), tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer)
    return golden.save_reference(pipe, path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    path = tmp_path_factory.mktemp("sd3")
    ref = build_reference(path)
    ours = golden.load_ours(path, "sd3")
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours, path


def reference(ref: diffusers.StableDiffusion3Pipeline, output_type: str, **kwargs: object
              ) -> torch.Tensor:
    """Both prompts in one diffusers call, one generator per prompt (as ours: per request)."""
    params = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                             guidance_scale=GUIDANCE, negative_prompt=NEGATIVE)
    kwargs = {"max_sequence_length": SEQ, **kwargs}
    return golden.reference(ref, list(PROMPTS), params, output_type, seeds=SEEDS, **kwargs)
