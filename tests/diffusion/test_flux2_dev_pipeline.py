"""FLUX.2 [dev] in our engine against diffusers' Flux2Pipeline on a tiny random pipeline folder
(float32): Mistral-3 text encoder (system message, layers 10, 20, 30), the guidance scale in
the guidance embedding, no CFG; the same latents for two images of one request; a negative
prompt refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.flux2 import Flux2Pipeline
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SEQ = 24                        # text max_sequence_length: the system message is truncated
SIZE = 32
PROMPT = "a photo of the sea shore"
# a chat template over Mistral-style content lists (the real one is Mistral Small 3.1's)
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ '<|im_end|>\\n' }}"
            "{% endfor %}")


def build_reference(path: Path) -> diffusers.Flux2Pipeline:
    """diffusers' Flux2Pipeline from tiny random components, saved to `path`; the Mistral-3
    decoder has 31 layers so the default stacked layers (10, 20, 30) exist."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    tokenizer.chat_template = TEMPLATE
    text_encoder = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16,
                         intermediate_size=32, num_hidden_layers=31, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         rope_theta=1e9, sliding_window=None, pad_token_id=0),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32,
                           patch_size=8, head_dim=8),
        spatial_merge_size=2, image_token_index=len(tokenizer) - 1)).eval()
    transformer = diffusers.Flux2Transformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True).eval()
    vae = diffusers.AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=32).eval()
    with torch.no_grad():   # diffusers zero-inits some layers: make every path count
        for model in (transformer, vae):
            for p in model.parameters():
                p.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    pipe = diffusers.Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                   tokenizer=tokenizer, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    return pipe


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.Flux2Pipeline, Flux2Pipeline]:
    path = tmp_path_factory.mktemp("flux2")
    ref = build_reference(path)
    ours = load_component("diffusion", "flux2").from_pretrained(
        path, "flux2", torch.device("cpu"), torch.float32)
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours


def test_matches_diffusers(pair: tuple[diffusers.Flux2Pipeline, Flux2Pipeline],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = pair
    seen: list[Tensor] = []
    decode = ours.decode
    monkeypatch.setattr(ours, "decode", lambda latents, params: seen.append(latents.clone())
                        or decode(latents, params))
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, DiffusionParams(height=SIZE, width=SIZE,
                                                    num_inference_steps=2, guidance_scale=2.5,
                                                    seed=0, num_images=2))
    run_to_end(engine)
    with torch.no_grad():
        expected = ref(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=2,
                       guidance_scale=2.5, generator=torch.Generator().manual_seed(0),
                       num_images_per_prompt=2, max_sequence_length=SEQ, output_type="latent",
                       return_dict=False)[0]
    # dev's output_type="latent" is the packed tokens (klein's: the unpacked latents)
    assert seen[0].shape == expected.shape == (2, (SIZE // 4) ** 2, 16)
    assert expected.abs().mean() > 0.3
    torch.testing.assert_close(seen[0], expected, atol=1e-4, rtol=1e-4)

    engine.add_request("b", PROMPT, DiffusionParams(height=SIZE, width=SIZE,
                                                    num_inference_steps=2, guidance_scale=5.0,
                                                    seed=0, num_images=2))
    run_to_end(engine)
    assert (seen[1] - expected).abs().max() > 1e-2      # the guidance embedding is live


def test_refuses_cfg_fields(pair: tuple[diffusers.Flux2Pipeline, Flux2Pipeline]) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match="negative_prompt: has no effect"):
        engine.add_request("x", PROMPT, DiffusionParams(height=SIZE, width=SIZE,
                                                        guidance_scale=4.0, negative_prompt="x"))
