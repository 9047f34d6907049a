"""FluxPipeline in our engine against diffusers' FluxPipeline on a tiny random pipeline folder
(float32, with and without the guidance embedding): same packed latents and images, the same
image alone or batched with other requests, and bad requests refused at the boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.flux import FluxPipeline
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SEQ = 16                        # T5 max_sequence_length
SIZE = 32                       # pixels; the tiny VAE downsamples 2x, so 8x8 packed tokens
PROMPT = "a photo of the sea shore"


def build_reference(path: Path, guidance_embeds: bool, num_layers: int = 1,
                    num_single_layers: int = 1) -> diffusers.FluxPipeline:
    """diffusers' FluxPipeline from tiny random components, saved to `path`."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    tokenizer.model_max_length = 77                     # CLIP's; diffusers pads to it
    vocab = len(tokenizer)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    text_encoder_2 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0)).eval()
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=guidance_embeds).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035).eval()
    golden.randomize(transformer, vae)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(   # FLUX.1's scheduler config
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    pipe = diffusers.FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                  tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                                  tokenizer_2=tokenizer, transformer=transformer)
    return golden.save_reference(pipe, path)


@pytest.fixture(scope="module", params=[True, False], ids=["dev", "schnell"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.FluxPipeline, FluxPipeline]:
    path = tmp_path_factory.mktemp("flux")
    ref = build_reference(path, guidance_embeds=request.param)
    ours = golden.load_ours(path, "flux")
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours


def test_matches_diffusers(pair: tuple[diffusers.FluxPipeline, FluxPipeline]) -> None:
    ref, ours = pair
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=3.5,
                             seed=0, num_images=2)
    golden.matches_diffusers(ref, ours, PROMPT, params, shape=(2, (SIZE // 4) ** 2, 16),
                             max_sequence_length=SEQ)


def test_same_image_alone_or_batched(pair: tuple[diffusers.FluxPipeline, FluxPipeline]) -> None:
    _, ours = pair
    a = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=3.5,
                        seed=3)
    alone = DiffusionEngine(ours)
    alone.add_request("a", PROMPT, a)
    expected = run_to_end(alone)["a"].images

    batched = DiffusionEngine(ours)
    batched.add_request("b", "the weather today is sunny", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=5, guidance_scale=1.0, seed=4))
    batched.step()                                       # "a" joins one step behind "b"
    batched.add_request("a", PROMPT, a)
    # same token count, other grid: one engine batch, its own rope ids
    batched.add_request("c", "hello world", DiffusionParams(
        height=SIZE // 2, width=SIZE * 2, num_inference_steps=4, seed=5))
    done = run_to_end(batched)
    assert batched.num_steps_run == 5                    # every step shared one batch
    assert (done["a"].images.int() - expected.int()).abs().max() <= 1
    assert done["c"].images.shape == (1, SIZE // 2, SIZE * 2, 3)

    c_alone = DiffusionEngine(ours)
    c_alone.add_request("c", "hello world", DiffusionParams(
        height=SIZE // 2, width=SIZE * 2, num_inference_steps=4, seed=5))
    assert (run_to_end(c_alone)["c"].images.int() - done["c"].images.int()).abs().max() <= 1


@pytest.mark.parametrize("params, prompt, match", [
    (DiffusionParams(height=34, width=32), PROMPT, "multiple of 4"),
    (DiffusionParams(height=4096, width=32), PROMPT, "maximum is 2048"),
    (DiffusionParams(height=32, width=32, negative_prompt="blurry"), PROMPT, "true CFG"),
    (DiffusionParams(height=32, width=32, true_cfg_scale=4.0), PROMPT, "true CFG"),
    (DiffusionParams(height=32, width=32), "  ", "non-empty"),
])
def test_refuses_bad_requests(pair: tuple[diffusers.FluxPipeline, FluxPipeline],
                              params: DiffusionParams, prompt: str, match: str) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_graph(
        pair: tuple[diffusers.FluxPipeline, FluxPipeline], tmp_path: Path) -> None:
    from omnistage import Omni

    ref, ours = pair
    folder = tmp_path / "flux"
    ref.save_pretrained(folder)
    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate("a red cube", DiffusionParams(height=32, width=32,
                                                             num_inference_steps=2, seed=1))
        assert out.error is None and out.images[0].size == (32, 32)
        (bad,) = omni.generate("a red cube", DiffusionParams(height=33, width=32))
        assert bad.finish_reason == "error" and "multiple of" in str(bad.error)


def test_image_to_image_matches_diffusers(pair: tuple[diffusers.FluxPipeline, FluxPipeline],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An input image (48x40, resized to the asked 32x32 with Lanczos) encoded with a posterior
    draw, noised to the strength-shortened schedule, denoised: FluxImg2ImgPipeline's latents."""
    import io

    import numpy as np
    from PIL import Image

    ref, ours = pair
    pixels = np.random.default_rng(3).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    seen = golden.record_latents(ours, monkeypatch, key=golden.size_seed)
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=3.5, seed=5,
        image=buf.getvalue(), strength=0.7))
    (res,) = run_to_end(engine).values()
    assert res.metrics.num_steps == 3 and res.images.shape == (1, SIZE, SIZE, 3)

    img2img = diffusers.FluxImg2ImgPipeline(**ref.components)
    img2img.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = img2img(PROMPT, image=Image.fromarray(pixels), strength=0.7, height=SIZE,
                           width=SIZE, num_inference_steps=4, guidance_scale=3.5,
                           generator=torch.Generator().manual_seed(5), output_type="latent",
                           max_sequence_length=SEQ, return_dict=False)[0]
    torch.testing.assert_close(seen[f"{SIZE}x{SIZE}:5"], expected, atol=1e-4, rtol=0)


def test_step_caching(pair: tuple[diffusers.FluxPipeline, FluxPipeline]) -> None:
    """Threshold 0 equals no caching exactly; a positive threshold skips steps (counted) and
    stays close to the uncached image; a neighbour without caching is unaffected."""
    _, ours = pair

    def generate(threshold: float | None, with_neighbour: bool = False
                 ) -> dict[str, DiffusionResult]:
        engine = DiffusionEngine(ours)
        engine.add_request("a", PROMPT, DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=12, seed=9, cache_threshold=threshold))
        if with_neighbour:
            engine.add_request("b", "hello world", DiffusionParams(
                height=SIZE, width=SIZE, num_inference_steps=12, seed=1))
        return run_to_end(engine)

    plain = generate(None)["a"]
    zero = generate(0.0)["a"]
    assert zero.metrics.num_steps_skipped == 0 and torch.equal(zero.images, plain.images)
    cached = generate(0.3, with_neighbour=True)
    skipped = cached["a"].metrics.num_steps_skipped
    diff = (cached["a"].images.float() - plain.images.float()).abs().mean()
    assert 0 < skipped < 10, skipped
    assert diff < 5, f"mean pixel change {diff}"
    alone_b = DiffusionEngine(ours)
    alone_b.add_request("b", "hello world", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=12, seed=1))
    assert (run_to_end(alone_b)["b"].images.int() - cached["b"].images.int()).abs().max() <= 1


def test_images_larger_than_the_vae_sample_size_decode_whole(
        pair: tuple[diffusers.FluxPipeline, FluxPipeline], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """An image larger than the VAE's sample_size (32 px here) is decoded whole, as diffusers'
    pipeline does unless `vae.enable_tiling()` is called (tiling it made SD3 up to 80/255 off:
    issue 37); tiles come only above 2048 x 2048 px (AutoencoderKL.decode_images)."""
    ref, ours = pair
    seen = golden.record_latents(ours, monkeypatch, key=golden.size_seed)
    engine = DiffusionEngine(ours)
    params = DiffusionParams(height=64, width=48, num_inference_steps=2, seed=4)
    engine.add_request("a", PROMPT, params)
    run_to_end(engine)
    expected = golden.reference(ref, PROMPT, params, "pt", guidance_scale=3.5,
                                max_sequence_length=SEQ)
    with torch.no_grad():
        images = ours.decode_float(seen["64x48:4"], params)
    torch.testing.assert_close(images, expected, atol=1e-4, rtol=0)


def test_text_encoders_in_their_own_stage(pair: tuple[diffusers.FluxPipeline, FluxPipeline],
                                          tmp_path: Path) -> None:
    """flux_split.yaml: CLIP and T5 in a text-encoder stage, the diffusion stage without them;
    the same images as the default single-stage graph, prompts encoded in one batch."""
    from omnistage import Omni

    ref, _ = pair
    folder = tmp_path / "flux"
    ref.save_pretrained(folder)
    prompts = ["a red cube", "the weather today is sunny with a light breeze"]
    params = DiffusionParams(height=32, width=32, num_inference_steps=2, seed=1, num_images=2)
    images = {}
    for graph in (None, "flux_split"):
        with Omni(str(folder), stage_config=graph, device="cpu", backend="inproc",
                  connector="inproc") as omni:
            outs = omni.generate(prompts, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        images[graph] = [o.tensors["images"] for o in outs]
    assert list(outs[0].stage_metrics) == ["text_encoder", "dit"]
    for split, single in zip(images["flux_split"], images[None]):
        assert split.shape == (2, 32, 32, 3)
        assert (split.int() - single.int()).abs().max() <= 1
