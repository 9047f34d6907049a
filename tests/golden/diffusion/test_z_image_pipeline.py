"""ZImagePipeline in our engine against diffusers' ZImagePipeline on a tiny random pipeline folder
(float32, with and without classifier-free guidance): same latents and images, the same image
alone or batched with other requests, and bad requests refused at the boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.z_image import ZImagePipeline
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SEQ = 64                        # Qwen3 max_sequence_length
SIZE = 32                       # pixels; the tiny VAE downsamples 2x: 16x16 latents, 8x8 patches
PROMPT = "a photo of the sea shore"
NEGATIVE = "blurry, low quality"


def build_reference(path: Path) -> diffusers.ZImagePipeline:
    """diffusers' ZImagePipeline from tiny random components, saved to `path`."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    text_encoder = transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        pad_token_id=0)).eval()
    transformer = diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
        axes_lens=[128, 32, 32]).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611).eval()
    golden.randomize(transformer, vae)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(   # Z-Image-Turbo's scheduler config
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = diffusers.ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                    tokenizer=tokenizer, transformer=transformer)
    return golden.save_reference(pipe, path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.ZImagePipeline, ZImagePipeline]:
    path = tmp_path_factory.mktemp("z_image")
    ref = build_reference(path)
    ours = golden.load_ours(path, "z_image")
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours


@pytest.mark.parametrize("guidance, negative", [(0.0, None), (4.0, NEGATIVE), (2.5, None)],
                         ids=["no-cfg", "cfg-negative", "cfg-empty-negative"])
def test_matches_diffusers(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline],
                           guidance: float, negative: str | None) -> None:
    ref, ours = pair
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4,
                             guidance_scale=guidance, negative_prompt=negative, seed=0,
                             num_images=2)
    run = golden.matches_diffusers(ref, ours, PROMPT, params, shape=(2, 4, SIZE // 2, SIZE // 2),
                                   max_sequence_length=SEQ)
    assert run.latents.dtype == torch.float32


def test_guidance_changes_the_image(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline]
                                    ) -> None:
    """CFG is live: the negative prompt and the scale both move the result."""
    _, ours = pair
    images = {}
    for name, g, neg in [("off", 0.0, None), ("empty", 4.0, None), ("neg", 4.0, NEGATIVE)]:
        engine = DiffusionEngine(ours)
        engine.add_request(name, PROMPT, DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=g,
            negative_prompt=neg, seed=7))
        images[name] = run_to_end(engine)[name].images.float()
    assert (images["off"] - images["empty"]).abs().max() > 2
    assert (images["empty"] - images["neg"]).abs().max() > 2


def test_same_image_alone_or_batched(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline]
                                     ) -> None:
    _, ours = pair
    a = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=4.0,
                        negative_prompt=NEGATIVE, seed=3)
    alone = DiffusionEngine(ours)
    alone.add_request("a", PROMPT, a)
    expected = run_to_end(alone)["a"].images

    batched = DiffusionEngine(ours)
    batched.add_request("b", "the weather today is sunny", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=5, guidance_scale=0.0, seed=4))
    batched.step()                                       # "a" joins one step behind "b"
    batched.add_request("a", PROMPT, a)
    batched.add_request("c", "hello world", DiffusionParams(   # default guidance: CFG on
        height=SIZE, width=SIZE, num_inference_steps=4, seed=5, num_images=2))
    done = run_to_end(batched)
    assert batched.num_steps_run == 5                    # every step shared one batch
    assert (done["a"].images.int() - expected.int()).abs().max() <= 1

    c_alone = DiffusionEngine(ours)
    c_alone.add_request("c", "hello world", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=4, seed=5, num_images=2))
    assert (run_to_end(c_alone)["c"].images.int() - done["c"].images.int()).abs().max() <= 1


@pytest.mark.parametrize("params, prompt, match", [
    (DiffusionParams(height=34, width=32), PROMPT, "multiple of 4"),
    (DiffusionParams(height=4096, width=32), PROMPT, "maximum is 2048"),
    (DiffusionParams(height=32, width=32, true_cfg_scale=4.0), PROMPT, "true_cfg_scale"),
    (DiffusionParams(height=32, width=32, guidance_scale=0.0, negative_prompt="blurry"), PROMPT,
     "no effect"),
    (DiffusionParams(height=32, width=32), "  ", "non-empty"),
])
def test_refuses_bad_requests(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline],
                              params: DiffusionParams, prompt: str, match: str) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_graph(
        pair: tuple[diffusers.ZImagePipeline, ZImagePipeline], tmp_path: Path) -> None:
    from omnistage import Omni

    ref, _ = pair
    folder = tmp_path / "z_image"
    ref.save_pretrained(folder)
    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate("a red cube", DiffusionParams(height=32, width=32,
                                                             num_inference_steps=2, seed=1))
        assert out.error is None and out.images[0].size == (32, 32)
        (bad,) = omni.generate("a red cube", DiffusionParams(height=33, width=32))
        assert bad.finish_reason == "error" and "multiple of" in str(bad.error)


def png_bytes(size: tuple[int, int], seed: int = 0) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("strength, guidance", [(0.6, 0.0), (1.0, 4.0), (0.3, 4.0)])
def test_image_to_image_matches_diffusers(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline],
                                          monkeypatch: pytest.MonkeyPatch, strength: float,
                                          guidance: float) -> None:
    """An input image encoded, noised to the strength-shortened schedule and denoised: the
    final latents equal ZImageImg2ImgPipeline's (the output size is the image's)."""
    from PIL import Image
    import io

    ref, ours = pair
    data = png_bytes((SIZE, SIZE), seed=1)
    seen = golden.record_latents(ours, monkeypatch, key=golden.size_seed)
    engine = DiffusionEngine(ours)
    params = DiffusionParams(num_inference_steps=4, guidance_scale=guidance, seed=2,
                             image=data, strength=strength, num_images=2)
    engine.add_request("a", PROMPT, params)
    (res,) = run_to_end(engine).values()
    assert res.metrics.num_steps == 4 - int(4 - 4 * strength)

    img2img = diffusers.ZImageImg2ImgPipeline(**ref.components)
    img2img.set_progress_bar_config(disable=True)
    expected = golden.reference(img2img, PROMPT, params, "latent", strength=strength,
                                image=Image.open(io.BytesIO(data)), max_sequence_length=SEQ)
    golden.assert_latents_match(seen["NonexNone:2"], expected)
    assert res.images.shape == (2, SIZE, SIZE, 3)


def test_image_to_image_bad_input(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline]) -> None:
    engine = DiffusionEngine(pair[1])
    engine.add_request("ok", PROMPT, DiffusionParams(num_inference_steps=1, seed=0,
                                                     image=png_bytes((SIZE, SIZE))))
    with pytest.raises(ValueError, match="cannot be decoded"):
        engine.add_request("x", PROMPT, DiffusionParams(image=b"not an image at all"))
    with pytest.raises(ValueError, match="smaller than"):
        engine.add_request("y", PROMPT, DiffusionParams(image=png_bytes((2, 2))))
    with pytest.raises(ValueError, match="strength"):
        DiffusionParams(strength=0.5)
    with pytest.raises(ValueError, match="strength"):
        DiffusionParams(image=png_bytes((SIZE, SIZE)), strength=0.0)
    assert list(engine.requests) == ["ok"]          # the good request is undisturbed
    assert run_to_end(engine)["ok"].images.shape == (1, SIZE, SIZE, 3)


@pytest.mark.parametrize("guidance", [0.0, 4.0], ids=["no-cfg", "cfg"])
def test_step_caching(pair: tuple[diffusers.ZImagePipeline, ZImagePipeline],
                      guidance: float) -> None:
    """Threshold 0 equals no caching exactly; a positive threshold skips steps (counted), keeps
    close to the uncached image, and does not change what other requests in the batch get."""
    _, ours = pair

    def generate(threshold: float | None, with_neighbour: bool = False) -> DiffusionResult:
        engine = DiffusionEngine(ours)
        engine.add_request("a", PROMPT, DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=12, guidance_scale=guidance, seed=9,
            cache_threshold=threshold))
        if with_neighbour:
            engine.add_request("b", "hello world", DiffusionParams(
                height=SIZE, width=SIZE, num_inference_steps=12, guidance_scale=4.0, seed=1))
        return run_to_end(engine)

    plain = generate(None)["a"]
    zero = generate(0.0)["a"]
    assert zero.metrics.num_steps_skipped == 0
    assert torch.equal(zero.images, plain.images)
    cached = generate(1.2, with_neighbour=True)   # the tiny model moves ~0.5-1.1 per step
    skipped = cached["a"].metrics.num_steps_skipped
    assert 0 < skipped < 10, skipped
    diff = (cached["a"].images.float() - plain.images.float()).abs().mean()
    assert diff < 5, f"mean pixel change {diff}"           # ~0.2 / 255 with 5 of 12 skipped
    alone_b = DiffusionEngine(ours)
    alone_b.add_request("b", "hello world", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=12, guidance_scale=4.0, seed=1))
    assert (run_to_end(alone_b)["b"].images.int() - cached["b"].images.int()).abs().max() <= 1
